"""The reconcile's decisions, pass by pass, from hand-made observations: no cluster, no clock."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sftjob import constants as c
from sftjob.attempts import AttemptRecord
from sftjob.config import DistributedSettings, TrainingSettings
from sftjob.gpus import GpuProfile
from sftjob.plan import MemoryEstimate, Plan, PodResources
from sftjob.spec import SFTJobSpec
from sftjob_operator.attempt_policy import GiveUp, NextAttempt
from sftjob_operator.defaults import JobDefaults
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.reconcile import Actions, Context, Observed, reconcile
from sftjob_operator.scheduling import default_products
from sftjob_operator.status import failed_create

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
PRODUCTS = {"a800-0": "NVIDIA-A800-SXM4-80GB", "l40s-0": "NVIDIA-L40S", "a40-0": "NVIDIA-A40"}
NODES = {
    name: {
        "metadata": {"name": name, "labels": {c.GFD_PRODUCT: product}},
        "status": {"allocatable": {"memory": "512Gi"}, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    for name, product in PRODUCTS.items()
}


def fake_plan(spec: SFTJobSpec, profile: GpuProfile, fits: bool = True) -> Plan:
    world = spec.gpu.count * spec.gpu.nodes
    return Plan(
        gpu=profile.key,
        fits=fits,
        training=TrainingSettings(
            global_batch_size=4 * world, micro_batch_size=4, gradient_accumulation_steps=1
        ),
        distributed=DistributedSettings(nnodes=spec.gpu.nodes, nproc_per_node=spec.gpu.count),
        resources=PodResources(cpu="8", memory="64Gi", shm_size="16Gi"),
        memory=MemoryEstimate(terms=[], total_gib=90.0 if not fits else 30.0, budget_gib=40.0),
        predicted_tokens_per_second=1000.0,
        predicted_mfu=0.4,
        reasons=["does not fit: needs ~90 GiB"] if not fits else [],
    )


CTX = Context(products=default_products(), image="trainer:test", plan_fn=fake_plan)
SPEC = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "dataset": {"name": "org/chats"},
    "gpu": {"type": "L40S"},
}


def pod(
    attempt: int = 1, rank: int = 0, phase: str = "Running", node: str | None = "l40s-0", **extra: Any
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if phase == "Running":
        status["containerStatuses"] = [
            {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T11:59:00Z"}}}
        ]
    status.update(extra.pop("status", {}))
    return {
        "metadata": {
            "name": f"job-{attempt}-{rank}",
            "labels": {c.LABEL_JOB: "job", c.LABEL_ATTEMPT: str(attempt), c.LABEL_RANK: str(rank)},
            "annotations": extra.pop("annotations", {}),
        },
        "spec": {"nodeName": node},
        "status": status,
    }


def terminated(code: int, reason: str, message: str = "") -> dict[str, Any]:
    state = {"terminated": {"exitCode": code, "reason": reason, "message": message}}
    return {"containerStatuses": [{"name": "trainer", "state": state}]}


def observed(
    spec: Mapping[str, Any] = SPEC,
    status: Mapping[str, Any] | None = None,
    pods: Sequence[dict[str, Any]] = (),
    now: datetime = NOW,
    generation: int = 1,
) -> Observed:
    return Observed(
        name="job", namespace="team", uid="uid-1", generation=generation, spec=spec, status=status or {},
        pods=list(pods), nodes=NODES, now=now,
    )  # fmt: skip


def then(obs: Observed, actions: Actions, **changes: Any) -> Observed:
    """The next observation: the status the pass wrote, plus ``changes``."""
    return replace(obs, status=actions.status.to_patch(), **changes)


def condition(actions: Actions, type: str) -> tuple[str, str]:
    found = next(x for x in actions.status.conditions if x.type == type)
    return found.status, found.reason


def started() -> tuple[Observed, Actions]:
    obs = observed()
    return obs, reconcile(obs, CTX)


def test_a_new_job_records_attempt_one_before_creating_its_children_in_order() -> None:
    _, actions = started()
    assert actions.status.attempt == 1 and actions.status.phase == "Pending" and actions.status_changed
    assert [m["kind"] for m in actions.children] == [
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "PersistentVolumeClaim", "Pod",
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


def test_after_a_crash_between_creating_pods_and_writing_status_the_same_pods_are_kept() -> None:
    actions = reconcile(observed(pods=[pod()]), CTX)
    assert actions.status.attempt == 1
    assert {m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"} <= {"job-1-0"}
    assert not actions.delete_pods


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
    term = new_pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["l40s-0"]
    assert actions.delete_pods == ["job-1-0"]


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


def test_a_spec_the_model_rejects_fails_as_invalid_naming_the_field() -> None:
    actions = reconcile(observed(spec={**SPEC, "gpu": {"type": "L40S", "count": 99}}), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Admitted") == ("False", "InvalidSpec")
    assert "spec.gpu.count" in next(x for x in actions.status.conditions if x.type == "Failed").message


def test_a_missing_pod_is_recreated_soon_after_the_start_and_judged_vanished_once_the_api_says_404() -> None:
    obs, first = started()
    soon = reconcile(then(obs, first, now=NOW + timedelta(seconds=5)), CTX)
    assert [m["metadata"]["name"] for m in soon.children if m["kind"] == "Pod"] == ["job-1-0"]
    later = reconcile(then(obs, first, now=NOW + timedelta(seconds=120), gone=frozenset({"job-1-0"})), CTX)
    assert later.status.attempts[0].reason == "Preempted"
    assert [m["metadata"]["name"] for m in later.children if m["kind"] == "Pod"] == ["job-2-0"]


def test_a_pod_the_index_lacks_past_its_grace_is_looked_up_not_judged_vanished() -> None:
    obs, first = started()
    late = then(obs, first, now=NOW + timedelta(seconds=300))
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
    assert actions.status.phase == "Restarting" and actions.delete_pods == ["job-1-0"]


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

SITE = JobDefaults.of(
    storage_class_name="fast", size="7Gi", max_restarts=0, backoff_seconds=30, on_oom="Fail"
)


def test_unset_claim_and_restart_settings_take_the_operators_defaults_and_show_in_status() -> None:
    actions = reconcile(observed(), replace(CTX, defaults=SITE))
    (claim,) = [m for m in actions.children if m["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "7Gi"
    shown = actions.status.to_patch()["effective"]
    assert shown == {
        "checkpoints": {"storageClassName": "fast", "size": "7Gi"},
        "restartPolicy": {"maxRestarts": 0, "backoffSeconds": 30, "onOOM": "Fail"},
    }


def test_settings_the_spec_gives_win_over_the_operators_defaults() -> None:
    spec = {**SPEC, "checkpoints": {"size": "1Ti"}, "restartPolicy": {"maxRestarts": 5, "onOOM": "Retry"}}
    actions = reconcile(observed(spec=spec), replace(CTX, defaults=SITE))
    effective = actions.status.effective
    assert effective is not None
    assert (effective.checkpoints.size, effective.checkpoints.storage_class_name) == ("1Ti", "fast")
    policy = effective.restart_policy
    assert (policy.max_restarts, policy.backoff_seconds, policy.on_oom) == (5, 30, "Retry")


def test_a_default_backoff_above_the_jobs_own_cap_is_capped_there() -> None:
    spec = {**SPEC, "restartPolicy": {"maxBackoffSeconds": 5}}
    effective = reconcile(observed(spec=spec), replace(CTX, defaults=SITE)).status.effective
    assert effective is not None and effective.restart_policy.backoff_seconds == 5


def test_new_operator_defaults_do_not_change_a_job_admitted_under_the_old_ones() -> None:
    obs, first = started()  # the built-in defaults: 100Gi, maxRestarts 3
    failed = pod(phase="Failed", status=terminated(1, "Error", "boom"))
    actions = reconcile(then(obs, first, pods=[failed]), replace(CTX, defaults=SITE))
    assert actions.status.effective == first.status.effective
    assert actions.status.phase == "Restarting", "maxRestarts 3 still applies, not the new default 0"


def test_the_operators_default_restart_budget_decides_the_restart() -> None:
    obs = observed()
    first = reconcile(obs, replace(CTX, defaults=SITE))
    failed = pod(phase="Failed", status=terminated(1, "Error", "boom"))
    actions = reconcile(then(obs, first, pods=[failed]), replace(CTX, defaults=SITE))
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == (
        "True",
        "RestartLimitExceeded",
    )


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
