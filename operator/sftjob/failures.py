"""Exit codes the trainer ends with and the failure classes the operator sorts ended attempts into.

The trainer writes a one-line reason to /dev/termination-log and exits with one of these codes; the
operator reads both from the container status. Keeping both sides on this one table is what lets the
operator restart transient failures, fail permanent ones at once, and re-plan after CUDA OOM.

The container's PID 1 is torchrun, which exits 1 whatever code a failed trainer process ended with, so
the trainer also starts a failure's message with its code (:func:`tag_exit_code`, ``[exit 11] dataset
/data/train.jsonl is empty``) and the operator reads it back with :func:`read_exit_tag`.
"""

import re
from enum import IntEnum, StrEnum


class ExitCode(IntEnum):
    """Documented trainer exit codes (docs/failures.md lists them for users)."""

    OK = 0
    UNKNOWN = 1
    CONFIG_ERROR = 10
    DATA_ERROR = 11
    MODEL_LOAD_ERROR = 12
    GPU_UNAVAILABLE = 13
    DRIVER_MISMATCH = 14
    CUDA_OOM = 15
    COMMUNICATION_ERROR = 16
    STORAGE_ERROR = 17
    NETWORK_ERROR = 18  # the hub or the network failed while downloading the model or the dataset
    DIVERGED = 19  # the loss or the gradients stayed non-finite: training diverged (the weights kept)
    PREEMPTED = 20  # SIGTERM received, current step finished, checkpoint saved


class FailureClass(StrEnum):
    CUDA_OOM = "CudaOOM"
    HOST_OOM = "HostOOM"
    PREEMPTED = "Preempted"
    NODE_LOST = "NodeLost"
    COMMUNICATION_ERROR = "CommunicationError"
    IMAGE_PULL_ERROR = "ImagePullError"
    CONFIG_ERROR = "ConfigError"
    DATA_ERROR = "DataError"
    MODEL_LOAD_ERROR = "ModelLoadError"
    STORAGE_ERROR = "StorageError"
    NETWORK_ERROR = "NetworkError"
    DIVERGED = "Diverged"
    GPU_UNAVAILABLE = "GpuUnavailable"
    DRIVER_MISMATCH = "DriverMismatch"
    STALLED = "Stalled"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    UNKNOWN = "Unknown"


EXIT_CODE_CLASS: dict[int, FailureClass] = {
    ExitCode.UNKNOWN: FailureClass.UNKNOWN,
    ExitCode.CONFIG_ERROR: FailureClass.CONFIG_ERROR,
    ExitCode.DATA_ERROR: FailureClass.DATA_ERROR,
    ExitCode.MODEL_LOAD_ERROR: FailureClass.MODEL_LOAD_ERROR,
    ExitCode.GPU_UNAVAILABLE: FailureClass.GPU_UNAVAILABLE,
    ExitCode.DRIVER_MISMATCH: FailureClass.DRIVER_MISMATCH,
    ExitCode.CUDA_OOM: FailureClass.CUDA_OOM,
    ExitCode.COMMUNICATION_ERROR: FailureClass.COMMUNICATION_ERROR,
    ExitCode.STORAGE_ERROR: FailureClass.STORAGE_ERROR,
    ExitCode.NETWORK_ERROR: FailureClass.NETWORK_ERROR,
    ExitCode.DIVERGED: FailureClass.DIVERGED,
    ExitCode.PREEMPTED: FailureClass.PREEMPTED,
}

# Fix the spec (or the data, or the model) and apply again: restarting cannot help. A diverged run
# resumed from its last checkpoint, with the same data in the same order, diverges again.
PERMANENT = frozenset(
    {
        FailureClass.CONFIG_ERROR,
        FailureClass.DATA_ERROR,
        FailureClass.MODEL_LOAD_ERROR,
        FailureClass.DIVERGED,
        FailureClass.IMAGE_PULL_ERROR,
        FailureClass.DEADLINE_EXCEEDED,
    }
)
# The node was at fault: retry elsewhere, avoiding it.
NODE_FAULT = frozenset({FailureClass.GPU_UNAVAILABLE, FailureClass.DRIVER_MISMATCH, FailureClass.NODE_LOST})
# Not the job's fault: restarts for these do not consume restartPolicy.maxRestarts (bounded separately).
FREE_RESTART = frozenset({FailureClass.PREEMPTED, FailureClass.NODE_LOST})


