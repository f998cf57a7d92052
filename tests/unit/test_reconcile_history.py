"""The reconcile over a damaged or moving history: lenient status, attempt numbers that never go back,
a backoff that writes nothing while it waits, a vanished rank judged by its own node, and the
checkpoint a suspended trainer saves on its way out."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from sftjob import constants as c
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions
from tests.unit.reconcile_cases import (
    CTX,
    NODES,
    NOW,
    SPEC,
    observed,
    pod,
    preempted_status,
    started,
    terminated,
    then,
)


def pod_names(actions: Actions) -> list[str]:
    return [m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"]


def running_as_attempt_3(*records: dict[str, Any]) -> dict[str, Any]:
    """The status of a job running its third attempt, with ``records`` as its history."""
    obs, first = started()
    status = reconcile(then(obs, first, pods=[pod()]), CTX).status.to_patch()
    return {**status, "attempt": 3, "restarts": 2, "attempts": list(records)}


def record(attempt: int, **fields: Any) -> dict[str, Any]:
    return {"attempt": attempt, "startTime": "2026-01-01T11:00:00Z", "gpu": "L40S", **fields}


ENDED = {"endTime": "2026-01-01T11:30:00Z", "reason": "Unknown"}


def test_a_record_with_a_failure_class_unknown_here_keeps_the_running_attempt_and_its_budget() -> None:
    status = running_as_attempt_3(
        record(1, **{**ENDED, "reason": "SomeNewClass"}), record(2, **ENDED), record(3)
    )
    actions = reconcile(observed(status=status, pods=[pod(attempt=3)], now=NOW + timedelta(seconds=10)), CTX)
    assert (actions.status.phase, actions.status.attempt, actions.status.restarts) == ("Running", 3, 2)
    assert [(r.attempt, r.reason) for r in actions.status.attempts] == [
        (1, "Unknown"),
        (2, "Unknown"),
        (3, None),
    ]
    assert pod_names(actions) == [] and actions.delete_pods == []
    [warning] = [e for e in actions.events if e.reason == "StatusRepaired"]
    assert warning.type == "Warning" and "status.attempts[0].reason 'SomeNewClass'" in warning.message
    assert actions.status_changed  # the repair is written once, so the warning is said once
    again = reconcile(observed(status=actions.status.to_patch(), pods=[pod(attempt=3)], now=NOW), CTX)
    assert not again.events


def test_a_running_attempt_whose_record_was_lost_is_taken_over_never_doubled_by_a_lower_one() -> None:
    status = running_as_attempt_3(record(1, **ENDED), record(2, **ENDED), {"attempt": "three"})
    actions = reconcile(observed(status=status, pods=[pod(attempt=3)], now=NOW + timedelta(seconds=10)), CTX)
    assert actions.status.attempt == 3 and [r.attempt for r in actions.status.attempts] == [1, 2, 3]
    assert actions.status.restarts == 2  # attempt 3's restart was counted when it started
    assert set(pod_names(actions)) <= {"job-3-0"} and actions.delete_pods == []


def test_a_new_attempt_is_numbered_past_every_attempt_the_status_or_the_pods_show() -> None:
    # attempt 3's record is gone and its pod failed; the history left ends at attempt 1
    status = running_as_attempt_3(record(1, **ENDED))
    failed = pod(attempt=3, phase="Failed", status=terminated(1, "Error", "boom"))
    taken_over = reconcile(observed(status=status, pods=[failed]), CTX)
    assert [r.attempt for r in taken_over.status.attempts] == [1, 3] and not taken_over.delete_pods
    soon = NOW + timedelta(seconds=10)
    judged = reconcile(observed(status=taken_over.status.to_patch(), pods=[failed], now=soon), CTX)
    assert [(r.attempt, r.reason) for r in judged.status.attempts] == [(1, "Unknown"), (3, "Unknown")]
    later = NOW + timedelta(hours=1)
    restarted = reconcile(observed(status=judged.status.to_patch(), pods=[failed], now=later), CTX)
    assert restarted.status.attempt == 4 and pod_names(restarted) == ["job-4-0"]
    assert restarted.quick_delete_pods == ["job-3-0"]


def test_a_missing_pod_is_recreated_under_its_attempts_name_even_when_earlier_records_were_lost() -> None:
    status = running_as_attempt_3(record(3, startTime="2026-01-01T12:00:00Z"))
    actions = reconcile(observed(status=status, now=NOW + timedelta(seconds=5)), CTX)
    assert pod_names(actions) == ["job-3-0"]


def test_the_backoff_condition_names_the_start_time_so_waiting_passes_write_nothing() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    failed = [pod(phase="Failed", status=terminated(1, "Error", "boom"))]
    waiting = reconcile(then(obs, running, pods=failed), CTX)
    assert waiting.status.phase == "Restarting" and waiting.requeue_after == 10
    message = next(x.message for x in waiting.status.conditions if x.type == "Running")
    assert message.startswith("attempt 2 starts at 2026-01-01T12:00:10Z")
    for seconds in (1, 2, 3):
        again = reconcile(then(obs, waiting, pods=failed, now=NOW + timedelta(seconds=seconds)), CTX)
        assert not again.status_changed and again.requeue_after == 10 - seconds


def test_a_vanished_rank_is_judged_by_its_own_node_and_that_node_is_avoided() -> None:
    spec = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
    base: dict[str, Any] = NODES["a800-0"]
    second = {**base, "metadata": {**base["metadata"], "name": "a800-1"}}
    obs = replace(observed(spec=spec), nodes={**NODES, "a800-1": second})
    first = reconcile(obs, CTX)
    both = [pod(rank=0, node="a800-0"), pod(rank=1, node="a800-1")]
    running = reconcile(then(obs, first, pods=both, now=NOW + timedelta(seconds=30)), CTX)
    assert running.status.gpu.nodes == ["a800-0", "a800-1"]
    # node a800-1 is deleted and its pod garbage-collected; rank 0 runs on
    lost = then(obs, running, pods=both[:1], now=NOW + timedelta(seconds=600), gone=frozenset({"job-1-1"}))
    ended_now = reconcile(replace(lost, nodes=NODES), CTX)
    ended = ended_now.status.attempts[0]
    assert (ended.reason, ended.node) == ("NodeLost", "a800-1")
    assert ended_now.quick_delete_pods == ["job-1-0"] and not ended_now.children  # rank 0 stops first
    actions = reconcile(replace(then(lost, ended_now, pods=[]), nodes=NODES), CTX)
    affinity = next(m for m in actions.children if m["kind"] == "Pod")["spec"]["affinity"]["nodeAffinity"]
    avoid = affinity["preferredDuringSchedulingIgnoredDuringExecution"][-1]["preference"]["matchFields"]
    assert avoid[0]["values"] == ["a800-1"]


def checkpoint(step: int) -> dict[str, str]:
    return {c.ANNOTATION_CHECKPOINT: json.dumps({"step": step, "path": f"/checkpoints/checkpoint-{step}"})}


def test_the_checkpoint_a_suspended_trainer_saves_on_its_way_out_reaches_the_status_and_the_resume() -> None:
    started_obs, first = started()
    obs = replace(started_obs, spec={**SPEC, "suspend": True}, generation=2)
    running = reconcile(then(started_obs, first, pods=[pod(annotations=checkpoint(40))]), CTX)
    suspended = reconcile(then(obs, running, pods=[pod(annotations=checkpoint(40))]), CTX)
    assert suspended.status.attempts[0].end_time == NOW
    saved = pod(phase="Failed", annotations=checkpoint(57), status=preempted_status("preempted"))
    later = NOW + timedelta(seconds=30)
    after = reconcile(then(obs, suspended, pods=[saved], now=later), CTX)
    assert after.status.last_checkpoint is not None and after.status.last_checkpoint.step == 57
    assert after.status.attempts[0].end_time == NOW and after.status.phase == "Suspended"


def test_a_resume_waits_for_the_suspended_pod_to_save_and_starts_from_its_newest_checkpoint() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod(annotations=checkpoint(40))]), CTX)
    suspended = reconcile(replace(then(obs, running), spec={**SPEC, "suspend": True}, generation=2), CTX)
    saving = pod(annotations=checkpoint(57))
    saving["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:30Z"
    waiting = reconcile(replace(then(obs, suspended, pods=[saving]), generation=3), CTX)
    assert waiting.status.attempt == 1 and not waiting.children and waiting.requeue_after == 5
    assert waiting.status.last_checkpoint is not None and waiting.status.last_checkpoint.step == 57
    message = next(x.message for x in waiting.status.conditions if x.type == "Running")
    assert message == "waiting for attempt 1's pods to stop" and waiting.status.phase == "Pending"
    saved = pod(phase="Failed", annotations=checkpoint(57), status=preempted_status("preempted"))
    resumed = reconcile(then(obs, waiting, pods=[saved], generation=3), CTX)
    assert resumed.status.attempt == 2 and resumed.status.attempts[-1].resumed_from_step == 57
    assert resumed.status.restarts == 0
