"""What a trainer container's termination message says: the trainer's exit code and a one-line summary.

The container runs torchrun, which exits 1 whatever code a failed rank ended with, so the trainer starts
its one-line message with that code (``[exit 11] dataset /data/train.jsonl is empty``, see
:func:`sftjob.failures.tag_exit_code`). When a rank wrote nothing (a segfault, the NCCL watchdog's SIGABRT,
a SIGKILLed rank) the launcher above torchrun (``sftjob_trainer.launch``) writes its root cause and last
words instead, untagged (:mod:`sftjob.torchrun_report`). When nothing wrote a message (torchrun failed
before any rank did, the launcher was killed too) the pod's ``FallbackToLogsOnError`` policy makes the
message the last 2048 bytes of the log, which may end with the rank's last words, then torchrun's own
traceback and its report (shown in :mod:`sftjob.torchrun_report`).

Such a tail is summed up as the root cause's rank and how it ended, then the last line the ranks wrote
before torchrun took over (a C++ backtrace's frames skipped): ``rank 1 killed by SIGABRT: <last line>``.
torchrun's part alone (a SIGTERM line per other local rank, its traceback, its report) takes about the
2048 bytes, so the first line, which the kubelet cut, is left out, and a tail without the rank's words says
so (``rank 1 killed by SIGABRT; its error message is not in ...: see the pod's log``). When no code says
how it failed, the words often do (:data:`MESSAGE_SIGNATURES`: a CUDA OOM, an NCCL error, a full disk).

A container that never ran (terminated as ``StartError``, or waiting in ``CreateContainerError``) has the
container runtime's message instead. When it is the node's GPU runtime that failed (NVIDIA's container
hook, ``nvidia-container-cli: initialization error: nvml error: driver/library version mismatch``, or a CDI
device that does not resolve), the node is usually broken, not the job: :func:`gpu_runtime_failure` says
so. An image that asks for a newer CUDA than the driver has (a requirement error) is a DriverMismatch,
which the restart policy blames on the job once it has happened on two nodes; an image that holds driver
files of its own, or cannot run the trainer's command (no python, another CPU architecture), fails on
every node, a ConfigError at once, and so does an image without kernels for the GPU's architecture or,
when the job brought its own image, without a module the trainer imports (:func:`image_fault`). Pure
functions, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sftjob.failures import CUDA_OOM_PATTERN, GPU_FAULT_PATTERN, NO_KERNEL_IMAGE, FailureClass, read_exit_tag
from sftjob.torchrun_report import RULE, last_words, read_report, summarize

# torchrun's own log lines: they name its modules, and even cut short end in glog's "<file>.py:<line>] ".
_TORCHRUN_LOG = re.compile(r"torch/distributed/elastic/|\.py:\d+\] ")
# The kubelet's fallback message is the log's last 80 lines cut to their last 2048 bytes (its
# MaxContainerTerminationMessageLogLines and MaxContainerTerminationMessageLogLength): a tail that long begins
# mid-line. torchrun's own output after a failure (a SIGTERM line per other local rank, its traceback and its
# report) takes about that much, so the rank's own words are rarely left in it.
LOG_TAIL_BYTES = 2048
NOT_IN_TAIL = (
    f"its error message is not in the last {LOG_TAIL_BYTES} bytes of the log the kubelet keeps:"
    " see the pod's log"
)
# The toolkit mounts the node's driver files (nvidia-smi, libnvidia-ml.so.1...) into every GPU container;
# one the image has of its own is in the way, on every node: "mount error: file creation failed:
# <rootfs>/usr/bin/nvidia-smi: file exists". (Other file creation failures, such as the persistenced
# socket's "no such device or address", are the node's.)
IMAGE_DRIVER_FILE = re.compile(r"mount error: file creation failed: (\S+?): file exists", re.IGNORECASE)
# The image cannot run the trainer's command at all (no python in it, or built for another CPU
# architecture; the job's spec.image or the operator's --image): the same on every node and every attempt.
IMAGE_CANNOT_RUN = re.compile(r"exec: \S+: executable file not found in \$PATH|exec format error")
_CONTAINER_ROOT = re.compile(r"^.*/(?:rootfs|merged)(?=/)")  # containerd's and CRI-O's container root
# What the GPU runtime says when it cannot hand a container its GPUs. First match wins. The image's
# NVIDIA_REQUIRE_CUDA (or cuda>= in NVIDIA_REQUIRE_*) unmet by the node's driver is a requirement error.
GPU_RUNTIME_SIGNATURES: tuple[tuple[re.Pattern[str], FailureClass], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cls)
    for pattern, cls in (
        (r"driver/library version mismatch", FailureClass.DRIVER_MISMATCH),
        (r"requirement error|unsatisfied condition", FailureClass.DRIVER_MISMATCH),
        (
            r"nvidia-container-cli|nvidia-container-runtime|nvml error|CDI devices?\b|libnvidia-ml",
            FailureClass.GPU_UNAVAILABLE,
        ),
    )
)
# A GPU that is gone or whose memory or links failed (Xid errors; "uncorrectable NVLink error" on an SXM
# card), or whose NVSwitch fabric is not up (CUDA error 802, "system not yet initialized": the node's fabric
# manager is not running): the node's fault, even when NCCL is what reported it.
GPU_FAULT_SIGNATURE = re.compile(GPU_FAULT_PATTERN, re.IGNORECASE)
# A CUDA OOM, also inside NCCL (which trainers older than sftjob.failures.CUDA_OOM_PATTERN tagged [exit 16]).
CUDA_OOM_SIGNATURE = re.compile(CUDA_OOM_PATTERN, re.IGNORECASE)
# When no code says more (an uncaught exception, a crash that wrote no message and left the log tail
# instead), the message often still does. First match wins.
MESSAGE_SIGNATURES: tuple[tuple[re.Pattern[str], FailureClass], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cls)
    for pattern, cls in (
        # Before the NCCL rule: an OOM inside NCCL is worded as NCCL's error (sftjob.failures).
        (f"{CUDA_OOM_PATTERN}|OutOfMemoryError", FailureClass.CUDA_OOM),
        (r"DataLoader worker .* killed by signal: Killed|Cannot allocate memory", FailureClass.HOST_OOM),
        (
            r"driver version is insufficient|CUDA driver .* too old|driver/library version mismatch",
            FailureClass.DRIVER_MISMATCH,
        ),
        (GPU_FAULT_PATTERN, FailureClass.GPU_UNAVAILABLE),
        (r"NCCL|ProcessGroupGloo|DistNetworkError|rendezvous", FailureClass.COMMUNICATION_ERROR),
        (r"No space left on device|Disk quota exceeded|Read-only file system", FailureClass.STORAGE_ERROR),
    )
)

NO_KERNEL_IMAGE_SIGNATURE = re.compile(re.escape(NO_KERNEL_IMAGE), re.IGNORECASE)
# A module the trainer imports is missing from the image, or is of another version: the exception a
# failed rank ended with. A driver library that is not there is the node's GPU runtime's fault instead.
IMPORT_FAILED = re.compile(r"\b(?:(?:ModuleNotFoundError|ImportError): |No module named ).*")
DRIVER_LIBRARY = re.compile(r"\blib(?:cuda|nvidia-[\w-]+)\.so", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class TerminationMessage:
    """``exit_code``: the trainer's own (its tag, or the root cause's in torchrun's report), None when
    neither says; ``text``: the message without the tag, for signatures; ``summary``: one line for people."""

    exit_code: int | None
    text: str
    summary: str


def read_message(message: str) -> TerminationMessage:
    """Read a container's ``terminated.message``: the trainer's tagged line or a log tail."""
    code, text = read_exit_tag(message)
    lines = text.splitlines()
    cut = code is None and len(message.encode()) >= LOG_TAIL_BYTES and len(lines) > 1
    if cut:  # a log tail the kubelet cut: its first line is a fragment ("IGTERM"), left to the signatures
        lines = lines[1:]
    report = read_report(lines)
    if report is None:
        return TerminationMessage(code, text, last_words(lines))
    before = lines[: report.start]
    while before and _torchrun_trailer(before[-1]):
        before.pop()
    cause = report.root_cause
    last = last_words(before, cause.local_rank)
    root = cause.describe()
    # When torchrun's output filled the tail, say so rather than guess.
    summary = f"{root}; {NOT_IN_TAIL}" if root and not last and cut else summarize(cause, last)
    exitcode = cause.exitcode
    if code is None and exitcode is not None and exitcode > 0:
        code = exitcode  # the rank ended with a code of its own but could not write the message
    return TerminationMessage(code, text, summary)


def gpu_runtime_failure(reason: str, message: str, *, own_image: bool) -> tuple[FailureClass, str] | None:
    """The class of a container the node's GPU runtime could not create or start (``reason``: the
    container's, such as ``StartError``), with a message that keeps the runtime's own words
    (``StartError: nvidia-container-cli: initialization error: ...``) rather than the preamble before
    them; None when the GPU runtime is not what failed. Driver files baked into the image stop the
    runtime too, on every node, and so does an image that cannot run the trainer's command: those are
    ConfigErrors, with what to change in the image the pod ran: ``spec.image`` when the job sets one
    (``own_image``), else the operator's ``--image``."""
    image = "spec.image" if own_image else "the trainer image (the operator's --image)"
    baked = IMAGE_DRIVER_FILE.search(message)
    if baked is not None:
        path = _CONTAINER_ROOT.sub("", baked[1])
        return FailureClass.CONFIG_ERROR, (
            f"{reason}: {image} holds {path}, a driver file the node's NVIDIA runtime mounts into GPU"
            " containers (nvidia-container-cli: file creation failed: file exists); build the image without"
            " NVIDIA driver files"
        )
    cannot_run = IMAGE_CANNOT_RUN.search(message)
    if cannot_run is not None:
        fix = (
            "build it from the trainer image, which has torchrun and the sftjob_trainer package,"
            if own_image
            else "set the operator's --image, or the job's spec.image, to a trainer image built"
        )
        return FailureClass.CONFIG_ERROR, (
            f"{reason}: {image} cannot run the trainer ({cannot_run[0]}); {fix} for the nodes' CPU"
            " architecture"
        )
    for pattern, cls in GPU_RUNTIME_SIGNATURES:
        match = pattern.search(message)
        if match is not None:
            line = message.rfind("\n", 0, match.start()) + 1
            cli = message.find("nvidia-container-cli", line, match.end())
            end = message.find("\n", match.end())
            return cls, f"{reason}: {message[cli if cli >= 0 else line : end if end >= 0 else None]}"
    return None


