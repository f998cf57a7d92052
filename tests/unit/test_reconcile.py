"""The reconcile's decisions, pass by pass, from hand-made observations: no cluster, no clock."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sftjob import constants as c
from sftjob.attempts import AttemptRecord
from sftjob.gpus import GpuProfile
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator.attempt_policy import GiveUp, NextAttempt
from sftjob_operator.planning import CandidatePlans, planner_plan
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions
from tests.unit.reconcile_cases import (
    CTX,
    NOW,
    SPEC,
    condition,
    fake_plan,
    observed,
    pod,
    started,
    terminated,
    then,
)


def test_a_new_job_records_attempt_one_before_creating_its_children_in_order() -> None:
    _, actions = started()
    assert actions.status.attempt == 1 and actions.status.phase == "Pending" and actions.status_changed
    assert [m["kind"] for m in actions.children] == [
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "NetworkPolicy", "PersistentVolumeClaim", "Pod",
    ]  # fmt: skip
    assert actions.children[-1]["metadata"]["name"] == "job-1-0"
    assert [e.reason for e in actions.events] == ["PodsCreated"]
    assert (
        condition(actions, "Admitted") == ("True", "ValidSpec") and condition(actions, "Planned")[0] == "True"
    )
    assert actions.status.plan is not None and actions.status.plan.gpu == "L40S"


def test_a_pass_over_unchanged_state_changes_nothing() -> None:
    obs, first = started()
    running = then(obs, first, pods=[pod()])
    second = reconcile(running, CTX)
    third = reconcile(then(running, second), CTX)
    assert not third.status_changed and not third.children and not third.delete_pods and not third.events


def test_running_pods_make_the_job_running_on_the_gpu_they_landed_on() -> None:
    obs, first = started()
    actions = reconcile(then(obs, first, pods=[pod(node="l40s-0")]), CTX)
    assert actions.status.phase == "Running" and condition(actions, "Running") == ("True", "Training")
    assert condition(actions, "Scheduled") == ("True", "PodsBound")
    gpu = actions.status.gpu
    assert (gpu.type, gpu.product, gpu.nodes, gpu.summary) == ("L40S", "NVIDIA-L40S", ["l40s-0"], "1xL40S")
    assert [e.reason for e in actions.events] == ["Running"]


def test_any_shows_the_plan_of_the_card_the_pod_landed_on() -> None:
    obs = observed(spec={**SPEC, "gpu": {"type": "Any"}})
    first = reconcile(obs, CTX)
    assert first.status.plan is not None and first.status.plan.gpu == "A800-SXM4-80GB"
    actions = reconcile(then(obs, first, pods=[pod(node="a40-0")]), CTX)
    assert actions.status.plan is not None and actions.status.plan.gpu == "A40"
    assert actions.status.attempts[-1].gpu == "A40"


def test_an_unschedulable_pod_keeps_the_job_pending_with_the_schedulers_reason() -> None:
    obs, first = started()
    why = "0/6 nodes are available: 2 Insufficient nvidia.com/gpu."
    stuck = pod(phase="Pending", node=None, status={"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]})  # fmt: skip
    actions = reconcile(then(obs, first, pods=[stuck]), CTX)
    assert actions.status.phase == "Pending"
    assert condition(actions, "Scheduled") == ("False", "Unschedulable")
    assert next(x for x in actions.status.conditions if x.type == "Scheduled").message == why
    assert [e.reason for e in actions.events] == ["Unschedulable"]


def test_a_succeeded_pod_makes_the_job_succeeded() -> None:
    obs, first = started()
    done = pod(phase="Succeeded", status=terminated(0, "Completed"))
    actions = reconcile(then(obs, first, pods=[done]), CTX)
    assert actions.status.phase == "Succeeded" and condition(actions, "Succeeded") == ("True", "Completed")
    assert actions.status.completion_time == NOW and actions.status.attempts[0].succeeded


def test_a_failed_pod_fails_the_job_with_its_class_exit_code_and_message() -> None:
    obs, first = started()
    failed = pod(phase="Failed", status=terminated(11, "Error", "bad rows"))
    actions = reconcile(then(obs, first, pods=[failed]), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "DataError")
    record = actions.status.attempts[0]
    assert (record.exit_code, record.reason, record.message, record.end_time) == (
        11,
        "DataError",
        "bad rows",
        NOW,
    )
    assert actions.events[-1].type == "Warning"


def restart_after(seconds: float) -> Any:
    def policy(spec: SFTJobSpec, history: Sequence[AttemptRecord], plans: CandidatePlans, *,
               nodes: Mapping[str, Any], now: datetime) -> NextAttempt | GiveUp:  # fmt: skip
        last = history[-1] if history else None
        if last is None or not last.failed:
            return NextAttempt(attempt=(last.attempt if last else 0) + 1, plans=plans)
        assert last.end_time is not None
        return NextAttempt(attempt=last.attempt + 1, plans=plans, avoid_nodes=("l40s-0",),
                           not_before=last.end_time + timedelta(seconds=seconds))  # fmt: skip

    return policy


def test_the_restart_seam_starts_the_next_attempt_with_its_settings() -> None:
    ctx = replace(CTX, attempt_policy=restart_after(0))
    obs = observed()
    first = reconcile(obs, ctx)
    failed = pod(phase="Failed", status=terminated(15, "Error", "CUDA out of memory"))
    actions = reconcile(then(obs, first, pods=[failed]), ctx)
    assert actions.status.attempt == 2 and actions.status.restarts == 1
    assert [r.attempt for r in actions.status.attempts] == [1, 2] and actions.status.attempts[
        0
    ].reason == "CudaOOM"
    new_pod = next(m for m in actions.children if m["kind"] == "Pod")
    assert new_pod["metadata"]["name"] == "job-2-0"
    avoid = new_pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert avoid[-1]["preference"]["matchFields"][0]["values"] == ["l40s-0"]
    assert actions.quick_delete_pods == ["job-1-0"] and not actions.delete_pods


def test_a_restart_waiting_for_its_backoff_shows_restarting_and_asks_to_be_requeued() -> None:
    ctx = replace(CTX, attempt_policy=restart_after(30))
    obs = observed()
    first = reconcile(obs, ctx)
    running = reconcile(then(obs, first, pods=[pod()]), ctx)
    assert condition(running, "Running") == ("True", "Training")
    failed = pod(phase="Failed", status=terminated(16, "Error", "NCCL timeout"))
    actions = reconcile(then(obs, running, pods=[failed]), ctx)
    assert actions.status.phase == "Restarting" and actions.requeue_after == 30
    assert not actions.children and actions.status.attempt == 1
    assert condition(actions, "Running") == ("False", "Restarting")
    assert condition(actions, "Scheduled") == ("False", "Restarting")


def test_suspending_deletes_the_pods_and_resuming_starts_a_new_attempt_without_counting_a_restart() -> None:
    obs, first = started()
    running = then(obs, first, pods=[pod()])
    suspended = reconcile(replace(running, spec={**SPEC, "suspend": True}, generation=2), CTX)
    assert suspended.status.phase == "Suspended" and suspended.delete_pods == ["job-1-0"]
    assert condition(suspended, "Suspended") == ("True", "SuspendedBySpec")
    resumed = reconcile(then(running, suspended, pods=[], generation=3), CTX)
    assert resumed.status.attempt == 2 and resumed.status.restarts == 0
    assert any(m["metadata"]["name"] == "job-2-0" for m in resumed.children)


def test_a_job_past_its_deadline_fails_and_its_pods_go() -> None:
    spec = {**SPEC, "activeDeadlineSeconds": 60}
    obs = observed(spec=spec)
    first = reconcile(obs, CTX)
    assert first.requeue_after is None or first.requeue_after <= 60
    late = reconcile(then(obs, first, pods=[pod()], now=NOW + timedelta(seconds=61)), CTX)
    assert late.status.phase == "Failed" and condition(late, "Failed") == ("True", "DeadlineExceeded")
    assert late.delete_pods == ["job-1-0"] and late.status.attempts[0].reason == "DeadlineExceeded"


def test_a_job_failed_for_its_deadline_says_a_larger_one_takes_a_new_job() -> None:
    spec = {**SPEC, "activeDeadlineSeconds": 60}
    obs = observed(spec=spec)
    first = reconcile(obs, CTX)
    late = reconcile(then(obs, first, pods=[pod()], now=NOW + timedelta(seconds=61)), CTX)
    message = next(c.message for c in late.status.conditions if c.type == "Failed")
    assert message.startswith("the job ran longer than activeDeadlineSeconds 60; ")
    assert "larger spec.activeDeadlineSeconds" in message and "delete the job and create it again" in message


def _seen_late(ended: dict[str, Any]) -> Actions:
    """The pass that first sees `ended`, the attempt's pod, comes 30 s after the 60 s deadline."""
    spec = {**SPEC, "activeDeadlineSeconds": 60}
    obs = observed(spec=spec)
    first = reconcile(obs, CTX)
    return reconcile(then(obs, first, pods=[ended], now=NOW + timedelta(seconds=90)), CTX)


