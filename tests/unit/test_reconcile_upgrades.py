"""A job admitted and planned by one operator, reconciled by a newer one whose rules or planner say no:
a finished job is never judged again, and a started one keeps its running attempt; one whose spec is now
invalid is held: its attempt is judged to its end with the fields it runs with as written, the
deadline applies, suspending it ends it, no new attempt starts, and a pod it never had (it cannot create
one) fails it."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from sftjob.gpus import GpuProfile
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator import restarts
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions, Context, Observed
from tests.unit.reconcile_cases import (
    CTX,
    NOW,
    SPEC,
    condition,
    fake_plan,
    observed,
    pod,
    preempted_status,
    started,
    terminated,
    then,
)

# A spec this operator rejects (a reserved env name), standing in for a rule a newer operator added.
REJECTED = {**SPEC, "env": [{"name": "HOME", "value": "/x"}]}
# A newer planner's higher estimate: the job fits on no card any more.
NO_LONGER_FITS = replace(CTX, plan_fn=lambda spec, profile: fake_plan(spec, profile, fits=False))


def running() -> tuple[Observed, Actions]:
    """A job whose first attempt's pod runs, and the pass that saw it so."""
    obs, first = started()
    seen = then(obs, first, pods=[pod()], now=NOW + timedelta(minutes=1))
    return seen, reconcile(seen, CTX)


def message(actions: Actions, type: str) -> str:
    return next(x.message for x in actions.status.conditions if x.type == type)


def test_a_finished_job_is_not_failed_by_a_newer_operators_stricter_rule_and_still_expires() -> None:
    obs = observed(spec={**SPEC, "ttlSecondsAfterFinished": 100})
    first = reconcile(obs, CTX)
    done = reconcile(then(obs, first, pods=[pod(phase="Succeeded", status=terminated(0, "Completed"))]), CTX)
    upgraded = then(
        obs, done, spec={**REJECTED, "ttlSecondsAfterFinished": 100}, now=NOW + timedelta(seconds=40)
    )
    waiting = reconcile(upgraded, NO_LONGER_FITS)
    assert waiting.status.phase == "Succeeded" and condition(waiting, "Admitted") == ("True", "ValidSpec")
    assert not waiting.events and not waiting.status_changed and waiting.requeue_after == 60
    assert reconcile(replace(upgraded, now=NOW + timedelta(seconds=100)), NO_LONGER_FITS).delete_job


def test_a_finished_job_whose_ttl_is_unreadable_is_kept() -> None:
    obs = observed()
    first = reconcile(obs, CTX)
    done = reconcile(then(obs, first, pods=[pod(phase="Succeeded", status=terminated(0, "Completed"))]), CTX)
    for ttl in ("100", -1, True, None):
        later = then(obs, done, spec={**SPEC, "ttlSecondsAfterFinished": ttl}, now=NOW + timedelta(days=1))
        actions = reconcile(later, CTX)
        assert not actions.delete_job and actions.requeue_after is None


def test_a_running_job_whose_spec_a_newer_operator_rejects_keeps_its_attempt_and_is_warned_once() -> None:
    obs, seen = running()
    upgraded = then(obs, seen, spec=REJECTED, now=NOW + timedelta(minutes=2))
    actions = reconcile(upgraded, CTX)
    assert actions.status.phase == "Running" and not actions.delete_pods and not actions.children
    assert condition(actions, "Admitted") == ("False", "InvalidSpec")
    assert "spec.env" in message(actions, "Admitted") and "no new attempt can start" in message(
        actions, "Admitted"
    )
    assert [(e.type, e.reason) for e in actions.events] == [("Warning", "InvalidSpec")]
    again = reconcile(then(upgraded, actions), CTX)
    assert not again.events and not again.status_changed
    # The CRD lets only suspend, activeDeadlineSeconds and ttlSecondsAfterFinished change: still held.
    ttl = reconcile(then(upgraded, again, spec={**REJECTED, "ttlSecondsAfterFinished": 60}), CTX)
    assert condition(ttl, "Admitted") == ("False", "InvalidSpec") and ttl.status.phase == "Running"
    assert not ttl.events and not ttl.delete_pods and not ttl.children


