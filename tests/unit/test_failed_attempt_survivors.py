"""What is left of a failed multi-node attempt: its other pods cannot complete their collective SIGTERM save
without the rank that died, vanished or hung, so they go with a short grace (a preempted, suspended or
timed-out attempt's ranks are all alive and keep theirs); and the rank that died is blamed, not the healthy
ranks that saw NCCL errors because it did."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from sftjob.failures import FailureClass
from sftjob_operator import handlers
from sftjob_operator.attempt_end import classify_attempt
from sftjob_operator.classify import Classification, Outcome
from sftjob_operator.expectations import Expectations
from sftjob_operator.observe import JobView
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import SURVIVOR_GRACE_SECONDS, Actions, Observed
from tests.unit.reconcile_cases import (
    CTX,
    NODES,
    NOW,
    SPEC,
    UID,
    observed,
    pod,
    preempted_status,
    terminated,
    then,
)
from tests.unit.test_handlers import FakeKube

TWO_NODES = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
A800: dict[str, Any] = NODES["a800-0"]
NODES_TWO_A800 = {**NODES, "a800-1": {**A800, "metadata": {**A800["metadata"], "name": "a800-1"}}}


def two_nodes(spec: dict[str, Any] = TWO_NODES) -> tuple[Observed, Actions]:
    obs = replace(observed(spec=spec), nodes=NODES_TWO_A800)
    return obs, reconcile(obs, CTX)


def rank_one_ended(code: int, message: str) -> dict[str, Any]:
    return pod(rank=1, phase="Failed", node="a800-1", status=terminated(code, "Error", message))


@pytest.mark.parametrize(
    ("code", "message", "cause"),
    [
        (15, "CUDA out of memory", "CudaOOM"),
        (1, "Segmentation fault", "Unknown"),
        (16, "NCCL error: unhandled system error", "CommunicationError"),
    ],
)
def test_the_running_rank_of_an_attempt_whose_other_rank_died_is_deleted_with_a_short_grace(
    code: int, message: str, cause: str
) -> None:
    obs, first = two_nodes()
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), rank_one_ended(code, message)]), CTX)
    assert ended.status.attempts[0].reason == cause
    assert ended.quick_delete_pods == ["job-1-0"] and ended.delete_pods == []


def ended_seconds_ago(p: dict[str, Any], seconds: float) -> dict[str, Any]:
    (container,) = p["status"]["containerStatuses"]
    ended = (NOW - timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")
    container["state"]["terminated"]["finishedAt"] = ended
    return p


def test_a_peers_nccl_error_waits_for_the_rank_still_stopping_and_takes_its_own_cause() -> None:
    obs, first = two_nodes()
    broken = ended_seconds_ago(rank_one_ended(1, "[exit 16] NCCL error: remote process exited"), 5)
    waiting = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), broken]), CTX)
    assert not waiting.status.attempts[0].ended and not waiting.delete_pods and not waiting.quick_delete_pods
    assert waiting.requeue_after is not None and waiting.requeue_after <= 25
    oom = pod(
        rank=0, phase="Failed", node="a800-0", status=terminated(1, "Error", "[exit 15] CUDA out of memory")
    )
    ended = reconcile(then(obs, waiting, pods=[oom, broken], now=NOW + timedelta(seconds=3)), CTX)
    assert ended.status.attempts[0].reason == "CudaOOM"


def with_grace(p: dict[str, Any], seconds: int) -> dict[str, Any]:
    """``p`` with the grace the operator gave it: its torchrun's --shutdown-timeout is 10 s less."""
    p["spec"]["terminationGracePeriodSeconds"] = seconds
    return p


def test_a_peers_nccl_error_waits_for_the_other_rank_as_long_as_its_torchrun_may_take_to_stop() -> None:
    # The rank that ran out of memory is node 0's; its torchrun SIGTERMs its other ranks, which sit in an NCCL
    # wait on the dead peer, and SIGKILLs them only at --shutdown-timeout (grace 400 s: 390 s).
    obs, first = two_nodes()
    for seconds, settling in ((31, 369), (395, 5)):
        broken = ended_seconds_ago(rank_one_ended(1, "[exit 16] NCCL error: remote process exited"), seconds)
        stopping = with_grace(pod(rank=0, node="a800-0"), 400)
        waiting = reconcile(then(obs, first, pods=[stopping, broken]), CTX)
        assert not waiting.status.attempts[0].ended and not waiting.quick_delete_pods
        assert waiting.requeue_after == settling


def test_a_peers_nccl_error_ends_the_attempt_once_the_other_rank_has_had_its_grace() -> None:
    obs, first = two_nodes()
    broken = ended_seconds_ago(rank_one_ended(1, "[exit 16] NCCL error: remote process exited"), 401)
    ended = reconcile(then(obs, first, pods=[with_grace(pod(rank=0, node="a800-0"), 400), broken]), CTX)
    assert ended.status.attempts[0].reason == "CommunicationError"
    assert ended.quick_delete_pods == ["job-1-0"]