def test_a_run_that_succeeded_before_a_late_pass_saw_it_succeeds_though_the_deadline_has_passed() -> None:
    late = _seen_late(pod(phase="Succeeded", status=terminated(0, "Completed")))
    assert late.status.phase == "Succeeded" and condition(late, "Succeeded") == ("True", "Completed")


def test_an_attempt_that_failed_before_a_late_pass_keeps_its_class_and_no_new_attempt_starts() -> None:
    late = _seen_late(pod(phase="Failed", status=terminated(1, "Error", "Segmentation fault")))
    assert late.status.attempts[0].reason == "Unknown" and not late.children
    assert late.status.phase == "Failed" and condition(late, "Failed") == ("True", "DeadlineExceeded")


def test_a_permanent_failure_before_a_late_pass_fails_the_job_for_itself_not_the_deadline() -> None:
    late = _seen_late(pod(phase="Failed", status=terminated(11, "Error", "row 7 has no messages")))
    assert late.status.phase == "Failed" and condition(late, "Failed")[1] != "DeadlineExceeded"
    assert late.status.attempts[0].reason == "DataError"


def test_an_attempt_that_ended_before_a_suspend_was_seen_is_recorded_as_it_ended() -> None:
    obs = observed()
    first = reconcile(obs, CTX)
    oom = pod(phase="Failed", status=terminated(15, "Error", "CUDA out of memory"))
    suspended = reconcile(then(obs, first, pods=[oom], spec={**SPEC, "suspend": True}), CTX)
    assert suspended.status.phase == "Suspended" and suspended.status.attempts[0].reason == "CudaOOM"
    done = pod(phase="Succeeded", status=terminated(0, "Completed"))
    finished = reconcile(then(obs, first, pods=[done], spec={**SPEC, "suspend": True}), CTX)
    assert finished.status.phase == "Succeeded"