def held(spec: dict[str, Any] = REJECTED, **changes: Any) -> Observed:
    """A running job whose spec this operator rejects, observed two minutes later with ``changes``."""
    obs, seen = running()
    upgraded = then(obs, seen, spec=spec, now=NOW + timedelta(minutes=2))
    return then(upgraded, reconcile(upgraded, CTX), **changes)


def test_a_job_held_for_its_invalid_spec_succeeds_when_its_attempt_completes_and_then_expires() -> None:
    later = held(
        {**REJECTED, "ttlSecondsAfterFinished": 60},
        pods=[pod(phase="Succeeded", status=terminated(0, "Completed"))],
        now=NOW + timedelta(hours=5),
    )
    done = reconcile(later, CTX)
    assert done.status.phase == "Succeeded" and done.status.attempts[-1].succeeded
    assert condition(done, "Succeeded") == ("True", "Completed") and not done.children
    assert reconcile(then(later, done, now=NOW + timedelta(hours=5, seconds=30)), CTX).requeue_after == 30
    assert reconcile(then(later, done, now=NOW + timedelta(hours=5, seconds=60)), CTX).delete_job


def test_a_job_held_for_its_invalid_spec_fails_for_it_when_its_attempt_fails_instead_of_restarting() -> None:
    failed = pod(phase="Failed", status=preempted_status("preempted"))  # else restarted at once
    actions = reconcile(held(pods=[failed], now=NOW + timedelta(hours=1)), CTX)
    assert actions.status.phase == "Failed" and not actions.children and actions.status.attempt == 1
    assert condition(actions, "Failed") == ("True", "InvalidSpec")
    assert condition(actions, "Admitted") == ("False", "InvalidSpec")
    said = message(actions, "Failed")
    assert said.startswith("attempt 1 on l40s-0 failed with Preempted")
    assert "no new attempt can start" in said and "spec.env" in said
    assert actions.status.attempts[-1].reason == "Preempted" and actions.status.restarts == 0


def test_a_job_held_for_its_invalid_spec_is_suspended_and_fails_when_resumed() -> None:
    later = held({**REJECTED, "suspend": True})
    suspended = reconcile(later, CTX)
    assert suspended.status.phase == "Suspended" and suspended.delete_pods == ["job-1-0"]
    assert condition(suspended, "Suspended") == ("True", "SuspendedBySpec")
    assert "suspending it ends it (it fails when resumed)" in message(suspended, "Admitted")
    resumed = reconcile(then(later, suspended, spec=REJECTED, pods=[]), CTX)
    assert resumed.status.phase == "Failed" and not resumed.children
    assert condition(resumed, "Failed") == ("True", "InvalidSpec")
    assert message(resumed, "Failed").startswith("no new attempt can start: ")


def test_a_job_held_for_its_invalid_spec_fails_past_its_active_deadline() -> None:
    late = held({**REJECTED, "activeDeadlineSeconds": 60}, now=NOW + timedelta(hours=1))
    actions = reconcile(late, CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "DeadlineExceeded")
    assert actions.delete_pods == ["job-1-0"]


def test_a_started_job_whose_gpu_request_a_newer_operator_rejects_is_held_on_the_gpus_it_runs_on() -> None:
    obs, seen = running()
    dropped = {**REJECTED, "gpu": {"type": "H100", "count": 9}}  # a type and a count it no longer takes
    actions = reconcile(then(obs, seen, spec=dropped, now=NOW + timedelta(minutes=2)), CTX)
    assert actions.status.phase == "Running" and not actions.delete_pods and not actions.check_pods
    assert condition(actions, "Admitted") == ("False", "InvalidSpec") and "spec.gpu" in message(
        actions, "Admitted"
    )
    assert actions.status.gpu.summary == "9xL40S" and actions.status.gpu.nodes == ["l40s-0"]


