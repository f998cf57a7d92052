"""Node affinity for trainer pods: GPU types are required and ranked, failed nodes are only avoided."""

from __future__ import annotations

from typing import Any

from sftjob_operator.scheduling import AVOID_WEIGHT, default_products, node_affinity

PRODUCTS = default_products()


def preferred_score(affinity: dict[str, Any], node: str, product: str) -> int:
    """The scheduler's NodeAffinity score of a node: the weights of the preferred terms it matches."""
    score = 0
    for term in affinity.get("preferredDuringSchedulingIgnoredDuringExecution", []):
        preference = term["preference"]
        labels = all(product in e["values"] for e in preference.get("matchExpressions", []))
        fields = all(node not in e["values"] for e in preference.get("matchFields", []))
        score += term["weight"] if labels and fields else 0
    return score


def test_nodes_that_failed_the_job_are_a_preference_so_a_small_pool_still_schedules() -> None:
    affinity = node_affinity(["A800"], PRODUCTS, avoid_nodes=("a800-1",))
    required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all("matchFields" not in term for term in required)
    [avoid] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert avoid == {
        "weight": AVOID_WEIGHT,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["a800-1"]}]},
    }


def test_a_healthy_node_of_any_candidate_type_outscores_a_failed_node_of_the_preferred_type() -> None:
    affinity = node_affinity(["A800", "L40S", "A40"], PRODUCTS, avoid_nodes=("a800-bad",))
    failed = preferred_score(affinity, "a800-bad", "NVIDIA-A800-SXM4-80GB")
    for node, product in (
        ("a800-ok", "NVIDIA-A800-SXM4-80GB"),
        ("l40s", "NVIDIA-L40S"),
        ("a40", "NVIDIA-A40"),
    ):
        assert preferred_score(affinity, node, product) > failed
    assert preferred_score(affinity, "l40s", "NVIDIA-L40S") > preferred_score(affinity, "a40", "NVIDIA-A40")


def test_a_single_type_with_no_failed_node_has_no_preferences() -> None:
    affinity = node_affinity(["L40S"], PRODUCTS)
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in affinity


def test_each_failed_node_is_its_own_field_requirement_as_the_api_server_takes_one_value_each() -> None:
    affinity = node_affinity(["A800"], PRODUCTS, avoid_nodes=("a800-1", "a800-2"))
    [avoid] = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    assert avoid["preference"]["matchFields"] == [
        {"key": "metadata.name", "operator": "NotIn", "values": ["a800-1"]},
        {"key": "metadata.name", "operator": "NotIn", "values": ["a800-2"]},
    ]
    for node in ("a800-1", "a800-2"):
        assert preferred_score(affinity, node, "NVIDIA-A800-SXM4-80GB") < preferred_score(
            affinity, "a800-3", "NVIDIA-A800-SXM4-80GB"
        )
