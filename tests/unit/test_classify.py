"""Every failure class from realistic pod and node objects, as the API server returns them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sftjob.attempts import AttemptRecord
from sftjob.failures import ExitCode, FailureClass
from sftjob_operator.attempt_end import ROOT_CAUSE_ORDER, classify_attempt, describe_failure, end_record
from sftjob_operator.classify import Classification, Outcome, classify_pod
from tests.unit.classify_cases import NODE, NOW, classify, exited, node, pod, running, waiting


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        (ExitCode.CONFIG_ERROR, FailureClass.CONFIG_ERROR),
        (ExitCode.DATA_ERROR, FailureClass.DATA_ERROR),
        (ExitCode.MODEL_LOAD_ERROR, FailureClass.MODEL_LOAD_ERROR),
        (ExitCode.GPU_UNAVAILABLE, FailureClass.GPU_UNAVAILABLE),
        (ExitCode.DRIVER_MISMATCH, FailureClass.DRIVER_MISMATCH),
        (ExitCode.CUDA_OOM, FailureClass.CUDA_OOM),
        (ExitCode.COMMUNICATION_ERROR, FailureClass.COMMUNICATION_ERROR),
        (ExitCode.STORAGE_ERROR, FailureClass.STORAGE_ERROR),
        (ExitCode.NETWORK_ERROR, FailureClass.NETWORK_ERROR),
    ],
)
def test_documented_trainer_exit_codes_map_to_their_class(exit_code: int, expected: FailureClass) -> None:
    result = classify(pod("Failed", state=exited(exit_code, message="line one\nthe reason")))
    assert result.outcome is Outcome.FAILED
    assert result.failure_class is expected
    assert result.exit_code == exit_code
    assert result.message == "the reason"
    assert result.node == NODE


def test_a_completed_pod_succeeds() -> None:
    result = classify(pod("Succeeded", state=exited(0, "Completed")))
    assert result == Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    assert result.over


def test_a_running_pod_with_recent_progress_is_not_over() -> None:
    result = classify(
        pod(state=running(3000)), last_progress=NOW - timedelta(seconds=20), stall_timeout_seconds=600
    )
    assert result.outcome is Outcome.RUNNING
    assert not result.over


def test_oomkilled_container_is_host_oom() -> None:
    result = classify(pod("Failed", state=exited(137, "OOMKilled")))
    assert (result.failure_class, result.exit_code) == (FailureClass.HOST_OOM, 137)


def test_an_unknown_exit_code_is_unknown_and_names_the_code() -> None:
    result = classify(pod("Failed", state=exited(3)))
    assert result.failure_class is FailureClass.UNKNOWN
    assert "3" in result.message


def test_sigterm_with_a_scheduler_preemption_is_preempted() -> None:
    result = classify(pod("Failed", state=exited(143), disruption="PreemptionByScheduler"))
    assert result.failure_class is FailureClass.PREEMPTED
    assert "PreemptionByScheduler" in result.message and "SIGTERM" in result.message


def test_sigkill_after_a_drain_is_preempted_not_host_oom() -> None:
    result = classify(pod("Failed", state=exited(137), disruption="EvictionByEvictionAPI"))
    assert result.failure_class is FailureClass.PREEMPTED


def test_the_trainers_own_exit_code_wins_over_a_disruption() -> None:
    result = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM), disruption="PreemptionByScheduler"))
    assert result.failure_class is FailureClass.CUDA_OOM


def test_the_trainers_sigterm_code_is_a_preemption_when_the_pod_was_asked_to_stop() -> None:
    said = "preempted (SIGTERM): checkpoint saved at step 40"
    for stopped in (
        pod("Failed", state=exited(1, message=f"[exit 20] {said}"), disruption="PreemptionByScheduler"),
        pod("Failed", state=exited(1, message=f"[exit 20] {said}"), deleting=True),
        pod("Failed", state=exited(ExitCode.PREEMPTED, message=said), reason="Terminated"),
    ):
        result = classify(stopped)
        assert (result.failure_class, result.exit_code) == (FailureClass.PREEMPTED, ExitCode.PREEMPTED)
        assert said in result.message


def test_the_trainers_sigterm_code_on_a_pod_nothing_asked_to_stop_is_a_crash_of_another_rank() -> None:
    # torchrun stops a pod's other ranks when one dies without a message: they report the SIGTERM.
    result = classify(pod("Failed", state=exited(1, message="[exit 20] preempted (SIGTERM)")))
    assert (result.failure_class, result.exit_code) == (FailureClass.UNKNOWN, ExitCode.PREEMPTED)
    assert "nothing asked its pod to stop" in result.message


def test_a_pod_deleted_by_a_user_is_preempted_however_its_trainer_ended() -> None:
    for state in (exited(137), exited(143), exited(1, message="[exit 16] NCCL error: remote process exited")):
        result = classify(pod("Failed", state=state, deleting=True))
        assert result.failure_class is FailureClass.PREEMPTED, state
        assert result.message.startswith("the pod was deleted outside the operator")


def test_a_deleted_pods_own_failure_keeps_its_class() -> None:
    result = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM), deleting=True))
    assert result.failure_class is FailureClass.CUDA_OOM


def test_a_deleted_pod_on_a_lost_node_is_node_lost() -> None:
    p = pod("Failed", state=exited(137), deleting=True)
    assert classify(p, node("Unknown", since_seconds=600)).failure_class is FailureClass.NODE_LOST


SAVED = "preempted (SIGTERM): checkpoint saved at step 40"


@pytest.mark.parametrize("lost", [node("Unknown", since_seconds=600), None], ids=["not-ready", "deleted"])
@pytest.mark.parametrize(
    "message", [f"[exit 20] {SAVED}", "[exit 16] communication error between ranks: NCCL error"]
)
def test_a_trainer_stopping_on_a_node_that_is_gone_went_with_the_node(lost: Any, message: str) -> None:
    for ended in (
        pod("Failed", state=exited(1, message=message)),
        pod("Failed", state=exited(1, message=message), deleting=True),
        pod("Failed", state=exited(1, message=message), disruption="DeletionByTaintManager"),
    ):
        result = classify_pod(ended, lost, now=NOW)
        assert result.failure_class is FailureClass.NODE_LOST, ended
        assert result.message.startswith(f"node {NODE} ") and message.split("] ")[1] in result.message


def test_a_trainer_stopped_by_a_node_shutdown_is_preempted_though_the_node_is_gone_by_now() -> None:
    shutdown = pod(
        "Failed",
        state=exited(1, message=f"[exit 20] {SAVED}"),
        reason="Terminated",
        message="Pod was terminated in response to imminent node shutdown.",
    )
    for lost in (node("Unknown", since_seconds=600), None):
        result = classify_pod(shutdown, lost, now=NOW)
        assert (result.failure_class, result.message) == (FailureClass.PREEMPTED, SAVED)


def test_sigkill_without_oom_or_disruption_is_unknown() -> None:
    result = classify(pod("Failed", state=exited(137)))
    assert result.failure_class is FailureClass.UNKNOWN
    assert "SIGKILL" in result.message


def test_node_pressure_eviction_for_memory_is_host_oom() -> None:
    message = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 12Mi."
    result = classify(pod("Failed", reason="Evicted", message=message, disruption="TerminationByKubelet"))
    assert result.failure_class is FailureClass.HOST_OOM


def test_eviction_for_disk_is_preempted() -> None:
    message = "The node was low on resource: ephemeral-storage."
    result = classify(pod("Failed", reason="Evicted", message=message))
    assert result.failure_class is FailureClass.PREEMPTED


def test_node_shutdown_is_preempted() -> None:
    result = classify(
        pod(
            "Failed", reason="Terminated", message="Pod was terminated in response to imminent node shutdown."
        )
    )
    assert result.failure_class is FailureClass.PREEMPTED


def test_gpu_admission_failure_is_gpu_unavailable() -> None:
    result = classify(
        pod("Failed", reason="UnexpectedAdmissionError", message="Allocate failed due to no healthy devices")
    )
    assert result.failure_class is FailureClass.GPU_UNAVAILABLE


@pytest.mark.parametrize(
    ("reason", "failure"),
    [
        ("InvalidImageName", FailureClass.IMAGE_PULL_ERROR),  # never pullable: failed for good
        ("ImagePullBackOff", FailureClass.NETWORK_ERROR),  # an hour of back-offs: a new attempt
    ],
)
def test_an_image_that_cannot_be_pulled_ends_the_attempt(reason: str, failure: FailureClass) -> None:
    result = classify(pod("Pending", state=waiting(reason, 'Back-off pulling image "nope:1"')))
    assert (result.outcome, result.failure_class) == (Outcome.FAILED, failure)
    assert "nope:1" in result.message


def test_a_first_image_pull_error_is_given_the_kubelets_retry() -> None:
    assert classify(pod("Pending", state=waiting("ErrImagePull"))).outcome is Outcome.RUNNING


def test_an_init_container_image_pull_failure_counts_too() -> None:
    result = classify(
        pod("Pending", state=waiting("PodInitializing"), init_state=waiting("InvalidImageName"))
    )
    assert result.failure_class is FailureClass.IMAGE_PULL_ERROR


def test_a_missing_secret_key_is_a_config_error() -> None:
    message = "couldn't find key token in Secret default/hf-token"
    result = classify(pod("Pending", state=waiting("CreateContainerConfigError", message)))
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert "hf-token" in result.message


def test_a_running_pod_on_a_deleted_node_is_node_lost() -> None:
    result = classify_pod(pod(state=running()), None, now=NOW)
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, NODE)


def test_a_node_notready_past_the_grace_loses_its_pods() -> None:
    result = classify(pod(state=running()), node("Unknown", since_seconds=300), node_lost_grace_seconds=120)
    assert result.failure_class is FailureClass.NODE_LOST


def test_a_brief_notready_blip_does_not_end_the_attempt() -> None:
    assert classify(pod(state=running()), node("False", since_seconds=30)).outcome is Outcome.RUNNING


def test_a_vanished_pod_whose_node_is_gone_is_node_lost() -> None:
    result = classify_pod(None, None, now=NOW, node_name=NODE)
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, NODE)


def test_a_vanished_pod_on_a_healthy_node_was_deleted_and_counts_as_preempted() -> None:
    assert classify_pod(None, node(), now=NOW, node_name=NODE).failure_class is FailureClass.PREEMPTED


def test_a_vanished_pod_that_was_never_scheduled_was_deleted() -> None:
    assert classify_pod(None, None, now=NOW).failure_class is FailureClass.PREEMPTED


def test_taint_manager_deletion_on_an_unreachable_node_is_node_lost() -> None:
    p = pod("Failed", disruption="DeletionByTaintManager")
    assert classify(p, node("Unknown", since_seconds=600)).failure_class is FailureClass.NODE_LOST


def test_a_pod_being_deleted_is_not_over_until_the_trainer_exits() -> None:
    p = pod(state=running(), disruption="PreemptionByScheduler", deleting=True)
    assert classify(p, stall_timeout_seconds=60).outcome is Outcome.RUNNING


def test_no_progress_for_longer_than_the_stall_timeout_is_stalled() -> None:
    result = classify(
        pod(state=running(4000)), last_progress=NOW - timedelta(seconds=700), stall_timeout_seconds=600
    )
    assert result.failure_class is FailureClass.STALLED
    assert "700 s" in result.message


def test_a_trainer_that_never_reported_is_stalled_counting_from_its_start() -> None:
    assert classify(pod(state=running(601)), stall_timeout_seconds=600).failure_class is FailureClass.STALLED
    assert classify(pod(state=running(599)), stall_timeout_seconds=600).outcome is Outcome.RUNNING


def test_stall_detection_is_off_without_a_timeout() -> None:
    assert classify(pod(state=running(10**6))).outcome is Outcome.RUNNING


def test_long_termination_messages_become_one_trimmed_line() -> None:
    result = classify(pod("Failed", state=exited(ExitCode.DATA_ERROR, message="x" * 5000)))
    assert len(result.message) == 300 and "\n" not in result.message


def test_a_multi_node_attempt_takes_the_root_cause_not_the_peers_nccl_errors() -> None:
    peer = classify(pod("Failed", state=exited(ExitCode.COMMUNICATION_ERROR)))
    lost = classify_pod(None, None, now=NOW, node_name="gpu-a800-1")
    result = classify_attempt([peer, lost, Classification(Outcome.RUNNING)])
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, "gpu-a800-1")


def test_a_multi_node_attempt_succeeds_only_when_every_pod_does() -> None:
    done = Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    assert classify_attempt([done, Classification(Outcome.RUNNING)]).outcome is Outcome.RUNNING
    assert classify_attempt([done, done]).outcome is Outcome.SUCCEEDED
    assert classify_attempt([]).outcome is Outcome.RUNNING


def test_ending_a_record_counts_the_steps_since_the_last_checkpoint() -> None:
    record = AttemptRecord(attempt=2, node=NODE, start_time=NOW - timedelta(hours=1), resumed_from_step=100)
    failed = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM, message="CUDA out of memory")))
    ended = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=150)
    assert (ended.reason, ended.exit_code, ended.lost_steps, ended.end_time) == (
        FailureClass.CUDA_OOM,
        15,
        30,
        NOW,
    )
    no_checkpoint = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=None)
    assert no_checkpoint.lost_steps == 80


def test_a_succeeded_attempt_loses_no_steps_and_says_so_by_leaving_them_unset() -> None:
    record = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))
    done = Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    ended = end_record(record, done, end_time=NOW, progress_step=200, checkpoint_step=150)
    assert ended.succeeded and ended.lost_steps is None


def test_an_ended_record_round_trips_through_status_json_in_camel_case() -> None:
    record = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))
    ended = end_record(
        record,
        classify(pod("Failed", state=exited(143), disruption="PreemptionByScheduler")),
        end_time=NOW,
        progress_step=10,
        checkpoint_step=10,
    )
    wire = ended.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert wire["reason"] == "Preempted" and wire["exitCode"] == 143 and wire["lostSteps"] == 0
    assert AttemptRecord.model_validate(wire) == ended


def test_a_failed_attempt_is_described_in_one_line_for_its_event() -> None:
    record = AttemptRecord(attempt=3, node=NODE, start_time=NOW - timedelta(hours=1))
    failed = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM, message="CUDA out of memory")))
    ended = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=150)
    assert describe_failure(ended) == (
        f"attempt 3 on {NODE} failed with CudaOOM (exit code 15): CUDA out of memory;"
        " 30 step(s) since the last checkpoint"
    )


def test_every_failure_class_has_a_place_in_the_root_cause_order() -> None:
    assert set(ROOT_CAUSE_ORDER) == set(FailureClass) and len(ROOT_CAUSE_ORDER) == len(FailureClass)
