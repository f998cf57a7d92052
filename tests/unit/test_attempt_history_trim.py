"""``status.attempts`` stays within the CRD's maxItems however often a job is suspended and resumed,
and the records it drops are ones no restart decision reads: budgets, ladders and avoided nodes are
the same on the trimmed history as on the whole of it."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import yaml

from sftjob.attempts import ATTEMPTS_KEPT_NEWEST, ATTEMPTS_MAX_ITEMS, AttemptRecord, trimmed
from sftjob.failures import FailureClass
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions
from tests.unit.reconcile_cases import CTX, NOW, SPEC, observed, pod, terminated, then
from tests.unit.restart_cases import T0, failed, node, policy_decision

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "sftjob.io_sftjobs.yaml"


def suspended(attempt: int) -> AttemptRecord:
    start = T0 + timedelta(minutes=attempt * 10)
    return AttemptRecord(
        attempt=attempt, start_time=start, end_time=start + timedelta(minutes=1), message="suspended"
    )


def test_the_trim_limit_is_the_crds_max_items_on_status_attempts() -> None:
    (version,) = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"]
    attempts = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["attempts"]
    assert attempts["maxItems"] == ATTEMPTS_MAX_ITEMS


def test_trimming_drops_old_suspended_records_and_keeps_the_first_every_failure_and_the_newest() -> None:
    failures = {
        7: FailureClass.CUDA_OOM,
        300: FailureClass.HOST_OOM,
        500: FailureClass.GPU_UNAVAILABLE,
        800: FailureClass.COMMUNICATION_ERROR,
        900: FailureClass.COMMUNICATION_ERROR,
        1000: FailureClass.PREEMPTED,
    }
    history = [failed(n, failures[n], node="bad") if n in failures else suspended(n) for n in range(1, 1301)]
    kept = trimmed(history)
    newest = [r.attempt for r in history[-ATTEMPTS_KEPT_NEWEST:]]
    assert [r.attempt for r in kept] == [1, *sorted(failures), *newest]
    assert trimmed(kept) == kept
    nodes = {"bad": node("bad", "512Gi")}
    assert policy_decision(kept, nodes=nodes) == policy_decision(history, nodes=nodes)


def test_with_the_largest_budgets_spent_every_failure_is_kept_within_max_items() -> None:
    # maxRestarts 100 and maxInterruptions 1000 spent, with suspends in between: only suspends may go.
    counted = [FailureClass.UNKNOWN] * 100 + [FailureClass.PREEMPTED] * 1000
    history = [failed(n, cls) for n, cls in enumerate(counted, start=1)]
    history += [suspended(n) for n in range(len(history) + 1, len(history) + 200)]
    kept = trimmed(history)
    assert len(kept) <= ATTEMPTS_MAX_ITEMS and kept[-2:] == history[-2:]
    assert {r.attempt for r in history if r.failed} <= {r.attempt for r in kept}


def test_a_trimmed_history_leaves_room_for_the_record_of_the_attempt_resumed_next() -> None:
    # maxRestarts 100 and maxInterruptions 1000 spent, then 200 suspends: the trim must leave one slot
    history = [
        failed(n, FailureClass.UNKNOWN if n <= 100 else FailureClass.PREEMPTED) for n in range(1, 1102)
    ]
    history += [suspended(n) for n in range(1102, 1302)]
    kept = trimmed(history)
    assert len(kept) == ATTEMPTS_MAX_ITEMS - 1 and kept[-2:] == history[-2:]
    assert len([*kept, AttemptRecord(attempt=1302, start_time=T0)]) == ATTEMPTS_MAX_ITEMS


def cycle(actions: Actions, n: int, after: timedelta, *, fail: bool) -> Actions:
    """Attempt ``n`` runs, then is suspended and resumed (or fails, and is restarted after the backoff)."""
    obs = observed(now=NOW + after)
    running = [pod(attempt=n)]
    if fail:
        failing = [pod(attempt=n, phase="Failed", status=terminated(1, "Error", "boom"))]
        ended = reconcile(then(obs, actions, pods=failing), CTX)
        return reconcile(then(obs, ended, pods=failing, now=obs.now + timedelta(hours=1)), CTX)
    paused = reconcile(replace(then(obs, actions, pods=running), spec={**SPEC, "suspend": True}), CTX)
    return reconcile(then(obs, paused, pods=[], now=obs.now + timedelta(minutes=1)), CTX)


def test_thirteen_hundred_suspend_resume_cycles_stay_within_max_items_and_keep_the_restart_budget() -> None:
    actions = reconcile(observed(), CTX)
    failing_at = {100, 600, 1100}  # three counted failures: maxRestarts 3 is then spent
    for n in range(1, 1301 + len(failing_at)):
        actions = cycle(actions, n, timedelta(hours=2 * n), fail=n in failing_at)
        written = actions.status.to_patch()["attempts"]
        assert isinstance(written, list) and len(written) <= ATTEMPTS_MAX_ITEMS
    status = actions.status
    assert (status.phase, status.attempt, status.restarts) == ("Pending", 1304, 3)
    assert [r.attempt for r in status.attempts[:4]] == [1, 100, 600, 1100]
    # the newest the last suspend kept, and the attempt resumed since
    assert len(status.attempts) == 1 + 3 + ATTEMPTS_KEPT_NEWEST + 1
    # the fourth failure of the job's own, 1,300 suspends later, still finds the budget spent
    last = cycle(actions, 1304, timedelta(hours=3000), fail=True)
    assert last.status.phase == "Failed"
    failed_condition = next(x for x in last.status.conditions if x.type == "Failed")
    assert failed_condition.reason == "RestartLimitExceeded"
    assert "4 failures exceed restartPolicy.maxRestarts 3" in failed_condition.message
