"""Turning whatever ended the trainer into an exit code and a one-line reason for the operator.

The operator classifies an ended attempt from the container's exit code and its termination message
(``/dev/termination-log``), so every way out of the trainer goes through :func:`classify` and
:func:`write_termination_message`. The table of codes itself is the shared contract in
:mod:`sftjob.failures`. Under torchrun, the container's PID 1, the container exits 1 whatever code a
rank ended with, so a failure's message starts with its code (``[exit 15] CUDA out of memory: ...``)
and that is where the operator reads it. Every rank of the pod shares the one file: when one rank
fails (say CUDA out of memory) its peers fail next on the broken connection, and their echo must not
replace the cause. A CUDA OOM outside the forward and backward passes says where it happened
(``CUDA out of memory while loading the model from ...``): the operator's OOM ladder lowers only the memory
of those passes, and skips it then.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import ValidationError

from sftjob.constants import TERMINATION_LOG
from sftjob.failures import (
    CUDA_OOM_PATTERN,
    CUDA_OOM_REASON,
    GPU_FAULT_PATTERN,
    NO_KERNEL_IMAGE,
    ExitCode,
    OomPhase,
    TrainerError,
    tag_exit_code,
)

log = logging.getLogger(__name__)
# What a rank logs as it ends with a message of its own (the launcher reads it: sftjob_trainer.launch).
EXITING = "exiting with"

TERMINATION_LOG_ENV = "SFTJOB_TERMINATION_LOG"
# The kubelet keeps the last 4096 bytes of the file: 1000 characters are at most 4000 bytes of UTF-8, so
# the whole line, exit-code tag first, always arrives.
_MAX_REASON_CHARS = 1000

# The operator reads the same words (sftjob.failures.CUDA_OOM_PATTERN); checked before the NCCL words, which
# an OOM inside NCCL also carries.
_CUDA_OOM = re.compile(CUDA_OOM_PATTERN, re.I)
# The trainer's own functions that run outside the forward and backward passes and allocate memory the size
# of the model, by module and name, with what the OOM message then says (OomPhase): the outermost one on the
# stack names the phase (restoring a checkpoint steps the optimizer once to create its state, as loading).
# Renaming one of these functions must rename it here (tests/trainer/test_exit_codes.py checks they exist).
OOM_PHASES: dict[tuple[str, str], str] = {
    ("model", "load_model"): f"{OomPhase.LOADING} the model",
    ("model", "build_model"): f"{OomPhase.LOADING} the model",
    ("model", "prepare_for_training"): f"{OomPhase.LOADING} the model",
    ("distributed", "wrap_model"): f"{OomPhase.LOADING} the model",
    ("resume", "restore"): f"{OomPhase.LOADING} the weights to start from",
    ("loop", "_update"): OomPhase.OPTIMIZER_STEP.value,
    ("checkpoints", "save"): f"{OomPhase.SAVING} a checkpoint",
    ("output", "write_model"): f"{OomPhase.SAVING} the output",
}
_COMMUNICATION_PATTERNS = (
    "NCCL",
    "ProcessGroup",
    "c10d",
    "Connection reset by peer",
    "Connection closed by peer",  # gloo, when a peer rank exited
    "Connection refused",
    "Socket Timeout",
    "collective operation timeout",
    "Watchdog caught collective operation timeout",
)
# A GPU that is gone, or whose memory, NVLinks or NVSwitch fabric failed (Xid errors; CUDA error 802 "system
# not yet initialized": nvidia-fabricmanager is not running): the node's fault, even when NCCL reports it.
# The operator reads the same words (sftjob.failures.GPU_FAULT_PATTERN).
_GPU_FAULT = re.compile(GPU_FAULT_PATTERN, re.I)
_CUDA_ERROR = "CUDA error"
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO, errno.ESTALE})
# How a library written in Rust (safetensors' SafetensorError) quotes the OS error under its own: Rust's
# io::Error as displayed ("No space left on device (os error 28)") or debug-printed ("Os { code: 28, ...").
_QUOTED_OS_ERROR = re.compile(r"\(os error (\d+)\)|\bOs \{ code: (\d+)")
# Permission denied: a folder's owner and mode, which no restart changes (a CONFIG_ERROR).
_PERMISSION_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
# Exceptions (top-level package.class, anywhere in the class's MRO) that mean the connection to the hub
# failed on the way: builtins covers socket errors (ECONNRESET, ETIMEDOUT...), requests is what datasets
# uses, httpx2 (httpx before huggingface_hub 2) what huggingface_hub uses, aiohttp what fsspec uses.
_NETWORK_ERRORS = frozenset(
    {
        "builtins.ConnectionError",
        "builtins.TimeoutError",
        "requests.ConnectionError",
        "requests.Timeout",
        "requests.ChunkedEncodingError",
        # Not httpx's whole TransportError: UnsupportedProtocol (HF_ENDPOINT without https://) and
        # LocalProtocolError (a token with a newline in its header) are configuration, not the network.
        "httpx.NetworkError",
        "httpx.TimeoutException",
        "httpx.RemoteProtocolError",
        "httpx.ProxyError",
        "httpx2.NetworkError",
        "httpx2.TimeoutException",
        "httpx2.RemoteProtocolError",
        "httpx2.ProxyError",
        "aiohttp.ClientConnectionError",
        "aiohttp.ClientPayloadError",
    }
)
# HTTP answers that mean "not now" rather than "no": request timeout, rate limit (and every 5xx).
_RETRYABLE_HTTP_STATUS = frozenset({408, 429})
# What peft raises when the target modules name no module of the model (a typo: qproj), or only modules
# LoRA cannot wrap (a norm, a whole decoder layer).
_ADAPTER_TARGET_ERRORS = re.compile(r"Target modules? .*(not found in the base model|is not supported)", re.S)
# What peft raises when the target modules name a mixture's experts or router (gate_proj, up_proj, down_proj
# or gate in Qwen3-MoE and OLMoE, w1, w2, w3 in Mixtral; a shared expert's linears of those names in DeepSeek
# and GLM mixtures too, even from all-linear), which transformers 5 fuses into 3-D tensors that peft adapts as
# whole parameters (its ParamWrapper): never with dropout, and gate and up only together.
_EXPERT_TARGET_ERRORS = re.compile(r"ParamWrapper does not work with lora_dropout|Cannot convert PEFT target")
# What transformers raises when a model's own code (trust_remote_code) imports packages the image lacks
# (dynamic_module_utils.check_imports: einops, tiktoken, flash_attn...), and what datasets raises when a hub
# dataset needs an optional one (Pillow for images, zstandard for .zst files): the same on every restart.
_MISSING_PACKAGES = re.compile(
    r"requires the following packages that were not found in your environment: (?P<model>[^.]+)\."
    r"|[Pp]lease install '(?P<feature>[\w.-]+)'|Please pip install (?P<archive>[\w.-]+)"
)


def one_line(text: str) -> str:
    """Collapse whitespace so the reason is one line, and keep it short; a hub token quoted in an error
    (``Bearer hf_...``) is blanked out, as the reason ends up in the pod's and the job's status."""
    line = re.sub(r"\s+", " ", text).strip()
    line = re.sub(r"(Bearer\s+)[^\s'\"]+|\bhf_[A-Za-z0-9]{8,}", lambda m: f"{m[1] or ''}<redacted>", line)
    return line[: _MAX_REASON_CHARS - 3] + "..." if len(line) > _MAX_REASON_CHARS else line


def classify(exc: BaseException) -> tuple[ExitCode, str]:
    """Map an exception to the exit code the operator expects and a one-line reason."""
    if isinstance(exc, TrainerError):
        return exc.code, one_line(exc.reason)
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ValidationError):
        return ExitCode.CONFIG_ERROR, one_line(f"invalid trainer configuration: {exc}")
    if _is_oom(exc):
        phase = _oom_phase(exc)
        return ExitCode.CUDA_OOM, one_line(f"{CUDA_OOM_REASON}{f' {phase}' if phase else ''}: {exc}")
    if isinstance(exc, RuntimeError) and _GPU_FAULT.search(str(exc)):
        return ExitCode.GPU_UNAVAILABLE, one_line(f"GPU fault: {message}")
    if isinstance(exc, RuntimeError) and NO_KERNEL_IMAGE in str(exc):
        return ExitCode.CONFIG_ERROR, one_line(
            f"the trainer image has no CUDA kernels for this GPU's architecture ({message}): set spec.image"
            " to a build whose PyTorch and CUDA extensions cover the nodes' GPUs (TORCH_CUDA_ARCH_LIST)"
        )
    if _is_communication(exc):
        return ExitCode.COMMUNICATION_ERROR, one_line(f"communication error between ranks: {message}")
    error = os_error(exc)
    if error is not None and error.errno in _PERMISSION_ERRNOS:
        return ExitCode.CONFIG_ERROR, one_line(f"permission denied: {message} ({permission_advice(error)})")
    if error is not None and error.errno in _STORAGE_ERRNOS:
        return ExitCode.STORAGE_ERROR, one_line(f"storage error: {message}")
    return ExitCode.UNKNOWN, one_line(f"unexpected error: {message}")


def storage_failure(exc: OSError, doing: str, folder: str | Path | None = None) -> TrainerError:
    """The error to end with when ``doing`` ("could not save checkpoint /checkpoints/checkpoint-4") failed
    with ``exc``: CONFIG_ERROR when the trainer's user may not write or read there (:func:`permission_advice`
    says whose the folder is, ``folder`` when the error names no path, and what to do), else STORAGE_ERROR
    (a full, read-only or failing disk: the restart tries again)."""
    if exc.errno in _PERMISSION_ERRNOS:
        return TrainerError(ExitCode.CONFIG_ERROR, f"{doing}: {exc} ({permission_advice(exc, folder)})")
    return TrainerError(ExitCode.STORAGE_ERROR, f"{doing}: {exc}")


def oom_among(errors: Iterable[BaseException], where: str) -> TrainerError | None:
    """The CUDA OOM to end with when one of ``errors`` (every rank's, as torch.distributed.checkpoint's
    CheckpointException gathers them) is one, ``where`` ("while saving a checkpoint") naming the phase
    (:class:`sftjob.failures.OomPhase`) for the operator to read; None when none is."""
    oom = next((error for error in errors if _is_oom(error)), None)
    if oom is None:
        return None
    return TrainerError(ExitCode.CUDA_OOM, f"{CUDA_OOM_REASON} {where}: {type(oom).__name__}: {oom}")


def os_error(exc: BaseException) -> OSError | None:
    """``exc`` if it is an OSError; the OS error another exception quotes (safetensors raises its own
    ``SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)`` for a
    full disk); else None."""
    if isinstance(exc, OSError):
        return exc
    quoted = _QUOTED_OS_ERROR.search(str(exc))
    if quoted is None:
        return None
    code = int(quoted[1] or quoted[2])
    return OSError(code, str(exc))


def permission_denied(exc: BaseException) -> OSError | None:
    """The permission error (EACCES, EPERM) anywhere in ``exc``'s chain of causes, or None."""
    return next((c for c in causes(exc) if isinstance(c, OSError) and c.errno in _PERMISSION_ERRNOS), None)