def test_a_held_job_keeps_the_stall_timeout_as_written_though_a_newer_operator_rejects_it() -> None:
    obs, seen = running()
    short = {**REJECTED, "restartPolicy": {"stallTimeoutSeconds": 30}}  # now: at least 60
    # The pod's trainer started at 11:59 and reported nothing: three minutes, past the 30 s it runs with.
    actions = reconcile(then(obs, seen, spec=short, now=NOW + timedelta(minutes=2)), CTX)
    assert actions.status.phase == "Failed" and actions.status.attempts[-1].reason == "Stalled"
    assert "stall timeout 30 s" in message(actions, "Failed") and "no new attempt can start" in message(
        actions, "Failed"
    )


def test_a_started_job_whose_running_fields_cannot_even_be_read_fails_as_its_attempt_cannot_be_observed() -> (
    None
):
    obs, seen = running()
    bad = {**REJECTED, "gpu": {"type": "L40S", "nodes": "two"}}
    actions = reconcile(then(obs, seen, spec=bad, now=NOW + timedelta(minutes=2)), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "InvalidSpec")
    assert "running attempt cannot be observed" in message(actions, "Failed")
    assert actions.delete_pods == ["job-1-0"]


def test_a_held_job_waits_out_the_pod_appearance_grace_for_a_pod_it_has_not_seen() -> None:
    obs, first = started()
    early = reconcile(then(obs, first, spec=REJECTED, now=NOW + timedelta(seconds=30)), CTX)
    assert early.status.phase == "Pending" and not early.check_pods and not early.children
    assert early.requeue_after is not None and early.requeue_after <= 60


def test_a_held_job_whose_pod_was_never_created_fails_naming_the_rank_once_the_api_server_confirms_it() -> (
    None
):
    obs, first = started()  # attempt 1 recorded; its pod never came (a refused create, a restart between)
    upgraded = then(obs, first, spec=REJECTED, now=NOW + timedelta(minutes=2))
    asked = reconcile(upgraded, CTX)  # the index may be behind: ask the API server before failing
    assert asked.check_pods == ["job-1-0"] and not asked.status_changed and not asked.children
    actions = reconcile(replace(upgraded, gone=frozenset({"job-1-0"})), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "InvalidSpec")
    said = message(actions, "Failed")
    assert said.startswith("attempt 1 has no pod for rank(s) 0; no new attempt can start: ")
    assert "spec.env" in said and not actions.children and actions.status.attempts[-1].ended


def test_a_held_two_node_job_whose_peer_pod_never_came_fails_and_frees_the_rank_that_waits_for_it() -> None:
    two = {**SPEC, "gpu": {"type": "L40S", "nodes": 2}}
    obs = observed(spec=two)
    first = reconcile(obs, CTX)
    upgraded = then(obs, first, pods=[pod(rank=0)], spec={**REJECTED, **two}, now=NOW + timedelta(hours=1))
    assert reconcile(upgraded, CTX).check_pods == ["job-1-1"]
    actions = reconcile(replace(upgraded, gone=frozenset({"job-1-1"})), CTX)
    assert actions.status.phase == "Failed" and actions.delete_pods == ["job-1-0"]
    assert message(actions, "Failed").startswith("attempt 1 has no pod for rank(s) 1; ")


def test_a_running_job_a_newer_planner_says_no_longer_fits_keeps_its_attempt_and_is_warned_once() -> None:
    obs, seen = running()
    later = then(obs, seen, now=NOW + timedelta(minutes=2))
    actions = reconcile(later, NO_LONGER_FITS)
    assert actions.status.phase == "Running" and not actions.delete_pods
    assert condition(actions, "Planned") == ("False", "DoesNotFit")
    assert "no new attempt starts until the job can be planned" in message(actions, "Planned")
    assert [(e.type, e.reason) for e in actions.events] == [("Warning", "DoesNotFit")]
    assert actions.status.plan == seen.status.plan and actions.status.attempts == seen.status.attempts
    again = reconcile(then(later, actions), NO_LONGER_FITS)
    assert not again.events and not again.status_changed


