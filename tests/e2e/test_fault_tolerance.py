"""Fault tolerance on the real control plane: a KWOK-steered failure of each class ends the attempt
with the right classification in ``status.attempts``, the right event, and the right next step (a
re-plan, more memory, another node, safer NCCL settings, a backoff, or a clear failure); an operator
killed mid-backoff picks up where it left off.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes.utils.quantity import parse_quantity
from operator_harness import Jobs, Operator, sftjob, wait_for

from sftjob import constants as c
from sftjob_dev.cluster import Cluster

pytestmark = pytest.mark.e2e

TEST_POOL_LABEL = "sftjob.test/pool"
OOM_MESSAGE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
# Planned on an A800 as micro-batch 2 x accumulation 2: two rungs of the OOM ladder before the packing one.
QWEN_7B = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "dataset": {"name": "org/chats", "maxSeqLength": 2048},
    "gpu": {"type": "A800"},
    "training": {"globalBatchSize": 4},
}


def job(name: str, **spec: Any) -> dict[str, Any]:
    return sftjob(name, **{**QWEN_7B, **spec})


def pod_of(jobs: Jobs, name: str, attempt: int, timeout: float = 40) -> dict[str, Any]:
    """Attempt ``attempt``'s rank-0 pod, once it is bound to a node."""

    def bound() -> dict[str, Any] | None:
        pod = next((p for p in jobs.pods(name) if p["metadata"]["name"] == f"{name}-{attempt}-0"), None)
        return pod if pod and pod["spec"].get("nodeName") else None

    found: dict[str, Any] = wait_for(f"pod {name}-{attempt}-0 bound to a node", bound, timeout)
    return found


def fail(jobs: Jobs, name: str, attempt: int, code: int, message: str) -> dict[str, Any]:
    """Steer attempt ``attempt`` into exiting with ``code`` and return its pod as it was."""
    pod = pod_of(jobs, name, attempt)
    jobs.steer(pod["metadata"]["name"], outcome="fail", exit_code=str(code), message=message)
    return pod


def ended(jobs: Jobs, name: str, attempt: int, timeout: float = 40) -> dict[str, Any]:
    def record() -> dict[str, Any] | None:
        found = next((r for r in jobs.status(name).get("attempts") or [] if r["attempt"] == attempt), None)
        return found if found and found.get("endTime") else None

    result: dict[str, Any] = wait_for(f"attempt {attempt} of {name} to end", record, timeout)
    return result


def failed_with(jobs: Jobs, name: str, reason: str) -> dict[str, Any]:
    jobs.wait_phase(name, "Failed")
    cond = jobs.condition(name, "Failed")
    assert (cond["status"], cond["reason"]) == ("True", reason), cond
    return cond


def has_event(jobs: Jobs, name: str, type_: str, reason: str, text: str = "") -> bool:
    out = jobs.kubectl("get", "events", f"--field-selector=involvedObject.name={name}", "-o", "json").stdout
    return any(
        e["type"] == type_ and e["reason"] == reason and text in e.get("message", "")
        for e in json.loads(out)["items"]
    )


def trainer_config(jobs: Jobs, name: str) -> dict[str, Any]:
    config_map = json.loads(jobs.kubectl("get", "configmap", f"{name}-config", "-o", "json").stdout)
    loaded: dict[str, Any] = json.loads(config_map["data"][c.CONFIG_FILE])
    return loaded


def avoided_nodes(pod: dict[str, Any]) -> set[str]:
    """Nodes the pod prefers not to land on (used only when no other node fits)."""
    affinity = (pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}
    preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    return {
        value
        for term in preferred
        for field in term["preference"].get("matchFields") or []
        if field["key"] == "metadata.name" and field["operator"] == "NotIn"
        for value in field["values"]
    }


def waited(pod: dict[str, Any], record: dict[str, Any]) -> timedelta:
    """From the end of a failed attempt to the creation of the next attempt's pod."""
    return datetime.fromisoformat(pod["metadata"]["creationTimestamp"]) - datetime.fromisoformat(
        record["endTime"]
    )


# --- CUDA OOM: the ladder ------------------------------------------------------------------------------


