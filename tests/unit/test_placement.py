"""Where an attempt's pods land and how long they get to stop: a multi-node job's ranks on one GPU
product and on different nodes, and a grace period for the slowest card the pods may land on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob.gpus import GpuProfile, profile_for_type
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator import builders, pods
from sftjob_operator.planning import plan_candidates, planner_plan
from sftjob_operator.scheduling import HOSTNAME_LABEL, default_products, node_affinity
from tests.unit.test_builders import JOB, fake_plan, spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TWO_NODES = {"type": "A800", "count": 4, "nodes": 2}  # A800 allows five product labels


def attempt_pods(s: SFTJobSpec, *, avoid_nodes: tuple[str, ...] = (), plan_fn: Any = fake_plan) -> list[Any]:
    plans = plan_candidates(s, default_products(), plan_fn)
    affinity = node_affinity(s.gpu.candidates(), default_products(), avoid_nodes=avoid_nodes)
    children = pods.attempt_children(JOB, s, plans, affinity=affinity, image="t:1", ranks=range(s.gpu.nodes))
    return [m for m in children if m["kind"] == "Pod"]


def selects(term: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a pod affinity term's ``matchLabels`` selects a pod with ``labels``."""
    wanted = term["labelSelector"]["matchLabels"]
    return all(labels.get(key) == value for key, value in wanted.items())


def required(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    (term,) = pod["spec"]["affinity"][kind]["requiredDuringSchedulingIgnoredDuringExecution"]
    return dict(term)


def test_every_rank_of_a_multi_node_job_requires_the_gpu_product_of_the_other_ranks() -> None:
    made = attempt_pods(spec(gpu=TWO_NODES))
    assert len(made) == 2
    for pod in made:
        term = required(pod, "podAffinity")
        assert term["topologyKey"] == c.GFD_PRODUCT
        # The first pod is let through only because it matches its own term (kube-scheduler's rule).
        assert all(selects(term, other["metadata"]["labels"]) for other in made)


def test_no_two_ranks_of_a_multi_node_job_share_a_node() -> None:
    rank0, rank1 = attempt_pods(spec(gpu=TWO_NODES))
    term = required(rank1, "podAntiAffinity")
    assert term["topologyKey"] == HOSTNAME_LABEL
    assert selects(term, rank0["metadata"]["labels"])
    assert required(rank0, "podAntiAffinity") == term


def test_the_ranks_follow_only_their_own_attempt_not_an_earlier_one_nor_a_namesake_job() -> None:
    term = required(attempt_pods(spec(gpu=TWO_NODES))[0], "podAffinity")
    earlier = builders.labels(JOB.model_copy(update={"attempt": JOB.attempt - 1}), attempt=JOB.attempt - 1)
    namesake = JobRef(namespace=JOB.namespace, name=JOB.name, uid="uid-2", attempt=JOB.attempt)
    assert not selects(term, earlier)
    assert not selects(term, builders.labels(namesake, attempt=namesake.attempt))


def test_a_single_node_pod_has_only_its_node_affinity() -> None:
    (pod,) = attempt_pods(spec(gpu={"type": "Any", "count": 8}))
    assert set(pod["spec"]["affinity"]) == {"nodeAffinity"}


def test_the_node_affinity_and_its_avoidance_of_failed_nodes_stay_beside_the_pod_affinity() -> None:
    s = spec(gpu={"type": "Any", "count": 4, "nodes": 2})
    for pod in attempt_pods(s, avoid_nodes=("a800-1",)):
        affinity = pod["spec"]["affinity"]
        assert set(affinity) == {"nodeAffinity", "podAffinity", "podAntiAffinity"}
        assert affinity["nodeAffinity"] == node_affinity(
            s.gpu.candidates(), default_products(), avoid_nodes=("a800-1",)
        )


def test_the_grace_covers_a_step_and_the_save_on_the_slowest_card_the_pods_may_land_on() -> None:
    body = yaml.safe_load((EXAMPLES / "l40s-qlora.yaml").read_text())["spec"]
    s = SFTJobSpec.model_validate(body | {"gpu": {"type": "Any", "count": 1}})
    plans = plan_candidates(s, default_products())
    a40, a800 = plans.plans["A40"], plans.first
    assert a800.gpu.startswith("A800") and a40.fits
    assert pods.step_seconds(s, a40) > 2 * pods.step_seconds(s, a800)  # ~466 s against ~187 s
    (pod,) = attempt_pods(s, plan_fn=planner_plan)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace == pods.grace_seconds(s, a40) > pods.grace_seconds(s, a800)
    # A SIGTERM just after a step began on an A40: torchrun lets the workers finish it and save.
    assert (
        f"--shutdown-timeout={grace - pods.TORCHRUN_SHUTDOWN_MARGIN_SECONDS}"
        in pod["spec"]["containers"][0]["command"]
    )
    assert grace - pods.TORCHRUN_SHUTDOWN_MARGIN_SECONDS > pods.step_seconds(s, a40) + a40.checkpoint_gib * 2


def test_a_card_whose_plan_does_not_fit_does_not_lengthen_the_grace() -> None:
    def slow_a40_that_does_not_fit(s: SFTJobSpec, profile: GpuProfile) -> Plan:
        plan = fake_plan(s, profile)
        if profile.key != "A40":
            return plan
        return plan.model_copy(update={"fits": False, "predicted_tokens_per_second": 1.0})

    s = spec(gpu={"types": ["A800", "A40"], "count": 4})
    (pod,) = attempt_pods(s, plan_fn=slow_a40_that_does_not_fit)
    fast = fake_plan(s, profile_for_type("A800"))
    assert pod["spec"]["terminationGracePeriodSeconds"] == pods.grace_seconds(s, fast)