def test_a_finished_job_waits_for_its_ttl_then_asks_to_be_deleted() -> None:
    spec = {**SPEC, "ttlSecondsAfterFinished": 100}
    obs = observed(spec=spec)
    first = reconcile(obs, CTX)
    done = reconcile(then(obs, first, pods=[pod(phase="Succeeded", status=terminated(0, "Completed"))]), CTX)
    waiting = reconcile(then(obs, done, now=NOW + timedelta(seconds=40)), CTX)
    assert not waiting.delete_job and waiting.requeue_after == 60
    expired = reconcile(then(obs, done, now=NOW + timedelta(seconds=100)), CTX)
    assert expired.delete_job


def test_a_plan_that_fits_nowhere_fails_the_job_with_the_planners_reason() -> None:
    ctx = replace(CTX, plan_fn=lambda spec, profile: fake_plan(spec, profile, fits=False))
    actions = reconcile(observed(), ctx)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "DoesNotFit")
    assert condition(actions, "Planned") == ("False", "DoesNotFit") and not actions.children
    assert "90" in next(x for x in actions.status.conditions if x.type == "Failed").message


def test_a_checkpoint_claim_too_small_for_the_run_fails_the_job_before_any_child_exists() -> None:
    model, gpu = {"name": "Qwen/Qwen2.5-7B-Instruct"}, {"type": "A800", "count": 8}
    spec = {**SPEC, "model": model, "method": "full", "gpu": gpu}
    actions = reconcile(observed(spec=spec), replace(CTX, plan_fn=planner_plan))
    assert condition(actions, "Planned") == ("False", "CheckpointVolumeTooSmall") and not actions.children
    message = next(x for x in actions.status.conditions if x.type == "Failed").message
    assert "the default checkpoint claim (100Gi, the operator's default" in message  # the user set no size