def permission_advice(exc: OSError | None, folder: str | Path | None = None) -> str:
    """Whose the path of ``exc`` (else ``folder``) is, whom the trainer runs as, and how to give it the
    folder. The operator runs the trainer as uid 1000 with fsGroup 1000, which the kubelet applies to most
    claims but not to ``nfs`` or ``hostPath`` volumes (docs/install.md)."""
    uid, gid = os.getuid(), os.getgid()
    owner = _owner(exc.filename if exc is not None and exc.filename is not None else folder)
    return (
        f"{owner}the trainer runs as uid {uid}, gid {gid}: make the folder writable by uid"
        f" {uid} or gid {gid}, e.g. chown -R {uid}:{gid} it on the nfs server or the node of a hostPath"
        " volume, or, for a volume that ignores the pod's fsGroup, once from a pod that runs as root"
    )


def _owner(filename: object) -> str:
    """``filename``'s (or the nearest folder above it that exists) owner and mode; "" when unknown."""
    if not isinstance(filename, str | bytes | Path):
        return ""
    path = Path(os.fsdecode(filename))
    with contextlib.suppress(OSError):
        while not path.exists() and path != path.parent:
            path = path.parent
        info = path.stat()
        return (
            f"{path} belongs to uid {info.st_uid}, gid {info.st_gid}, mode {stat.S_IMODE(info.st_mode):03o}; "
        )
    return ""