def test_cuda_oom_twice_halves_the_micro_batch_then_turns_on_checkpointing_keeping_the_global_batch(
    jobs: Jobs,
) -> None:
    jobs.apply(job("ladder"))
    pod_of(jobs, "ladder", 1)
    first = trainer_config(jobs, "ladder")["training"]
    assert (first["micro_batch_size"], first["gradient_accumulation_steps"]) == (2, 2)

    fail(jobs, "ladder", 1, 15, OOM_MESSAGE)
    record = ended(jobs, "ladder", 1)
    assert (record["reason"], record["exitCode"], record["message"]) == ("CudaOOM", 15, OOM_MESSAGE)
    assert record["node"].startswith("a800")
    fail(jobs, "ladder", 2, 15, OOM_MESSAGE)
    pod_of(jobs, "ladder", 3)

    third = trainer_config(jobs, "ladder")["training"]
    assert (third["micro_batch_size"], third["gradient_accumulation_steps"], third["global_batch_size"]) == (
        1,
        4,
        4,
    )
    assert third["gradient_checkpointing"] is True
    status = jobs.status("ladder")
    assert "micro-batch 2 -> 1" in status["attempts"][1]["ladderStep"]
    assert "gradient checkpointing on" in status["attempts"][2]["ladderStep"]
    assert status["restarts"] == 2
    assert has_event(jobs, "ladder", "Warning", "CudaOOM", "attempt 1")
    assert has_event(jobs, "ladder", "Normal", "PodsCreated", "gradient checkpointing on")


def test_a_job_that_cannot_be_made_to_fit_ends_failed_with_the_ladder(jobs: Jobs) -> None:
    jobs.apply(job("nofit", training={"globalBatchSize": 4, "packing": False}))
    for attempt in (1, 2, 3):
        fail(jobs, "nofit", attempt, 15, OOM_MESSAGE)
    cond = failed_with(jobs, "nofit", "OOMLadderExhausted")
    for step in ("micro-batch 2 -> 1", "gradient checkpointing on", "exhausted"):
        assert step in cond["message"]
    assert [p["metadata"]["name"] for p in jobs.pods("nofit") if p["metadata"]["name"] == "nofit-4-0"] == []
    wait_for(
        "the OOMLadderExhausted event",
        lambda: has_event(jobs, "nofit", "Warning", "OOMLadderExhausted"),
        timeout=15,
    )


def test_on_oom_fail_fails_the_job_at_the_first_cuda_oom(jobs: Jobs) -> None:
    jobs.apply(job("oomfail", restartPolicy={"onOOM": "Fail"}))
    fail(jobs, "oomfail", 1, 15, OOM_MESSAGE)
    cond = failed_with(jobs, "oomfail", "CudaOOM")
    assert OOM_MESSAGE in cond["message"] and "onOOM is Fail" in cond["message"]


# --- host OOM, permanent and transient failures --------------------------------------------------------


def test_an_oomkilled_trainer_gets_one_and_a_half_times_the_memory_next_time(jobs: Jobs) -> None:
    jobs.apply(job("hostoom"))
    first = pod_of(jobs, "hostoom", 1)
    jobs.steer(first["metadata"]["name"], outcome="oomkill")
    record = ended(jobs, "hostoom", 1)
    assert (record["reason"], record["exitCode"]) == ("HostOOM", 137)
    second = pod_of(jobs, "hostoom", 2)

    def memory(pod: dict[str, Any]) -> float:
        return float(parse_quantity(pod["spec"]["containers"][0]["resources"]["requests"]["memory"]))

    assert memory(second) == 1.5 * memory(first)
    assert has_event(jobs, "hostoom", "Warning", "HostOOM", "attempt 1")


