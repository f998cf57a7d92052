"""Pods the reconcile expects but does not see: just created, behind in the index, refused, never
created, or gone."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions, Observed
from sftjob_operator.status import failed_create
from tests.unit.reconcile_cases import (
    CTX,
    NOW,
    condition,
    observed,
    pod,
    started,
    then,
)


def bound() -> tuple[Observed, Actions]:
    """An attempt whose pod a pass saw bound (and wrote so): it was created."""
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()], now=NOW + timedelta(seconds=10)), CTX)
    assert running.status.gpu.nodes == ["l40s-0"]
    return obs, running


def pod_names(actions: Actions) -> list[str]:
    return [m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"]


def test_a_missing_pod_is_recreated_soon_after_the_start_and_judged_vanished_once_the_api_says_404() -> None:
    obs, first = started()
    soon = reconcile(then(obs, first, now=NOW + timedelta(seconds=5)), CTX)
    assert pod_names(soon) == ["job-1-0"]
    obs, running = bound()
    later = reconcile(then(obs, running, now=NOW + timedelta(seconds=120), gone=frozenset({"job-1-0"})), CTX)
    assert later.status.attempts[0].reason == "Preempted"
    assert pod_names(later) == ["job-2-0"]


def test_a_pod_never_seen_bound_is_created_again_however_late_never_judged_deleted() -> None:
    obs, first = started()  # the operator wrote attempt 1, then stopped before creating its pod
    for late in (timedelta(seconds=90), timedelta(hours=2)):
        back = then(obs, first, now=NOW + late, gone=frozenset({"job-1-0"}))
        actions = reconcile(back, CTX)
        assert not actions.check_pods and not actions.status_changed
        assert actions.status.attempt == 1 and actions.status.attempts[0].reason is None
        assert pod_names(actions) == ["job-1-0"]


def test_pod_creates_failing_for_half_an_hour_end_no_attempt() -> None:
    obs, first = started()
    refused = failed_create(first.status, "Pod job-1-0: webhook down (HTTP 500)", generation=1, now=NOW)
    for minutes in range(1, 31):
        actions = reconcile(
            replace(obs, status=refused.to_patch(), now=NOW + timedelta(minutes=minutes)), CTX
        )
        assert actions.status.attempt == 1 and actions.status.attempts[0].end_time is None
        assert pod_names(actions) == ["job-1-0"]
    assert condition(actions, "Scheduled") == ("False", "FailedCreate")


def test_a_pod_the_index_lacks_past_its_grace_is_looked_up_not_judged_vanished() -> None:
    obs, running = bound()
    late = then(obs, running, now=NOW + timedelta(seconds=300))
    actions = reconcile(late, CTX)
    assert actions.check_pods == ["job-1-0"]
    assert not actions.status_changed and not actions.children and not actions.delete_pods
    assert not actions.events and actions.status.attempt == 1


def test_a_pod_whose_create_was_refused_is_created_again_never_judged_deleted() -> None:
    obs, first = started()
    refused = failed_create(first.status, "Pod job-1-0: exceeded quota", generation=1, now=NOW)
    late = replace(
        obs, status=refused.to_patch(), now=NOW + timedelta(seconds=300), gone=frozenset({"job-1-0"})
    )
    actions = reconcile(late, CTX)
    assert not actions.check_pods and actions.status.attempt == 1 and actions.status.restarts == 0
    assert actions.status.attempts[0].reason is None
    assert [m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"] == ["job-1-0"]
    assert condition(actions, "Scheduled") == ("False", "FailedCreate") and not actions.status_changed
    created = reconcile(then(late, actions, pods=[pod(phase="Pending", node=None)]), CTX)
    assert condition(created, "Scheduled") == ("False", "WaitingForPods")


def test_a_pod_found_by_the_direct_read_keeps_its_attempt_going() -> None:
    obs, first = started()
    late = then(obs, first, now=NOW + timedelta(seconds=300), pods=[pod(phase="Pending", node=None)])
    actions = reconcile(late, CTX)
    assert not actions.check_pods and actions.status.attempt == 1 and actions.status.restarts == 0
    assert actions.status.attempts[0].reason is None and not actions.children
    assert actions.status.phase == "Pending"


def test_a_pod_not_yet_in_the_index_right_after_the_start_is_waited_for_not_recreated() -> None:
    obs, first = started()
    actions = reconcile(then(obs, first, now=NOW + timedelta(seconds=1)), CTX)
    assert not actions.children and actions.requeue_after == 2


def test_the_pass_after_the_start_writes_no_status_until_the_pods_show_something_new() -> None:
    obs, first = started()
    waiting = reconcile(then(obs, first, now=NOW + timedelta(seconds=1)), CTX)
    created = reconcile(then(obs, first, pods=[pod(phase="Pending", node=None)]), CTX)
    assert not waiting.status_changed and not created.status_changed
    assert condition(first, "Scheduled") == ("False", "WaitingForPods")


# --- the operator's defaults ---------------------------------------------------------------------------


def test_after_a_crash_between_creating_pods_and_writing_status_the_same_pods_are_kept() -> None:
    actions = reconcile(observed(pods=[pod()]), CTX)
    assert actions.status.attempt == 1
    assert {m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"} <= {"job-1-0"}
    assert not actions.delete_pods