def load_failure(exc: BaseException, what: str) -> TrainerError | None:
    """The error to end with when loading ``what`` failed for a reason other than the source, wherever it
    sits in the chain of exceptions libraries wrap it in: the network or the hub on the way (NETWORK_ERROR),
    a full or failing disk (STORAGE_ERROR), CUDA OOM, a faulty GPU (GPU_UNAVAILABLE), an image without
    kernels for it or without the packages the model's code or the dataset needs (CONFIG_ERROR); any other
    CUDA error, or a module the image cannot import, is UNKNOWN (the operator reads the words: a job's own
    spec.image that cannot import is its ConfigError). None when the source itself is at fault (not found,
    gated, malformed): the caller ends with its permanent error."""
    for cause in causes(exc):
        missing = _MISSING_PACKAGES.search(str(cause)) if isinstance(cause, ImportError) else None
        if missing is not None:
            packages = next(group for group in missing.groups() if group)
            return TrainerError(
                ExitCode.CONFIG_ERROR,
                f"{what} needs the Python packages {packages}, which the trainer image lacks: set"
                f" spec.image to an image that has them ({type(cause).__name__}: {cause})",
            )
        if is_network_error(cause):
            detail = f"{exc}" if cause is exc else f"{exc} ({type(cause).__name__}: {cause})"
            return TrainerError(
                ExitCode.NETWORK_ERROR, f"hub or network unavailable while loading {what}: {detail}"
            )
        code, reason = classify(cause)
        if (
            code == ExitCode.CUDA_OOM
        ):  # the phase first, where the operator reads it (sftjob.failures.oom_phase)
            return TrainerError(code, f"{CUDA_OOM_REASON} {OomPhase.LOADING} {what}: {cause}")
        if code in (ExitCode.STORAGE_ERROR, ExitCode.GPU_UNAVAILABLE) or (
            code == ExitCode.CONFIG_ERROR and NO_KERNEL_IMAGE in str(cause)
        ):
            return TrainerError(code, f"{reason} (loading {what})")
        if isinstance(cause, ImportError) or _CUDA_ERROR in str(cause):
            return TrainerError(
                ExitCode.UNKNOWN, f"unexpected error: {type(cause).__name__}: {cause} (loading {what})"
            )
    return None


