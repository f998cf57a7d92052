"""A container the node could not create or start: a broken GPU runtime (NVIDIA's container hook, a CDI
device that does not resolve) is the node's fault, avoided by the next attempt and free of maxRestarts; an
image that asks for a newer CUDA than the driver has is a DriverMismatch, one that holds driver files of
its own or cannot run the trainer's command a ConfigError naming the image to fix (spec.image, else the
operator's --image); anything else is Unknown. A create that keeps failing ends the attempt after its
give-up time, which for errors not the GPU runtime's leaves room for a long image pull."""

from __future__ import annotations

import pytest

from sftjob.attempts import RestartPolicy
from sftjob.failures import FailureClass
from sftjob_operator.attempt_end import end_record
from sftjob_operator.classify import Outcome
from sftjob_operator.not_started import (
    CREATE_GIVE_UP_SECONDS,
    CREATE_OTHER_GIVE_UP_SECONDS,
    IMAGE_PULL_GIVE_UP_SECONDS,
)
from sftjob_operator.restarts import ADVICE
from tests.unit.classify_cases import (
    CDI_UNRESOLVABLE,
    DRIVER_FILE_IN_IMAGE,
    NO_NVML,
    NO_PYTHON,
    NODE,
    NOW,
    NVML_MISMATCH,
    PERSISTENCED_SOCKET,
    RECORD,
    REQUIRE_CUDA,
    UNKNOWN_DEVICE,
    classify,
    exited,
    pod,
    waiting,
)
from tests.unit.restart_cases import candidates, failed, give_up, policy_decision, restart

# An image built for another CPU architecture than the node's.
WRONG_CPU = NO_PYTHON.replace('exec: "python": executable file not found in $PATH', "exec format error")


@pytest.mark.parametrize(
    ("message", "failure", "said"),
    [
        (NVML_MISMATCH, FailureClass.DRIVER_MISMATCH, "StartError: nvidia-container-cli: initialization"),
        (UNKNOWN_DEVICE, FailureClass.GPU_UNAVAILABLE, "StartError: nvidia-container-cli: device error"),
        (NO_NVML, FailureClass.GPU_UNAVAILABLE, "StartError: nvidia-container-cli: initialization"),
        (REQUIRE_CUDA, FailureClass.DRIVER_MISMATCH, "StartError: nvidia-container-cli: requirement error"),
        (PERSISTENCED_SOCKET, FailureClass.GPU_UNAVAILABLE, "StartError: nvidia-container-cli: mount error"),
    ],
)
def test_a_container_the_gpu_runtime_could_not_start_fails_the_attempt_as_the_nodes_fault(
    message: str, failure: FailureClass, said: str
) -> None:
    result = classify(pod("Failed", state=exited(128, "StartError", message)))
    assert (result.outcome, result.failure_class, result.node) == (Outcome.FAILED, failure, NODE)
    assert result.message.startswith(said)  # the toolkit's words, not runc's preamble


def test_driver_files_baked_into_the_image_fail_the_job_at_once_as_a_config_error_naming_the_file() -> None:
    result = classify(pod("Failed", state=exited(128, "StartError", DRIVER_FILE_IN_IMAGE)), own_image=True)
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert result.message.startswith("StartError: spec.image holds /usr/bin/nvidia-smi, a driver file")
    assert result.message.endswith("build the image without NVIDIA driver files")
    ended = end_record(RECORD, result, end_time=NOW, progress_step=None, checkpoint_step=None)
    failed_job = give_up(policy_decision([ended]))
    assert failed_job.reason == FailureClass.CONFIG_ERROR.value
    assert failed_job.message.endswith(ADVICE[FailureClass.CONFIG_ERROR])


def test_an_image_that_cannot_run_the_trainers_command_is_a_config_error_not_a_node_fault() -> None:
    result = classify(pod("Failed", state=exited(128, "StartError", NO_PYTHON)), own_image=True)
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert "spec.image cannot run the trainer" in result.message and '"python"' in result.message
    assert classify(pod("Failed", state=exited(128, "StartError", WRONG_CPU))).failure_class is (
        FailureClass.CONFIG_ERROR
    )


