"""A container the node could not create or start: a broken GPU runtime (NVIDIA's container hook, a CDI
device that does not resolve) is the node's fault, avoided by the next attempt and free of maxRestarts;
anything else is Unknown. A create that keeps failing ends the attempt after its give-up time."""

from __future__ import annotations

import pytest

from sftjob.attempts import RestartPolicy
from sftjob.failures import FailureClass
from sftjob_operator.classify import CREATE_GIVE_UP_SECONDS, Outcome, end_record
from tests.unit.classify_cases import (
    CDI_UNRESOLVABLE,
    NO_NVML,
    NO_TORCHRUN,
    NODE,
    NOW,
    NVML_MISMATCH,
    RECORD,
    UNKNOWN_DEVICE,
    classify,
    exited,
    pod,
    waiting,
)
from tests.unit.restart_cases import candidates, failed, policy_decision, restart


@pytest.mark.parametrize(
    ("message", "failure", "said"),
    [
        (NVML_MISMATCH, FailureClass.DRIVER_MISMATCH, "StartError: nvidia-container-cli: initialization"),
        (UNKNOWN_DEVICE, FailureClass.GPU_UNAVAILABLE, "StartError: nvidia-container-cli: device error"),
        (NO_NVML, FailureClass.GPU_UNAVAILABLE, "StartError: nvidia-container-cli: initialization"),
    ],
)
def test_a_container_the_gpu_runtime_could_not_start_fails_the_attempt_as_the_nodes_fault(
    message: str, failure: FailureClass, said: str
) -> None:
    result = classify(pod("Failed", state=exited(128, "StartError", message)))
    assert (result.outcome, result.failure_class, result.node) == (Outcome.FAILED, failure, NODE)
    assert result.message.startswith(said)  # the toolkit's words, not runc's preamble


def test_a_start_error_the_gpu_runtime_did_not_cause_is_unknown() -> None:
    result = classify(pod("Failed", state=exited(128, "StartError", NO_TORCHRUN)))
    assert result.failure_class is FailureClass.UNKNOWN and "torchrun" in result.message


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


def test_a_container_create_that_keeps_failing_for_another_reason_ends_as_unknown() -> None:
    message = 'failed to reserve container name "trainer_job-1-0": name is reserved'
    assert classify(stuck("CreateContainerError", message, 60)).outcome is Outcome.RUNNING
    result = classify(stuck("CreateContainerError", message, CREATE_GIVE_UP_SECONDS + 10))
    assert result.failure_class is FailureClass.UNKNOWN and "name is reserved" in result.message


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