def adapter_target_error(exc: ValueError, targets: object) -> TrainerError | None:
    """The error to end with when peft cannot place the adapters where ``lora.targetModules`` says: the
    spec is wrong and a restart cannot fix it. None for any other ValueError."""
    if _ADAPTER_TARGET_ERRORS.search(str(exc)) is not None:
        problem = (
            "names no layer of the model that LoRA can wrap (use the model's projection names, e.g. q_proj"
            " and v_proj, or all-linear)"
        )
    elif _EXPERT_TARGET_ERRORS.search(str(exc)) is not None:
        problem = (
            "reaches the experts or the router of this mixture-of-experts model, fused tensors that peft"
            " adapts only whole and without dropout, and that the planner does not count (name its attention"
            " projections: q_proj, k_proj, v_proj and o_proj)"
        )
    else:
        return None
    return TrainerError(ExitCode.CONFIG_ERROR, f"spec.lora.targetModules {targets} {problem}: {exc}")


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling, down to the root cause."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def is_network_error(exc: BaseException) -> bool:
    """A connection that failed or timed out, or an HTTP answer worth retrying (408, 429, 5xx)."""
    names = {f"{cls.__module__.partition('.')[0]}.{cls.__name__}" for cls in type(exc).__mro__}
    if "huggingface_hub.OfflineModeIsEnabled" in names:  # a ConnectionError, but HF_HUB_OFFLINE is a setting
        return False
    if names & _NETWORK_ERRORS:
        return True
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return isinstance(status, int) and (status in _RETRYABLE_HTTP_STATUS or status >= 500)