def test_an_oomkilled_pod_of_another_node_gets_more_memory_and_node_rank_zeros_pod_keeps_its_own(
    jobs: Jobs,
) -> None:
    # Sharded over two nodes: node rank 0's pod asks for the memory to load the model, the other's less.
    two_nodes = {"type": "A800", "count": 4, "nodes": 2}
    jobs.apply(
        job(
            "split",
            method="full",
            gpu=two_nodes,
            training={"globalBatchSize": 32},
            checkpoints={"size": "400Gi"},
        )
    )
    first = {p["metadata"]["labels"]["sftjob.io/node-rank"]: p for p in jobs.running_pods("split", count=2)}
    jobs.steer(first["1"]["metadata"]["name"], outcome="oomkill")
    record = ended(jobs, "split", 1)
    assert (record["reason"], record["nodeRank"]) == ("HostOOM", 1)
    second = {
        p["metadata"]["labels"]["sftjob.io/node-rank"]: p
        for p in jobs.running_pods("split", count=2, timeout=60)
    }
    assert {p["metadata"]["labels"]["sftjob.io/attempt"] for p in second.values()} == {"2"}
    assert _memory(second["0"]) == _memory(first["0"]) > _memory(first["1"])
    assert _memory(second["1"]) == 1.5 * _memory(first["1"])


def _memory(pod: dict[str, Any]) -> float:
    return float(parse_quantity(pod["spec"]["containers"][0]["resources"]["requests"]["memory"]))


def test_a_data_error_fails_the_job_at_once_with_the_trainers_message(jobs: Jobs) -> None:
    jobs.apply(job("baddata"))
    message = "DataError: 37% of rows are malformed (max 1%): row 12 has no 'messages' column"
    fail(jobs, "baddata", 1, 11, message)
    cond = failed_with(jobs, "baddata", "DataError")
    assert message in cond["message"] and "fix the dataset" in cond["message"]
    assert jobs.status("baddata")["attempts"][0]["exitCode"] == 11
    time.sleep(2)
    assert {p["metadata"]["name"] for p in jobs.pods("baddata")} <= {"baddata-1-0"}
    wait_for(
        "the DataError event", lambda: has_event(jobs, "baddata", "Warning", "DataError", message), timeout=15
    )


def test_unknown_failures_back_off_then_exhaust_max_restarts(jobs: Jobs) -> None:
    jobs.apply(job("flaky", restartPolicy={"maxRestarts": 1, "backoffSeconds": 4}))
    fail(jobs, "flaky", 1, 1, "boom")
    record = ended(jobs, "flaky", 1)
    assert (record["reason"], record["message"]) == ("Unknown", "boom")
    jobs.wait_phase("flaky", "Restarting")
    second = pod_of(jobs, "flaky", 2)
    assert waited(second, record) >= timedelta(seconds=4)
    assert has_event(jobs, "flaky", "Warning", "Restarting", "attempt 2 starts at")

    fail(jobs, "flaky", 2, 1, "boom again")
    cond = failed_with(jobs, "flaky", "RestartLimitExceeded")
    assert "2 failures exceed restartPolicy.maxRestarts 1" in cond["message"]


# --- interruptions: preemption and node loss -----------------------------------------------------------


def test_preemptions_restart_at_once_without_using_the_restart_budget(jobs: Jobs) -> None:
    # A backoff long enough that "at once" cannot be mistaken for a backoff that passed.
    backoff = 30
    jobs.apply(job("preempt", restartPolicy={"maxRestarts": 0, "backoffSeconds": backoff}))
    for attempt in (1, 2):
        fail(jobs, "preempt", attempt, 20, "SIGTERM: checkpoint-120 saved")
        record = ended(jobs, "preempt", attempt)
        assert (record["reason"], record["exitCode"]) == ("Preempted", 20)
        after = waited(pod_of(jobs, "preempt", attempt + 1), record)
        assert after < timedelta(seconds=5), f"attempt {attempt + 1} came {after} after the preemption"
    status = jobs.status("preempt")
    assert status["restarts"] == 2 and status["phase"] != "Failed"
    assert has_event(jobs, "preempt", "Warning", "Preempted", "attempt 2")


def test_a_lost_node_is_avoided_by_the_next_attempt(cluster: Cluster, jobs: Jobs) -> None:
    nodes = cluster.add_nodes({"l40s": 2})
    try:
        for name in nodes:
            cluster.kubectl("label", "node", name, f"{TEST_POOL_LABEL}={jobs.namespace}")
        jobs.apply(job("nodelost", gpu={"type": "L40S"}, nodeSelector={TEST_POOL_LABEL: jobs.namespace}))
        lost = pod_of(jobs, "nodelost", 1)["spec"]["nodeName"]
        cluster.kubectl("delete", "node", lost, "--wait=false")
        record = ended(jobs, "nodelost", 1)
        assert (record["reason"], record["node"]) == ("NodeLost", lost)
        second = pod_of(jobs, "nodelost", 2)
        assert second["spec"]["nodeName"] != lost
        assert lost in avoided_nodes(second)
        assert has_event(jobs, "nodelost", "Warning", "NodeLost", lost)
    finally:
        cluster.kubectl("delete", "node", *nodes, "--ignore-not-found", "--wait=false")


