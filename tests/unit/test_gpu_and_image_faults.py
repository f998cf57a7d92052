"""A GPU whose NVLinks or NVSwitch fabric failed is the node's fault, whoever reported it (the trainer's
uncaught error or NCCL); an image without kernels for the GPU's architecture, or a job's own image without
a module the trainer imports, is a ConfigError that names spec.image."""

from __future__ import annotations

import pytest

from sftjob.attempts import AttemptRecord
from sftjob.failures import FailureClass, tag_exit_code
from sftjob_operator.attempt_end import end_record
from sftjob_operator.restarts import avoided_nodes
from tests.unit.classify_cases import NODE, NOW, RECORD, classify, exited, pod
from tests.unit.test_termination_messages import torchrun_tail


def ended(message: str, *, own_image: bool = False) -> AttemptRecord:
    """The attempt record of a trainer that failed with ``message`` as its termination message."""
    outcome = classify(pod("Failed", state=exited(1, message=message)), own_image=own_image)
    return end_record(RECORD, outcome, end_time=NOW, progress_step=None, checkpoint_step=None)


def unexpected(error: str) -> str:
    """The message the trainer writes for an exception it has no code for."""
    return tag_exit_code(1, f"unexpected error: {error}")


@pytest.mark.parametrize(
    "error",
    [
        "RuntimeError: CUDA error: uncorrectable NVLink error was detected during the execution",
        "RuntimeError: CUDA error: system not yet initialized",
        "RuntimeError: Unexpected error from cudaGetDeviceCount(). Error 802: system not yet initialized",
        "RuntimeError: CUDA error: GPU is lost",
    ],
)
def test_a_gpu_whose_links_or_fabric_failed_is_the_nodes_fault_and_the_node_is_avoided(error: str) -> None:
    record = ended(unexpected(error))
    assert record.reason is FailureClass.GPU_UNAVAILABLE
    assert avoided_nodes([record]) == (NODE,)


def test_an_nccl_error_caused_by_a_failed_nvlink_is_the_gpus_fault_not_the_networks() -> None:
    nccl = (
        "communication error between ranks: DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970,"
        " unhandled cuda error; Last error: Cuda failure 'uncorrectable NVLink error was detected during the"
        " execution'"
    )
    assert ended(tag_exit_code(16, nccl)).reason is FailureClass.GPU_UNAVAILABLE
    plain = "communication error between ranks: DistBackendError: NCCL error: remote process exited"
    assert ended(tag_exit_code(16, plain)).reason is FailureClass.COMMUNICATION_ERROR


@pytest.mark.parametrize("own_image", [True, False])
def test_an_image_without_kernels_for_the_gpus_architecture_is_a_config_error_naming_spec_image(
    own_image: bool,
) -> None:
    error = "RuntimeError: CUDA error: no kernel image is available for execution on the device"
    record = ended(unexpected(error), own_image=own_image)
    assert record.reason is FailureClass.CONFIG_ERROR
    assert "no kernel image is available for execution on the device" in record.message
    assert "spec.image" in record.message and "TORCH_CUDA_ARCH_LIST" in record.message


def test_a_module_the_trainer_cannot_import_from_the_jobs_own_image_is_a_config_error_naming_spec_image() -> (
    None
):
    tail = torchrun_tail("ModuleNotFoundError: No module named 'peft'", 0, 1, "To enable traceback see: ...")
    record = ended(tail, own_image=True)
    assert record.reason is FailureClass.CONFIG_ERROR
    assert record.message.startswith(
        "spec.image cannot import what the trainer needs (ModuleNotFoundError: No module named 'peft')"
    )


def test_a_failed_import_in_the_operators_image_or_of_a_driver_library_is_no_config_error() -> None:
    assert ended(unexpected("ModuleNotFoundError: No module named 'peft'")).reason is FailureClass.UNKNOWN
    driver = unexpected(
        "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory"
    )
    assert ended(driver, own_image=True).reason is FailureClass.UNKNOWN


def test_an_import_warning_earlier_in_the_log_does_not_hide_the_error_that_ended_the_rank() -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    tail = torchrun_tail(f"ImportError: flash_attn is not installed, using sdpa\n{oom}", 0, 1, "see the log")
    assert ended(tail, own_image=True).reason is FailureClass.CUDA_OOM


def test_a_jobs_own_image_older_than_the_launcher_is_a_config_error_naming_spec_image() -> None:
    record = ended("/opt/conda/bin/python: No module named sftjob_trainer.launch\n", own_image=True)
    assert record.reason is FailureClass.CONFIG_ERROR
    assert record.message.startswith(
        "spec.image cannot import what the trainer needs (No module named sftjob_trainer.launch)"
    )
