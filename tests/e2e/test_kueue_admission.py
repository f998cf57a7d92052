"""SFTJobs with a `queueName` under the real Kueue (its manager built from its Go module, with its own
webhooks): the pods of an attempt form one pod group that waits in the queue, gated, until its quota is
free; the whole group is admitted at once; a preempted attempt is retried in the queue, not failed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kueue_harness import NAMESPACE_LABEL, Kueue
from operator_harness import REPO, Jobs, sftjob, wait_for

from sftjob_dev.cluster import Cluster

pytestmark = pytest.mark.e2e

QUEUE = "team-a"
GPUS = 8  # the ClusterQueue's whole quota: one 8-GPU job fills it
LOW, HIGH = "sftjob-e2e-low", "sftjob-e2e-high"


@pytest.fixture(scope="module")
def kueue(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    manager = Kueue(cluster, tmp_path_factory.mktemp("kueue"))
    manager.start()
    classes = [{"name": LOW, "value": 100}, {"name": HIGH, "value": 1000}]
    cluster.kubectl(
        "apply", "-f", "-",
        input=yaml.safe_dump_all(
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": c["name"]},
             "value": c["value"]} for c in classes
        ),
    )  # fmt: skip
    yield manager
    manager.stop()


@pytest.fixture
def queue(cluster: Cluster, kueue: Kueue, namespace: str) -> Iterator[str]:
    """LocalQueue `team-a` in the test's namespace, feeding a ClusterQueue of its own with GPUS GPUs
    that lets a higher-priority workload preempt a lower one."""
    cluster.kubectl("label", "namespace", namespace, f"{NAMESPACE_LABEL}=true")
    resources = [
        {"name": "cpu", "nominalQuota": 1000},
        {"name": "memory", "nominalQuota": "10Ti"},
        {"name": "nvidia.com/gpu", "nominalQuota": GPUS},
    ]
    objects: list[dict[str, Any]] = [
        {"kind": "ResourceFlavor", "metadata": {"name": "sftjob-e2e-gpu"}},
        {
            "kind": "ClusterQueue",
            "metadata": {"name": namespace},
            "spec": {
                "namespaceSelector": {},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": [r["name"] for r in resources],
                        "flavors": [{"name": "sftjob-e2e-gpu", "resources": resources}],
                    }
                ],
            },
        },
        {
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": namespace},
        },
    ]
    docs = [{"apiVersion": "kueue.x-k8s.io/v1beta2", **o} for o in objects]
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    wait_for("the ClusterQueue to be active", lambda: _active(cluster, namespace))
    yield QUEUE
    cluster.kubectl("delete", "clusterqueue", namespace, "--wait=false", check=False)


def test_a_queued_job_waits_gated_for_quota_and_its_pod_group_is_admitted_whole(
    queue: str, jobs: Jobs
) -> None:
    jobs.apply(sftjob("first", gpu={"type": "A800", "count": GPUS}, queueName=queue))
    (first,) = jobs.running_pods("first")
    assert jobs.wait_phase("first", "Running")["startTime"]

    # A full fine-tune sharded over two nodes: global rank 0 alone loads the model, yet under a queue both
    # pods ask for node rank 0's memory: one pod shape, one PodSet, one flavor for the whole group.
    seven_b = {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
        "method": "full",
        "checkpoints": {"size": "400Gi"},
    }
    jobs.apply(sftjob("second", **seven_b, gpu={"type": "A800", "count": 4, "nodes": 2}, queueName=queue))
    gated = wait_for("both pods of second to be gated", lambda: _gated(jobs, "second", 2))
    memory = {p["metadata"]["labels"]["sftjob.io/node-rank"]: _memory(p) for p in gated}
    assert memory == {"0": "72Gi", "1": "72Gi"}
    group = {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in gated}
    assert len(group) == 1  # one attempt, one pod group, one Workload
    scheduled = wait_for(
        "second to say why Kueue holds it",
        lambda: (
            "quota" in (found := _reason(jobs, "second", "Scheduled", "Queued") or {}).get("message", "")
            and found
        ),
    )
    assert f"Kueue's queue {queue}" in scheduled["message"]
    assert "insufficient unused quota for nvidia.com/gpu" in scheduled["message"]  # Kueue's own words
    assert jobs.status("second").get("startTime") is None  # the deadline has not started
    name = next(iter(group))
    workload = wait_for("second's Workload", lambda: _workload(jobs, name))
    assert [s["count"] for s in workload["spec"]["podSets"]] == [2]
    reserved = next(c for c in workload["status"]["conditions"] if c["type"] == "QuotaReserved")
    assert (
        reserved["status"] == "False"
        and "insufficient unused quota for nvidia.com/gpu" in reserved["message"]
    )

    jobs.steer(first["metadata"]["name"], outcome="succeed")  # the first job ends: its quota is free
    jobs.wait_phase("first", "Succeeded")
    pods = jobs.running_pods("second", count=2, timeout=60)
    assert len({p["spec"]["nodeName"] for p in pods}) == 2
    assert jobs.wait_phase("second", "Running")["startTime"]


def test_a_preempted_attempt_goes_back_to_the_queue_without_spending_a_restart(
    queue: str, jobs: Jobs
) -> None:
    policy = {"maxRestarts": 0}  # a failure would end the job: preemption must not count as one
    low = sftjob("low", gpu={"type": "A800", "count": GPUS}, queueName=queue, priorityClassName=LOW)
    jobs.apply({**low, "spec": {**low["spec"], "restartPolicy": policy}})
    jobs.running_pods("low")
    jobs.wait_phase("low", "Running")

    jobs.apply(sftjob("high", gpu={"type": "A800", "count": 4}, queueName=queue, priorityClassName=HIGH))
    (high,) = jobs.running_pods("high", timeout=60)
    first = wait_for("low's first attempt to end", lambda: _ended(jobs, "low", 1))
    assert first["reason"] == "Preempted" and "stopped by Kueue" in first["message"], first
    wait_for("low's second attempt to be gated", lambda: _gated(jobs, "low", 1))
    wait_for("low to say it is queued again", lambda: _reason(jobs, "low", "Scheduled", "Queued"))
    assert jobs.status("low")["phase"] != "Failed"

    jobs.steer(high["metadata"]["name"], outcome="succeed")
    (pod,) = jobs.running_pods("low", timeout=60)
    assert pod["metadata"]["labels"]["sftjob.io/attempt"] == "2"
    assert jobs.wait_phase("low", "Running")["attempt"] == 2


def test_a_failed_pod_ends_its_group_and_the_next_attempt_is_a_new_group_admitted_on_the_freed_quota(
    queue: str, jobs: Jobs
) -> None:
    jobs.apply(sftjob("pair", gpu={"type": "A800", "count": 4, "nodes": 2}, queueName=queue))
    pods = jobs.running_pods("pair", count=2, timeout=60)
    first_group = _group(pods)
    rank1 = next(p for p in pods if p["metadata"]["labels"]["sftjob.io/node-rank"] == "1")
    jobs.steer(rank1["metadata"]["name"], outcome="fail", exit_code="1", message="rank 1 crashed")

    def second_attempt() -> list[dict[str, Any]] | None:
        found = [p for p in jobs.pods("pair") if p["metadata"]["labels"]["sftjob.io/attempt"] == "2"]
        running = [p for p in found if p["status"].get("phase") == "Running"]
        return running if len(running) == 2 else None

    again = wait_for("pair's second attempt to run", second_attempt, timeout=90)
    assert _group(again) != first_group  # a new Workload: the quota (all GPUS GPUs) was the old one's
    finished = _workload(jobs, first_group)
    assert finished is None or any(
        c["type"] == "Finished" and c["status"] == "True" for c in finished["status"]["conditions"]
    )
    assert _ended(jobs, "pair", 1)["reason"] != "Preempted"


def test_a_job_naming_a_queue_that_does_not_exist_says_so_while_it_waits(queue: str, jobs: Jobs) -> None:
    jobs.apply(sftjob("typo", gpu={"type": "A800", "count": 1}, queueName="team-b"))
    wait_for("typo's pod to be gated", lambda: _gated(jobs, "typo", 1))
    scheduled = wait_for(
        "typo to say its queue is missing",
        lambda: (
            "team-b" in (found := _reason(jobs, "typo", "Scheduled", "Queued") or {}).get("message", "")
            and "exist" in found["message"]
            and found
        ),
    )
    assert jobs.status("typo")["phase"] == "Pending", scheduled


def test_the_queue_objects_of_the_queued_example_are_kueues_and_run_the_example_on_their_flavor(
    cluster: Cluster, kueue: Kueue, namespace: str, jobs: Jobs
) -> None:
    example = (REPO / "examples" / "queued-lora.yaml").read_text()
    block = example[
        example.index("#   apiVersion: kueue.x-k8s.io") : example.index("\napiVersion: sftjob.io")
    ]
    queues = "\n".join(line.removeprefix("#   ") for line in block.splitlines())
    queues = queues.replace("<the job's namespace>", namespace)
    cluster.kubectl("label", "namespace", namespace, f"{NAMESPACE_LABEL}=true")
    cluster.kubectl("apply", "-f", "-", input=queues)  # through Kueue's own validating webhooks
    try:
        jobs.apply(yaml.safe_load(example))
        (pod,) = jobs.running_pods("llama-8b-lora-queued", timeout=60)
        assert pod["metadata"]["labels"].get("kueue.x-k8s.io/managed") == "true"
        # The operator only prefers L40S (node affinity, no nodeSelector): the selector is Kueue's, from
        # the l40s flavor's nodeLabels, put on the pod when it admitted the group.
        selector = pod["spec"].get("nodeSelector") or {}
        assert selector.get("nvidia.com/gpu.product") == "NVIDIA-L40S", pod["spec"]
        assert jobs.node_product(pod["spec"]["nodeName"]) == "NVIDIA-L40S"
    finally:
        jobs.delete_all()
        cluster.kubectl("delete", "clusterqueue", "gpus", "--wait=false", check=False)


def _group(pods: list[dict[str, Any]]) -> str:
    (group,) = {p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] for p in pods}
    return str(group)


def _active(cluster: Cluster, name: str) -> bool:
    found = json.loads(cluster.kubectl("get", "clusterqueue", name, "-o", "json").stdout)
    return any(
        c["type"] == "Active" and c["status"] == "True" for c in found.get("status", {}).get("conditions", [])
    )


def _gated(jobs: Jobs, job: str, count: int) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in jobs.pods(job)
        if p["spec"].get("schedulingGates") and not p["metadata"].get("deletionTimestamp")
    ]
    return pods if len(pods) == count else None


def _reason(jobs: Jobs, job: str, type: str, reason: str) -> dict[str, Any] | None:
    found = jobs.condition(job, type)
    return found if found.get("reason") == reason else None


def _workload(jobs: Jobs, name: str) -> dict[str, Any] | None:
    found = jobs.kubectl("get", "workload", name, "-o", "json", check=False)
    return json.loads(found.stdout) if found.returncode == 0 and '"conditions"' in found.stdout else None


def _ended(jobs: Jobs, job: str, attempt: int) -> dict[str, Any] | None:
    records = [
        a for a in jobs.status(job).get("attempts", []) if a["attempt"] == attempt and a.get("endTime")
    ]
    return records[0] if records else None


def _memory(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["resources"]["requests"]["memory"])