def _oom_phase(exc: BaseException) -> str | None:
    """Where outside the forward and backward passes ``exc`` (a CUDA OOM) was raised, as its message says it
    (``while loading the model``, ``in the optimizer step``, ``while saving a checkpoint``), read from the
    trainer's functions on its traceback; None in the forward or backward pass, or anywhere else."""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = Path(frame.filename)
        if path.parent.name == __package__:
            phase = OOM_PHASES.get((path.stem, frame.name))
            if phase is not None:
                return phase
    return None


def _is_oom(exc: BaseException) -> bool:
    name = type(exc).__name__
    if name == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError / torch.OutOfMemoryError
        return True
    return isinstance(exc, RuntimeError) and _CUDA_OOM.search(str(exc)) is not None


def _is_communication(exc: BaseException) -> bool:
    name = type(exc).__name__
    if name in {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError"}:
        return True
    return isinstance(exc, RuntimeError | TimeoutError | ConnectionError) and any(
        p in str(exc) for p in _COMMUNICATION_PATTERNS
    )


def exit_with(exc: BaseException, started: float, *, several_ranks: bool, sigterm: bool) -> ExitCode:
    """The end of an attempt that raised ``exc``: logged, its termination message written, its code
    returned. A peer rank's failure breaks the collectives of the others (COMMUNICATION_ERROR), and
    torchrun SIGTERMs them (PREEMPTED, with ``sigterm``): among ``several_ranks`` such an echo keeps the
    message another rank wrote since the attempt ``started`` (a ``time.time()``), the cause."""
    code, reason = classify(exc)
    if code in (ExitCode.UNKNOWN, ExitCode.COMMUNICATION_ERROR):
        log.error("trainer failed", exc_info=exc)
    log.error("%s %s (%d): %s", EXITING, code.name, code, reason)
    echo = code == ExitCode.COMMUNICATION_ERROR or (code == ExitCode.PREEMPTED and sigterm)
    write_termination_message(reason, code, unless_written_since=started if several_ranks and echo else None)
    return code


def termination_log_path() -> str:
    return os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG)


def write_termination_message(
    reason: str, code: ExitCode = ExitCode.OK, unless_written_since: float | None = None
) -> None:
    """Write the one-line reason where Kubernetes reads it, a failure's tagged with the exit ``code`` the
    trainer is about to end with; never raise (we are already exiting).

    With ``unless_written_since`` (a ``time.time()``) a message another process wrote since then is
    kept: a rank failing only because a peer failed first leaves the peer's reason in place.
    """
    path = termination_log_path()
    line = one_line(reason) if code == ExitCode.OK else tag_exit_code(code, one_line(reason))
    try:
        if unless_written_since is not None and _written_since(path, unless_written_since):
            log.info("keeping the termination message another rank wrote: %s", line)
            return
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(line + "\n")
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", path, exc)


def _written_since(path: str, since: float) -> bool:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return False
    return status.st_size > 0 and status.st_mtime >= since