# --- node faults and communication ---------------------------------------------------------------------


def test_a_gpu_fault_moves_the_job_off_that_node(jobs: Jobs) -> None:
    jobs.apply(job("xid"))
    first = fail(jobs, "xid", 1, 13, "CUDA error: uncorrectable ECC error encountered")
    record = ended(jobs, "xid", 1)
    assert (record["reason"], record["node"]) == ("GpuUnavailable", first["spec"]["nodeName"])
    second = pod_of(jobs, "xid", 2, timeout=60)
    assert first["spec"]["nodeName"] in avoided_nodes(second)
    assert second["spec"]["nodeName"] != first["spec"]["nodeName"]


def test_a_communication_error_on_pcie_gpus_disables_nccl_p2p_next_time(jobs: Jobs) -> None:
    jobs.apply(job("nccl", gpu={"type": "L40S", "count": 2}))
    first = fail(jobs, "nccl", 1, 16, "NCCL WARN Watchdog caught collective operation timeout")
    assert ended(jobs, "nccl", 1)["reason"] == "CommunicationError"
    second = pod_of(jobs, "nccl", 2, timeout=60)

    def env(pod: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}

    assert env(second).get("NCCL_P2P_LEVEL") == "NVL"  # P2P over NVLink only: none on PCIe cards
    assert "NCCL_P2P_LEVEL" not in env(first)


def test_a_trainer_that_reports_no_progress_is_ended_as_stalled_and_restarted(jobs: Jobs) -> None:
    jobs.apply(job("hung", restartPolicy={"stallTimeoutSeconds": 60, "backoffSeconds": 1}))
    pod_of(jobs, "hung", 1)
    record = ended(jobs, "hung", 1, timeout=100)
    assert record["reason"] == "Stalled" and "no progress reported" in record["message"]
    pod_of(jobs, "hung", 2)


# --- the operator restarts -----------------------------------------------------------------------------


def test_an_operator_killed_mid_backoff_waits_out_the_same_backoff_and_creates_one_pod(
    jobs: Jobs, operator: Operator
) -> None:
    # A backoff long enough that the restarted operator (15+ s to start on a loaded machine) is back well
    # before it ends; the margin is shorter than the downtime, so a backoff started afresh shows.
    backoff, margin = timedelta(seconds=60), timedelta(seconds=8)
    jobs.apply(job("midbackoff", restartPolicy={"backoffSeconds": int(backoff.total_seconds())}))
    fail(jobs, "midbackoff", 1, 17, "OSError: [Errno 28] No space left on device")
    record = ended(jobs, "midbackoff", 1)
    assert record["reason"] == "StorageError"
    jobs.wait_phase("midbackoff", "Restarting")
    operator.kill()
    # Down longer than the margin: a backoff started afresh by the restarted operator ends past it.
    time.sleep(margin.total_seconds() + 2)
    operator.start()
    back = datetime.now(UTC) - datetime.fromisoformat(record["endTime"])
    if back > backoff - timedelta(seconds=3):
        pytest.fail(
            f"the operator was back (reconciling) only {back} after attempt 1 ended, too close to the end of"
            f" its {backoff} backoff: this run cannot tell the same backoff from none at all",
            pytrace=False,
        )
    second = pod_of(jobs, "midbackoff", 2, timeout=backoff.total_seconds() + 30)
    assert backoff <= waited(second, record) < backoff + margin, f"{waited(second, record)} after the end"
    time.sleep(3)
    live = [
        p["metadata"]["name"] for p in jobs.pods("midbackoff") if not p["metadata"].get("deletionTimestamp")
    ]
    assert live == ["midbackoff-2-0"]
    assert jobs.status("midbackoff")["restarts"] == 1