@pytest.mark.parametrize(
    "state",
    [
        exited(128, "StartError", WRONG_CPU),
        waiting("CreateContainerError", WRONG_CPU),
        exited(128, "StartError", DRIVER_FILE_IN_IMAGE),
    ],
)
def test_an_image_fault_of_a_job_without_spec_image_names_the_operators_image_not_spec_image(
    state: dict[str, object],
) -> None:
    phase = "Failed" if "terminated" in state else "Pending"
    result = classify(pod(phase, state=state, kubelet_took_it_seconds_ago=CREATE_GIVE_UP_SECONDS + 10))
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert ": the trainer image (the operator's --image) " in result.message
    assert "spec.image holds" not in result.message and "spec.image cannot" not in result.message


def test_a_start_error_neither_the_image_nor_the_gpu_runtime_explains_is_unknown() -> None:
    other = NO_PYTHON.replace('exec: "python": executable file not found in $PATH', "permission denied")
    result = classify(pod("Failed", state=exited(128, "StartError", other)))
    assert result.failure_class is FailureClass.UNKNOWN


def test_a_trainer_that_finds_the_driver_and_its_library_mismatched_is_a_driver_mismatch() -> None:
    message = (
        "[exit 1] unexpected error: RuntimeError: Failed to initialize NVML: Driver/library version mismatch"
    )
    assert (
        classify(pod("Failed", state=exited(1, message=message))).failure_class
        is FailureClass.DRIVER_MISMATCH
    )


def stuck(reason: str, message: str, seconds: float) -> dict[str, object]:
    return pod("Pending", state=waiting(reason, message), kubelet_took_it_seconds_ago=seconds)


@pytest.mark.parametrize("reason", ["CreateContainerError", "RunContainerError"])
def test_a_container_stuck_on_unresolvable_cdi_devices_ends_as_gpu_unavailable_after_its_give_up_time(
    reason: str,
) -> None:
    assert classify(stuck(reason, CDI_UNRESOLVABLE, CREATE_GIVE_UP_SECONDS - 10)).outcome is Outcome.RUNNING
    result = classify(stuck(reason, CDI_UNRESOLVABLE, CREATE_GIVE_UP_SECONDS + 10))
    assert (result.failure_class, result.node) == (FailureClass.GPU_UNAVAILABLE, NODE)
    assert result.message.startswith(f"{reason}: failed to generate container")
    assert result.message.endswith("(the pod has not started in 5 min)")


@pytest.mark.parametrize(
    "message",
    [
        "context deadline exceeded",
        'failed to reserve container name "trainer_job-1-0_default_4f2a_0": name'
        ' "trainer_job-1-0_default_4f2a_0" is reserved for "9c1d"',
    ],
)
def test_a_create_error_after_a_long_image_pull_gets_the_kubelets_retry_before_it_ends_as_unknown(
    message: str,
) -> None:
    twelve_minute_pull = 12 * 60
    assert twelve_minute_pull > CREATE_GIVE_UP_SECONDS
    assert classify(stuck("CreateContainerError", message, twelve_minute_pull)).outcome is Outcome.RUNNING
    assert CREATE_OTHER_GIVE_UP_SECONDS == IMAGE_PULL_GIVE_UP_SECONDS + CREATE_GIVE_UP_SECONDS
    late = classify(stuck("CreateContainerError", message, CREATE_OTHER_GIVE_UP_SECONDS - 10))
    assert late.outcome is Outcome.RUNNING
    result = classify(stuck("CreateContainerError", message, CREATE_OTHER_GIVE_UP_SECONDS + 10))
    assert result.failure_class is FailureClass.UNKNOWN and message in result.message
    assert result.message.endswith("(the pod has not started in 20 min)")


def test_the_attempt_after_a_broken_gpu_runtime_avoids_its_node_without_consuming_max_restarts() -> None:
    ended = end_record(
        RECORD.model_copy(update={"attempt": 4}),
        classify(pod("Failed", state=exited(128, "StartError", NVML_MISMATCH))),
        end_time=NOW,
        progress_step=None,
        checkpoint_step=None,
    )
    counted = [failed(i, FailureClass.UNKNOWN, node="other") for i in (1, 2, 3)]  # maxRestarts 3 spent
    decision = restart(policy_decision([*counted, ended], RestartPolicy(max_restarts=3), candidates()))
    assert decision.attempt == 5 and decision.avoid_nodes == (NODE,)
