"""A GPU or driver fault is the node's until it has happened on two nodes: then it follows the job (an
image built for a newer CUDA than the drivers have, a PyTorch without CUDA) and each further one counts
against maxRestarts, so such a job fails in minutes with a message that says why, not after
maxInterruptions attempts that blame every node of the cluster."""

from __future__ import annotations

from datetime import timedelta

from sftjob.attempts import AttemptRecord, RestartPolicy, follows_the_job, not_the_jobs_fault
from sftjob.failures import FailureClass
from sftjob_operator.attempt_policy import GiveUp
from sftjob_operator.restarts import GiveUpReason
from tests.unit.restart_cases import T0, failed, give_up, policy_decision, restart

MISMATCH = "NVIDIA driver 535.54.03 supports CUDA up to 12.2, PyTorch was built for CUDA 13.0"


def mismatch(attempt: int, node: str) -> AttemptRecord:
    record = failed(attempt, FailureClass.DRIVER_MISMATCH, node=node)
    return record.model_copy(update={"exit_code": 14, "message": MISMATCH})


def test_a_driver_mismatch_on_every_node_fails_the_job_in_minutes_as_the_jobs_own_fault() -> None:
    history: list[AttemptRecord] = []
    waited = 0.0
    for attempt in range(1, 40):
        history.append(mismatch(attempt, f"gpu-{attempt}"))
        decision = policy_decision(history)
        if isinstance(decision, GiveUp):
            break
        if decision.not_before is not None:
            waited += (decision.not_before - (history[-1].end_time or T0)).total_seconds()
    # two nodes blamed, then maxRestarts 3 counted, the fourth counted failure ends it
    result = give_up(decision)
    assert (len(history), result.reason) == (6, GiveUpReason.RESTART_LIMIT_EXCEEDED)
    assert waited < timedelta(minutes=10).total_seconds()
    assert "DriverMismatch on 6 nodes (gpu-1, gpu-2, gpu-3, gpu-4, gpu-5 and 1 more) follows the job" in (
        result.message
    )
    assert "4 failures exceed restartPolicy.maxRestarts 3" in result.message
    assert result.message.endswith("use a spec.image built for a CUDA the nodes' drivers support")


def test_the_attempt_after_a_gpu_fault_that_followed_the_job_says_it_was_counted() -> None:
    history = [mismatch(1, "a"), mismatch(2, "b"), mismatch(3, "c")]
    decision = restart(policy_decision(history))
    assert "DriverMismatch on 3 nodes (a, b, c) follows the job" in decision.message
    assert "counted against restartPolicy.maxRestarts" in decision.message
    assert not_the_jobs_fault(history) == [True, True, False]
    assert follows_the_job(history) == (FailureClass.DRIVER_MISMATCH, ["a", "b", "c"])


def test_gpu_faults_on_two_nodes_stay_the_nodes_and_spend_no_restart() -> None:
    history = [mismatch(1, "a"), mismatch(2, "b")]
    decision = restart(policy_decision(history, RestartPolicy(max_restarts=0)))
    assert decision.avoid_nodes == ("a", "b") and "follows the job" not in decision.message
    assert follows_the_job(history) is None


def test_one_broken_node_failing_the_job_again_and_again_stays_that_nodes_fault() -> None:
    # a small pool: the avoided node is the only one free, and its driver is still broken
    history = [mismatch(n, "old-driver") for n in range(1, 6)]
    assert restart(policy_decision(history, RestartPolicy(max_restarts=0))).attempt == 6


def test_each_gpu_fault_class_is_judged_by_the_nodes_it_happened_on() -> None:
    history = [
        failed(1, FailureClass.GPU_UNAVAILABLE, node="xid"),
        mismatch(2, "old-driver"),
        failed(3, FailureClass.GPU_UNAVAILABLE, node="ecc"),
        failed(4, FailureClass.NODE_LOST, node="gone"),
        failed(5, FailureClass.NODE_LOST, node="gone-too"),
        failed(6, FailureClass.NODE_LOST, node="gone-again"),
    ]
    assert not_the_jobs_fault(history) == [True] * 6  # node losses never follow a job
    assert restart(policy_decision(history, RestartPolicy(max_restarts=0))).attempt == 7
    fourth = failed(7, FailureClass.GPU_UNAVAILABLE, node="third")
    result = give_up(policy_decision([*history, fourth], RestartPolicy(max_restarts=0)))
    assert "GpuUnavailable on 3 nodes (ecc, third, xid) follows the job" in result.message
    assert result.message.endswith("use a spec.image with PyTorch built for CUDA and no NVIDIA driver files")