def test_a_peers_nccl_error_does_not_wait_for_a_rank_still_pending() -> None:
    obs, first = two_nodes()
    broken = ended_seconds_ago(rank_one_ended(1, "[exit 16] NCCL error: remote process exited"), 5)
    pending = with_grace(pod(rank=0, phase="Pending", node="a800-0"), 400)
    ended = reconcile(then(obs, first, pods=[pending, broken]), CTX)
    assert ended.status.attempts[0].reason == "CommunicationError"


def test_a_ranks_own_failure_ends_the_attempt_at_once() -> None:
    obs, first = two_nodes()
    oom = ended_seconds_ago(rank_one_ended(1, "[exit 15] CUDA out of memory"), 1)
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), oom]), CTX)
    assert ended.status.attempts[0].reason == "CudaOOM"


def test_a_preempted_attempts_other_rank_keeps_its_grace_to_save_with_the_others() -> None:
    obs, first = two_nodes()
    preempted = pod(rank=1, phase="Failed", node="a800-1", status=preempted_status("preempted (SIGTERM)"))
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), preempted]), CTX)
    assert ended.status.attempts[0].reason == "Preempted"
    assert ended.delete_pods == ["job-1-0"] and ended.quick_delete_pods == []


def test_a_stalled_attempts_pods_go_with_a_short_grace() -> None:
    obs, first = two_nodes()
    ranks = [pod(rank=0, node="a800-0"), pod(rank=1, node="a800-1")]  # running since 11:59, no report
    stalled = reconcile(then(obs, first, pods=ranks, now=NOW + timedelta(hours=1)), CTX)
    assert stalled.status.attempts[0].reason == "Stalled"
    assert stalled.quick_delete_pods == ["job-1-0", "job-1-1"] and stalled.delete_pods == []


def test_suspending_and_the_deadline_delete_the_pods_with_their_own_grace() -> None:
    obs, first = two_nodes()
    ranks = [pod(rank=0, node="a800-0"), pod(rank=1, node="a800-1")]
    suspended = reconcile(then(obs, first, pods=ranks, spec={**TWO_NODES, "suspend": True}), CTX)
    assert suspended.delete_pods == ["job-1-0", "job-1-1"] and suspended.quick_delete_pods == []
    timed = {**TWO_NODES, "activeDeadlineSeconds": 60}
    obs, first = two_nodes(timed)
    late = reconcile(then(obs, first, pods=ranks, now=NOW + timedelta(minutes=5)), CTX)
    assert late.status.attempts[0].reason == "DeadlineExceeded"
    assert late.delete_pods == ["job-1-0", "job-1-1"] and late.quick_delete_pods == []


class Deletes(FakeKube):
    """The API as the handlers use it, keeping the grace of every pod deletion."""

    def __init__(self) -> None:
        super().__init__()
        self.graces: dict[str, int | None] = {}

    def delete_pod(
        self, namespace: str, name: str, uid: str, grace_period_seconds: int | None = None
    ) -> bool:
        self.graces[name] = grace_period_seconds
        return True


def test_a_short_grace_delete_reaches_the_api_with_the_survivor_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = Deletes()
    monkeypatch.setattr(handlers.Runtime, "kube", api, raising=False)
    monkeypatch.setattr(handlers.Runtime, "context", CTX, raising=False)
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations())
    monkeypatch.setattr(handlers.Runtime, "outdated", {})
    monkeypatch.setattr(handlers, "_now", lambda: NOW)
    nodes = {name: [node] for name, node in NODES_TWO_A800.items()}

    def run(pods: list[dict[str, Any]]) -> None:
        meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1, "resourceVersion": "1"}
        job = JobView.of({"metadata": meta, "spec": TWO_NODES, "status": api.status})
        handlers.Runtime.outdated.clear()
        asyncio.run(handlers._pass(job, {("team", "job"): pods}, nodes))  # type: ignore[arg-type]

    run([])
    run([pod(rank=0, node="a800-0"), rank_one_ended(15, "CUDA out of memory")])
    assert api.graces == {"job-1-0": SURVIVOR_GRACE_SECONDS}


def failed_on(node: str, cls: FailureClass, message: str) -> Classification:
    return Classification(Outcome.FAILED, cls, 1, message, node)


def test_a_rank_that_crashed_is_blamed_rather_than_the_healthy_node_whose_ranks_saw_nccl_errors() -> None:
    echo = failed_on("node-a", FailureClass.COMMUNICATION_ERROR, "NCCL error: remote process exited")
    crash = failed_on("node-b", FailureClass.UNKNOWN, "rank 9 killed by SIGSEGV")
    for pods in ([echo, crash], [crash, echo]):
        assert classify_attempt(pods) == crash
    stalled = failed_on("node-b", FailureClass.STALLED, "no progress reported for 1900 s")
    assert classify_attempt([echo, stalled]) == stalled
    assert classify_attempt([echo, failed_on("node-b", FailureClass.COMMUNICATION_ERROR, "x")]) == echo