def test_an_attempt_that_completes_while_the_job_cannot_be_planned_succeeds() -> None:
    obs, seen = running()
    done = pod(phase="Succeeded", status=terminated(0, "Completed"))
    actions = reconcile(then(obs, seen, pods=[done], now=NOW + timedelta(minutes=5)), NO_LONGER_FITS)
    assert actions.status.phase == "Succeeded" and actions.status.attempts[-1].succeeded


def test_a_failed_attempt_of_a_job_that_cannot_be_planned_waits_for_a_plan_instead_of_failing() -> None:
    obs, seen = running()
    failed = pod(phase="Failed", status=preempted_status("preempted"))  # restarts at once
    later = then(obs, seen, pods=[failed], now=NOW + timedelta(minutes=5))
    waiting = reconcile(later, NO_LONGER_FITS)
    assert waiting.status.phase == "Restarting" and not waiting.children and waiting.status.attempt == 1
    assert condition(waiting, "Running") == ("False", "Restarting")
    assert message(waiting, "Running").startswith("no new attempt starts until the job can be planned: ")
    replanned = reconcile(then(later, waiting), CTX)  # the planner (or the products) say yes again
    assert replanned.status.attempt == 2 and condition(replanned, "Planned") == ("True", "PlanFits")
    assert any(m["metadata"]["name"] == "job-2-0" for m in replanned.children)


def test_a_job_not_started_yet_still_fails_for_a_spec_or_plan_this_operator_rejects() -> None:
    rejected = reconcile(observed(spec=REJECTED), CTX)
    assert rejected.status.phase == "Failed" and condition(rejected, "Admitted") == ("False", "InvalidSpec")
    unplanned = reconcile(observed(), NO_LONGER_FITS)
    assert unplanned.status.phase == "Failed" and condition(unplanned, "Planned") == ("False", "DoesNotFit")


def test_a_started_job_with_a_planner_that_cannot_size_its_model_keeps_its_attempt() -> None:
    def unsized(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
        raise ValueError("cannot size meta-llama/Llama-3.1-8B-Instruct")

    obs, seen = running()
    ctx: Context = replace(CTX, plan_fn=unsized)
    actions = reconcile(then(obs, seen, now=NOW + timedelta(minutes=2)), ctx)
    assert actions.status.phase == "Running" and condition(actions, "Planned") == (
        "False",
        "UnknownModelSize",
    )
    assert not actions.delete_pods and [e.reason for e in actions.events] == ["UnknownModelSize"]


def test_a_permanent_failure_ends_a_job_a_newer_planner_cannot_plan_instead_of_waiting_forever() -> None:
    obs, seen = running()
    bad = pod(phase="Failed", status=terminated(11, "Error", "dataset has no rows"))
    actions = reconcile(then(obs, seen, pods=[bad], now=NOW + timedelta(minutes=5)), NO_LONGER_FITS)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "DataError")


def test_a_running_attempt_is_kept_when_a_newer_planners_oom_ladder_has_no_rung_for_it() -> None:
    def policy(replan: Any) -> Any:
        def decide(spec: SFTJobSpec, history: Any, plans: Any, *, nodes: Any, now: Any) -> Any:
            return restarts.decide(spec.restart_policy, history, plans, replan=replan, nodes=nodes)

        return decide

    older = replace(
        CTX, attempt_policy=policy(lambda p: p.model_copy(update={"ladder": [*p.ladder, "rung"]}))
    )
    newer = replace(CTX, attempt_policy=policy(lambda p: p))  # no rung left for this card
    obs, first = started()
    oom = pod(phase="Failed", status=terminated(15, "Error", "CUDA out of memory"))
    restarted = reconcile(then(obs, first, pods=[oom], now=NOW + timedelta(minutes=1)), older)
    second = then(obs, restarted, pods=[oom, pod(attempt=2)], now=NOW + timedelta(minutes=3))
    seen = reconcile(second, older)
    actions = reconcile(then(second, seen, now=NOW + timedelta(minutes=4)), newer)
    assert actions.status.phase == "Running" and "job-2-0" not in actions.delete_pods
    assert condition(actions, "Planned") == ("False", "OOMLadderExhausted")
    assert "running attempt is kept" in message(actions, "Planned")