class TrainerError(Exception):
    """Raised inside the trainer with the exit code it should end with and a one-line reason."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


# What a GPU that failed under the trainer says (hardware, NVLink, the NVSwitch fabric manager, a card the
# runtime cannot open): read by the trainer when classifying an exception and by the operator when a
# message is all it has, so the two never drift apart.
GPU_FAULT_PATTERN = (
    r"uncorrectable ECC|uncorrectable NVLink|\bXid\b|GPU is lost|fallen off the bus"
    r"|system not yet initiali[sz]ed|\berror 802\b|fabric ?manager|no CUDA-capable device|busy or unavailable"
)
# The image's PyTorch (or a CUDA extension in it) was built without this GPU's architecture.
NO_KERNEL_IMAGE = "no kernel image is available for execution on the device"
# What a GPU out of memory says, read by the trainer and the operator alike, before any NCCL rule: PyTorch's
# caching allocator; a CUDA call outside it (cuBLAS workspace, kernels, context); and NCCL allocating its own
# buffers, whose "Last error" PyTorch quotes. NCCL's CUCHECK writes "Cuda failure %d '%s'" (cuMemCreate on the
# cuMem path: "Cuda failure 2 'out of memory'"), CUDACHECK "Cuda failure '%s'", and ncclCudaCalloc/Malloc then
# overwrite the last error with "Failed to CUDA calloc %ld bytes" / "Failed to CUDA malloc %ld bytes"
# (NVIDIA/nccl src/include/cudawrap.h, checks.h, alloc.h; debug.cc keeps only the last WARN).
CUDA_OOM_PATTERN = (
    r"CUDA out of memory|CUDA error: out of memory|Cuda failure (?:\d+ )?'out of memory'"
    r"|Failed to CUDA [cm]alloc|CUBLAS_STATUS_ALLOC_FAILED"
)


class OomPhase(StrEnum):
    """Where the trainer ran out of GPU memory outside the forward and backward passes, the memory the OOM
    ladder's rungs (micro-batch, checkpointing, row length) lower: its message says so right after the
    words ``CUDA out of memory`` (``CUDA out of memory while loading the model from org/model: ...``), where
    the operator reads it (:func:`oom_phase`) to skip the ladder."""

    LOADING = "while loading"  # the model, its weights onto the GPUs and their sharding, or a checkpoint
    OPTIMIZER_STEP = "in the optimizer step"  # the optimizer's state (allocated at its first step)
    SAVING = "while saving"  # a checkpoint or the output


CUDA_OOM_REASON = "CUDA out of memory"
# How the trainer's start-up all-reduce (distributed.probe_communication) begins its CommunicationError. It
# runs right after preflight found the plan's GPU memory free, so NCCL failing to allocate there ("Failed to
# CUDA calloc" follows any cudaMalloc error, a faulted GPU's or an unsupported cuMem call's) is no CUDA OOM.
COMMUNICATION_PROBE = "the first collective between"


def oom_phase(reason: str) -> OomPhase | None:
    """The phase a CUDA OOM reason names (the trainer's, as recorded), or None: in the forward or backward
    pass, or not said."""
    return next((p for p in OomPhase if reason.startswith(f"{CUDA_OOM_REASON} {p.value}")), None)


_EXIT_TAG = re.compile(r"\[exit (\d{1,3})\] ?")


def tag_exit_code(code: int, reason: str) -> str:
    """The termination message of a trainer that ends with ``code``: ``[exit 11] <reason>``."""
    return f"[exit {code:d}] {reason}"


def read_exit_tag(message: str) -> tuple[int | None, str]:
    """The exit code a termination message starts with (None when it has no tag) and the rest of it."""
    text = message.lstrip()
    match = _EXIT_TAG.match(text)
    return (int(match[1]), text[match.end() :]) if match else (None, message)