def test_a_job_already_running_is_not_failed_for_its_claim_by_a_newer_operator() -> None:
    model, gpu = {"name": "Qwen/Qwen2.5-7B-Instruct"}, {"type": "A800", "count": 8}
    obs = observed(spec={**SPEC, "model": model, "method": "full", "gpu": gpu})
    started = reconcile(obs, CTX)  # admitted by an operator without the claim check
    later = reconcile(then(obs, started), replace(CTX, plan_fn=planner_plan))
    assert later.status.phase != "Failed" and later.status.attempt == 1


def test_a_spec_the_model_rejects_fails_as_invalid_naming_the_field() -> None:
    actions = reconcile(observed(spec={**SPEC, "gpu": {"type": "L40S", "count": 99}}), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Admitted") == ("False", "InvalidSpec")
    assert "spec.gpu.count" in next(x for x in actions.status.conditions if x.type == "Failed").message


def test_progress_and_checkpoint_annotations_are_folded_into_status() -> None:
    obs, first = started()
    progress = {"step": 50, "totalSteps": 200, "epoch": 0.25, "loss": 1.5, "updated": "2026-01-01T11:59:30Z"}
    checkpoint = {"step": 40, "path": "/checkpoints/checkpoint-40", "time": "2026-01-01T11:59:00Z"}
    notes = {c.ANNOTATION_PROGRESS: json.dumps(progress), c.ANNOTATION_CHECKPOINT: json.dumps(checkpoint)}
    actions = reconcile(then(obs, first, pods=[pod(annotations=notes)]), CTX)
    assert actions.status.progress is not None and actions.status.progress.summary == "50/200"
    assert actions.status.last_checkpoint is not None and actions.status.last_checkpoint.step == 40


def test_a_garbled_progress_annotation_is_ignored() -> None:
    obs, first = started()
    actions = reconcile(then(obs, first, pods=[pod(annotations={c.ANNOTATION_PROGRESS: "{not json"})]), CTX)
    assert actions.status.progress is None and actions.status.phase == "Running"


def test_a_multi_node_attempt_fails_together_when_one_pod_fails() -> None:
    spec = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
    obs = observed(spec=spec)
    first = reconcile(obs, CTX)
    assert {m["kind"] for m in first.children} >= {"Service"}
    pods = [
        pod(rank=0, node="a800-0"),
        pod(rank=1, phase="Failed", node="a800-0", status=terminated(1, "Error", "x")),
    ]
    actions = reconcile(then(obs, first, pods=pods), CTX)
    assert actions.status.phase == "Restarting" and actions.quick_delete_pods == ["job-1-0"]
    ended = actions.status.attempts[-1]
    assert (ended.node, ended.node_rank) == ("a800-0", 1)  # the pod that ended it: its memory is raised alone
    assert ended.model_dump(by_alias=True)["nodeRank"] == 1


def test_an_attempt_records_the_ladder_step_of_the_card_it_landed_on() -> None:
    def laddered_on_a40(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
        plan = fake_plan(spec, profile)
        return plan.model_copy(update={"ladder": ["micro-batch 4 -> 2"]}) if profile.key == "A40" else plan

    ctx = replace(CTX, plan_fn=laddered_on_a40)
    obs = observed(spec={**SPEC, "gpu": {"type": "Any"}})
    first = reconcile(obs, ctx)
    assert first.status.attempts[-1].ladder_step is None  # planned for the A800 first
    actions = reconcile(then(obs, first, pods=[pod(node="a40-0")]), ctx)
    assert actions.status.attempts[-1].ladder_step == "micro-batch 4 -> 2"


def test_a_finished_job_deletes_pods_of_older_attempts_an_operator_crash_left_behind() -> None:
    obs, first = started()
    done = reconcile(then(obs, first, pods=[pod(phase="Succeeded", status=terminated(0, "Completed"))]), CTX)
    assert done.status.phase == "Succeeded"
    status = done.status.model_copy(update={"attempt": 2}).to_patch()
    old = pod(attempt=1, phase="Failed", status=terminated(1, "Error"))
    last = pod(attempt=2, phase="Succeeded", status=terminated(0, "Completed"))
    actions = reconcile(replace(obs, status=status, pods=[old, last]), CTX)
    assert actions.delete_pods == ["job-1-0"]


def test_pods_of_the_operators_image_need_a_new_enough_driver_and_a_jobs_own_image_does_not() -> None:
    ctx = replace(CTX, image_min_driver_major=580)

    def driver_terms(spec: dict[str, Any]) -> list[Any]:
        pod = next(m for m in reconcile(observed(spec=spec), ctx).children if m["kind"] == "Pod")
        (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        return [e for e in term["matchExpressions"] if e["key"] == c.GFD_DRIVER_MAJOR]

    assert driver_terms(SPEC) == [{"key": c.GFD_DRIVER_MAJOR, "operator": "Gt", "values": ["579"]}]
    assert driver_terms({**SPEC, "image": "registry.example.com/my-trainer:cuda12"}) == []


def test_a_node_selector_on_a_product_the_gpu_type_lacks_fails_the_job_as_an_invalid_spec() -> None:
    spec = {**SPEC, "gpu": {"type": "A40"}, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L40S"}}
    actions = reconcile(observed(spec=spec), CTX)
    failed = next(x for x in actions.status.conditions if x.type == "Failed")
    assert failed.reason == "InvalidSpec" and "NVIDIA-L40S is none of the products of A40" in failed.message
    assert not actions.children


def test_a_node_selector_narrowing_the_gpu_type_to_one_of_its_products_is_kept() -> None:
    selector = {"nvidia.com/gpu.product": "NVIDIA-A800-SXM4-80GB"}
    actions = reconcile(observed(spec={**SPEC, "gpu": {"type": "A800"}, "nodeSelector": selector}), CTX)
    assert actions.children and actions.status.phase != "Failed"


def test_an_attempt_first_seen_failed_is_recorded_on_the_card_it_ran_on() -> None:
    ctx = replace(CTX, attempt_policy=restart_after(30))
    obs = observed(spec={**SPEC, "gpu": {"type": "Any"}})
    first = reconcile(obs, ctx)
    assert first.status.attempts[0].gpu == "A800-SXM4-80GB"  # planned for the most preferred card
    oom = pod(phase="Failed", node="a40-0", status=terminated(15, "Error", "CUDA out of memory"))
    ended = reconcile(then(obs, first, pods=[oom], now=NOW + timedelta(minutes=5)), ctx).status.attempts[0]
    assert (ended.gpu, ended.reason, ended.node) == ("A40", "CudaOOM", "a40-0")
    assert ended.plan.startswith("A40")


def test_lost_steps_count_only_the_failed_attempts_own_progress() -> None:
    ctx = replace(CTX, attempt_policy=restart_after(0))
    obs, first = started()
    progress = {"step": 1000, "totalSteps": 5000, "updated": "2026-01-01T12:29:50Z"}
    saved = {"step": 900, "path": "/checkpoints/checkpoint-900"}
    notes = {c.ANNOTATION_PROGRESS: json.dumps(progress), c.ANNOTATION_CHECKPOINT: json.dumps(saved)}
    failed = pod(phase="Failed", annotations=notes, status=terminated(1, "Error", "boom"))
    first_ended = reconcile(then(obs, first, pods=[failed], now=NOW + timedelta(minutes=30)), ctx)
    assert first_ended.status.attempts[0].lost_steps == 100 and first_ended.status.attempt == 2
    silent = pod(attempt=2, phase="Failed", status=terminated(13, "Error", "no CUDA-capable device"))
    later = then(obs, first_ended, pods=[failed, silent], now=NOW + timedelta(minutes=31))
    second = reconcile(later, ctx).status.attempts[1]
    assert (second.resumed_from_step, second.reason, second.lost_steps) == (900, "GpuUnavailable", None)


def test_a_suspended_or_failed_job_is_no_longer_scheduled() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    assert condition(running, "Scheduled") == ("True", "PodsBound")
    suspended = reconcile(then(obs, running, pods=[pod()], spec={**SPEC, "suspend": True}), CTX)
    assert condition(suspended, "Scheduled") == ("False", "SuspendedBySpec")
    failed = pod(phase="Failed", status=terminated(11, "Error", "dataset is empty"))
    assert condition(reconcile(then(obs, running, pods=[failed]), CTX), "Scheduled") == ("False", "DataError")
