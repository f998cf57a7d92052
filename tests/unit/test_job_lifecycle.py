"""A pass's job-level steps seen through the conditions it writes: every condition holds at the pass's
generation, the ones the pass did not touch too, and only their status flipping moves their time."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, NOW, SPEC, observed, pod, started, terminated, then


def test_suspending_a_running_job_says_every_condition_at_the_new_generation() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()], now=NOW + timedelta(seconds=10)), CTX)
    suspended = replace(
        then(obs, running, pods=[pod()], now=NOW + timedelta(seconds=30)),
        spec={**SPEC, "suspend": True},
        generation=2,
    )
    actions = reconcile(suspended, CTX)
    assert actions.status.observed_generation == 2
    said = {c.type: c.observed_generation for c in actions.status.conditions}
    assert said == dict.fromkeys(
        ("Admitted", "Planned", "Suspended", "Scheduled", "Running", "Succeeded", "Failed"), 2
    )
    before = {c.type: c.last_transition_time for c in running.status.conditions}
    after = {c.type: c.last_transition_time for c in actions.status.conditions}
    assert after["Succeeded"] == before["Succeeded"] and after["Failed"] == before["Failed"]


def test_a_finished_job_whose_ttl_changed_says_its_conditions_at_the_new_generation() -> None:
    obs, first = started()
    done = pod(phase="Succeeded", status=terminated(0, "Completed"))
    finished = reconcile(then(obs, first, pods=[done], now=NOW + timedelta(seconds=10)), CTX)
    assert finished.status.phase == "Succeeded"
    again = reconcile(then(obs, finished, pods=[done], now=NOW + timedelta(seconds=20)), CTX)
    assert not again.status_changed  # a quiet finished job writes nothing
    edited = replace(
        then(obs, finished, pods=[done], now=NOW + timedelta(seconds=30)),
        spec={**SPEC, "ttlSecondsAfterFinished": 3600},
        generation=2,
    )
    actions = reconcile(edited, CTX)
    assert actions.status_changed and {c.observed_generation for c in actions.status.conditions} == {2}
    assert [c.last_transition_time for c in actions.status.conditions] == [
        c.last_transition_time for c in finished.status.conditions
    ]


def test_the_ttls_delete_is_said_only_by_the_event_posted_once_it_went_through() -> None:
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:00:00Z", "attempt": 1}
    actions = reconcile(observed(spec={**SPEC, "ttlSecondsAfterFinished": 60}, status=done), CTX)
    assert actions.delete_job and actions.events == []
    assert actions.job_deleted is not None and actions.job_deleted.reason == "Finished"
    assert actions.job_deleted.message == "deleted the job 60 s after it finished"
