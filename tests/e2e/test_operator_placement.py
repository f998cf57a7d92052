"""Trainer pods land on the GPU nodes the SFTJob asks for, and a job that cannot be placed says why."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import yaml
from operator_harness import REPO, Jobs, sftjob, wait_for

from sftjob.gpus import products_for_type

pytestmark = pytest.mark.e2e

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def allowed_types(spec: dict[str, object]) -> list[str]:
    gpu = dict(spec.get("gpu") or {})  # type: ignore[call-overload]
    if gpu.get("types"):
        return list(gpu["types"])
    return ["A800", "A40", "L40S"] if gpu.get("type", "Any") == "Any" else [str(gpu["type"])]


def footprint(manifest: dict[str, Any]) -> tuple[int, int]:
    gpu = manifest["spec"]["gpu"]
    return int(gpu.get("nodes", 1)), int(gpu["count"])


def test_every_example_lands_only_on_nodes_of_its_gpu_type(jobs: Jobs) -> None:
    # Largest first, each running before the next: all at once, a 1-GPU `Any` pod could take the A800
    # node the 4-GPU example left half free, and the two 4-GPU ranks of the multi-node example (on
    # different nodes) would then have only one node with room: a race of the test, not of the operator.
    manifests = sorted((yaml.safe_load(p.read_text()) for p in EXAMPLES), key=footprint, reverse=True)
    for manifest in manifests:
        name, spec = manifest["metadata"]["name"], manifest["spec"]
        jobs.apply(manifest)
        nodes = spec["gpu"].get("nodes", 1)
        pods = jobs.running_pods(name, count=nodes, timeout=60)
        products = {p for t in allowed_types(spec) for p in products_for_type(t)}
        for pod in pods:
            assert jobs.node_product(pod["spec"]["nodeName"]) in products, (name, pod["spec"]["nodeName"])
        status = jobs.wait_phase(name, "Running")
        assert status["gpu"]["type"] in allowed_types(spec)
        by_rank = sorted(pods, key=lambda p: p["metadata"]["labels"]["sftjob.io/node-rank"])
        assert status["gpu"]["nodes"] == [p["spec"]["nodeName"] for p in by_rank]


def test_any_lands_on_a_free_gpu_type_and_is_planned_for_the_type_it_landed_on(jobs: Jobs) -> None:
    jobs.apply(
        sftjob("fill-a", gpu={"type": "A800", "count": 8}), sftjob("fill-b", gpu={"type": "A800", "count": 8})
    )
    jobs.running_pods("fill-a")
    jobs.running_pods("fill-b")
    jobs.apply(
        sftjob(
            "anywhere", model={"name": "meta-llama/Llama-3.1-8B-Instruct"}, gpu={"type": "Any", "count": 4}
        )
    )
    (pod,) = jobs.running_pods("anywhere")
    landed = jobs.node_product(pod["spec"]["nodeName"])
    assert landed in products_for_type("L40S") + products_for_type("A40")
    status = jobs.wait_phase("anywhere", "Running")
    assert status["gpu"]["product"] == landed
    assert status["plan"]["gpu"] == status["gpu"]["profile"] == status["gpu"]["type"]
    config = json.loads(jobs.kubectl("get", "configmap", "anywhere-config", "-o", "json").stdout)["data"]
    assert f"config-{status['plan']['gpu']}.json" in config  # the trainer finds its own row


def test_a_multi_node_job_keeps_its_ranks_on_one_gpu_product_and_on_different_nodes(jobs: Jobs) -> None:
    # One A40 node and one L40S node full: the pair's first rank takes the other A40 node (its first
    # preference), where a second rank would fit too, and the other L40S node is free.
    jobs.apply(sftjob("fill-a40", gpu={"type": "A40", "count": 4}))
    jobs.apply(sftjob("fill-l40s", gpu={"type": "L40S", "count": 4}))
    jobs.running_pods("fill-a40")
    jobs.running_pods("fill-l40s")
    jobs.apply(sftjob("pair", gpu={"types": ["A40", "L40S"], "count": 2, "nodes": 2}))
    (first,) = jobs.running_pods("pair")
    assert jobs.node_product(first["spec"]["nodeName"]) == "NVIDIA-A40"
    # Not beside it on its node, not on the L40S node: the second rank waits for an A40 node.
    waiting = wait_for(
        "the second rank to be Unschedulable",
        lambda: (c := jobs.condition("pair", "Scheduled")).get("reason") == "Unschedulable" and c,
    )
    assert "didn't match pod affinity rules" in waiting["message"]  # the L40S node
    assert "didn't match pod anti-affinity rules" in waiting["message"]  # the first rank's node
    assert len([p for p in jobs.pods("pair") if p["status"].get("phase") == "Running"]) == 1
    jobs.kubectl("delete", "sftjob", "fill-a40", "--wait=true")
    ranks = jobs.running_pods("pair", count=2, timeout=60)
    nodes = {p["spec"]["nodeName"] for p in ranks}
    assert len(nodes) == 2 and {jobs.node_product(n) for n in nodes} == {"NVIDIA-A40"}
    assert jobs.wait_phase("pair", "Running")["gpu"]["type"] == "A40"


def test_a_job_asking_for_more_gpus_than_any_node_has_stays_pending_and_says_why(jobs: Jobs) -> None:
    jobs.apply(sftjob("too-big", gpu={"type": "A40", "count": 8}))
    wait_for("Unschedulable", lambda: jobs.condition("too-big", "Scheduled").get("reason") == "Unschedulable")
    message = jobs.condition("too-big", "Scheduled")["message"]
    assert "Insufficient nvidia.com/gpu" in message
    time.sleep(2)
    assert jobs.status("too-big")["phase"] == "Pending"


def test_a_namespace_enforcing_the_restricted_pod_security_profile_admits_the_trainer_pods(
    jobs: Jobs,
) -> None:
    jobs.cluster.kubectl(
        "label", "namespace", jobs.namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    jobs.apply(sftjob("restricted"))
    (pod,) = jobs.running_pods("restricted")
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_a_pod_a_quota_refuses_is_reported_and_created_once_the_quota_allows_it(jobs: Jobs) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-gpus"},
        "spec": {"hard": {"requests.nvidia.com/gpu": "0"}},
    }
    jobs.apply(quota)
    jobs.apply(sftjob("over-quota"))
    refused = wait_for(
        "Scheduled=False FailedCreate",
        lambda: (c := jobs.condition("over-quota", "Scheduled")).get("reason") == "FailedCreate" and c,
    )
    assert "quota" in refused["message"] and refused["status"] == "False"

    def reasons() -> set[str]:
        events = jobs.kubectl(
            "get", "events", "--field-selector=involvedObject.name=over-quota", "-o", "json"
        )
        return {e["reason"] for e in json.loads(events.stdout)["items"]}

    # The event is posted after the status write that was just seen.
    wait_for("the FailedCreate event", lambda: "FailedCreate" in reasons(), timeout=15)
    jobs.kubectl("delete", "resourcequota", "no-gpus")
    jobs.running_pods("over-quota", timeout=60)
    status = jobs.wait_phase("over-quota", "Running")
    assert status["attempt"] == 1 and status.get("restarts", 0) == 0