def message_class(said: TerminationMessage, *, own_image: bool) -> tuple[FailureClass, str] | None:
    """The class the words of a message without a trainer's code say, and the message to record: an image
    that cannot serve this GPU or the job (:func:`image_fault`), else the first of
    :data:`MESSAGE_SIGNATURES`; None when they say nothing known."""
    image = image_fault(said, own_image=own_image)
    if image is not None:
        return FailureClass.CONFIG_ERROR, image
    return next(
        ((cls, said.summary) for pattern, cls in MESSAGE_SIGNATURES if pattern.search(said.text)), None
    )


def image_fault(said: TerminationMessage, *, own_image: bool) -> str | None:
    """A ConfigError's message when the trainer's image cannot run on this GPU (no kernels for its
    architecture) or lacks a module the trainer imports; None otherwise. A failed import is the image's
    fault only in the job's own image (``own_image``: it sets ``spec.image``); in the operator's it is a bug
    to report, and the attempt stays Unknown."""
    kernels = NO_KERNEL_IMAGE_SIGNATURE.search(said.text)
    if kernels is not None:
        if own_image:
            return (
                f"spec.image has no CUDA kernels for this GPU's architecture ({kernels[0]}): build its"
                " PyTorch and CUDA extensions for the nodes' GPUs (TORCH_CUDA_ARCH_LIST)"
            )
        return (
            f"the trainer image has no CUDA kernels for this GPU's architecture ({kernels[0]}): set"
            " spec.image to a build whose PyTorch and CUDA extensions cover the nodes' GPUs"
            " (TORCH_CUDA_ARCH_LIST)"
        )
    failed = IMPORT_FAILED.search(said.summary)
    if own_image and failed is not None and DRIVER_LIBRARY.search(failed[0]) is None:
        return (
            f"spec.image cannot import what the trainer needs ({failed[0]}): build it from the trainer image,"
            " or install the trainer's Python dependencies in it"
        )
    return None


def _torchrun_trailer(line: str) -> bool:
    """A line of what torchrun prints after a rank fails: its log lines and its own traceback."""
    stripped = line.strip()
    return (
        not stripped
        or line[0].isspace()  # the traceback's File and source lines
        or stripped == "Traceback (most recent call last):"
        or "ChildFailedError" in stripped
        or _TORCHRUN_LOG.search(stripped) is not None
        or RULE.match(stripped) is not None
    )
