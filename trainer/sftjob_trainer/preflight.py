"""Cheap checks before any heavy work, each failing with its own exit code and a one-line reason.

The seed guide's common failures (driver too old or mismatched with CUDA, GPU not detected, model
files broken, storage not writable) are caught here in seconds instead of minutes into model loading.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from sftjob.config import GpuExpectation, ModelSource, TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.failures import classify, one_line, storage_failure

log = logging.getLogger(__name__)

GIB = 1024**3
# CUDA's own words for a driver that cannot serve this CUDA runtime (errors 35, 803, 804; PyTorch's "driver on
# your system is too old"); any other failure to start CUDA is the GPU's or the node's.
_DRIVER_MISMATCH = re.compile(
    r"too old|insufficient|unsupported display driver|forward compatibility|version mismatch", re.I
)
# CUDA error 802: an NVSwitch board (A800/H800 SXM) whose fabric manager is not running; NVML still works.
_FABRIC_DOWN = re.compile(r"system not yet initiali[sz]ed|\bError 802\b", re.I)


@dataclass(frozen=True)
class DriverInfo:
    version: str  # e.g. "535.54.03"
    cuda: tuple[int, int] | None  # newest CUDA version the driver supports, e.g. (12, 2)


def run_preflight(config: TrainerConfig) -> None:
    """The storage and model-file checks in order; the first failure raises :class:`TrainerError`. The GPU
    checks (:func:`check_gpu`) ran already, before the ranks met (``distributed.init_distributed``)."""
    check_writable(config.checkpoints.dir, "checkpoint directory (checkpoints.dir)")
    check_writable(config.output_dir, "output directory (output_dir)")
    check_model_files(config.model)
    log.info("preflight: all checks passed")


def check_writable(path: str, what: str) -> None:
    """A file can be created and synced in ``path``: else STORAGE_ERROR, or CONFIG_ERROR when the trainer's
    user may not write there (``failures.storage_failure`` says whose the folder is and what to do)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight-") as fh:
            fh.write(b"ok")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise storage_failure(exc, f"{what} {path} is not writable", path) from exc


# --- model files ---------------------------------------------------------------------------------


def check_model_files(source: ModelSource) -> None:
    if source.path is None:
        hf_home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
        check_writable(hf_home, "Hugging Face cache (HF_HOME)")
        return
    folder = Path(source.path)
    if not (folder / "config.json").is_file():
        if (folder / "adapter_config.json").is_file():
            raise TrainerError(
                ExitCode.MODEL_LOAD_ERROR,
                f"model.path {folder} holds a LoRA adapter (adapter_config.json), not a model: merge it into"
                " its base and point model.path at the merged model (docs/output.md shows how; a job with"
                " output.mergeAdapter leaves one in its output's merged folder)",
            )
        raise TrainerError(ExitCode.MODEL_LOAD_ERROR, f"model.path {folder} has no config.json")
    index = folder / "model.safetensors.index.json"
    bin_index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        for shard in _shards(index):
            check_safetensors_file(folder / shard)
    elif (folder / "model.safetensors").is_file():
        check_safetensors_file(folder / "model.safetensors")
    elif bin_index.is_file():  # older sharded checkpoints: pytorch_model-00001-of-00002.bin...
        for shard in _shards(bin_index):
            path = folder / shard
            if not path.is_file() or path.stat().st_size == 0:
                raise TrainerError(ExitCode.MODEL_LOAD_ERROR, f"model shard {path} is missing or empty")
    elif not (folder / "pytorch_model.bin").is_file():
        raise TrainerError(
            ExitCode.MODEL_LOAD_ERROR,
            f"model.path {folder} has no weights (model.safetensors, pytorch_model.bin, or the index of"
            " either's shards)",
        )


def _shards(index: Path) -> list[str]:
    """The shard files a weights index (``*.index.json``) names."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TrainerError(ExitCode.MODEL_LOAD_ERROR, f"model index {index} is unreadable: {exc}") from exc


def check_safetensors_file(path: Path) -> None:
    """The header must parse and the file must be long enough for every tensor it lists."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size:
                raise ValueError("header length exceeds the file size")
            header = json.loads(fh.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise TrainerError(
            ExitCode.MODEL_LOAD_ERROR, f"model shard {path} is missing or unreadable: {exc}"
        ) from exc
    if size < 8 + header_len + end:
        raise TrainerError(
            ExitCode.MODEL_LOAD_ERROR,
            f"model shard {path} is truncated: {size} bytes, header says {8 + header_len + end}",
        )


# --- GPU and driver ------------------------------------------------------------------------------


def check_cuda_starts(expect: GpuExpectation) -> DriverInfo | None:
    """CUDA starts in this container, with a driver that serves the image's PyTorch; returns the driver
    (None when neither NVML nor nvidia-smi reads it). Else CONFIG_ERROR (a CPU-only PyTorch),
    DRIVER_MISMATCH, or GPU_UNAVAILABLE (the node's GPU or its driver, :func:`cuda_start_failure`)."""
    if torch.version.cuda is None:  # a CPU-only build: no node's driver can help, whatever it is
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"the image's PyTorch {torch.__version__} has no CUDA support (a CPU-only build): set spec.image"
            " to an image with a CUDA build of PyTorch",
        )
    driver = read_driver_info()
    if driver is None and not torch.cuda.is_available():
        raise TrainerError(ExitCode.GPU_UNAVAILABLE, "no NVIDIA GPU or driver is visible in the container")
    if driver is not None:
        check_driver(driver, expect.min_driver, torch.version.cuda)
    if not torch.cuda.is_available():
        raise cuda_start_failure(driver.version if driver else "?", _cuda_init_error())
    return driver


def check_gpu(expect: GpuExpectation, local_rank: int, local_world_size: int) -> None:
    """CUDA starts (:func:`check_cuda_starts`), the node shows the plan's GPUs, this rank's runs a kernel
    and has ``expect.memory_gib`` free; else GPU_UNAVAILABLE (or the class of the first kernel's error)."""
    driver = check_cuda_starts(expect)
    count = torch.cuda.device_count()
    if count < local_world_size:
        raise TrainerError(
            ExitCode.GPU_UNAVAILABLE,
            f"{count} GPU(s) visible, the plan needs {local_world_size} on this node",
        )
    name = torch.cuda.get_device_name(local_rank)
    check_first_kernel(local_rank, name)
    free, total = torch.cuda.mem_get_info(local_rank)
    if expect.memory_gib is not None and free / GIB < expect.memory_gib:
        raise TrainerError(
            ExitCode.GPU_UNAVAILABLE,
            f"GPU {local_rank} ({name}) has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB,"
            f" the plan needs {expect.memory_gib:.1f} GiB",
        )
    log.info(
        "preflight: %d x %s, %.1f GiB free on GPU %d, driver %s, CUDA runtime %s",
        count,
        name,
        free / GIB,
        local_rank,
        driver.version if driver else "?",
        torch.version.cuda,
    )


def cuda_start_failure(driver_version: str, error: str) -> TrainerError:
    """Why CUDA does not start with driver ``driver_version`` present (``error``: CUDA's or PyTorch's
    words). Preflight has checked already that the driver supports the runtime's CUDA major version, so
    only CUDA saying so makes it DRIVER_MISMATCH; otherwise the GPU or the node is at fault."""
    said = f"driver {driver_version} is present but CUDA {torch.version.cuda} does not start: {error}"
    if _DRIVER_MISMATCH.search(error):
        return TrainerError(ExitCode.DRIVER_MISMATCH, said)
    if _FABRIC_DOWN.search(error):
        said += (
            f"; on an NVSwitch board (A800/H800 SXM) nvidia-fabricmanager, of the driver's version"
            f" {driver_version}, must run on the node"
        )
    return TrainerError(ExitCode.GPU_UNAVAILABLE, said)


def _cuda_init_error() -> str:
    """The error PyTorch's CUDA initialisation ends with (``torch.cuda.is_available`` only warns it)."""
    try:
        torch.cuda.init()
    except Exception as exc:
        return one_line(f"{type(exc).__name__}: {exc}")
    return "PyTorch sees no CUDA device"


def check_first_kernel(local_rank: int, name: str) -> None:
    """One tiny kernel on the GPU: an image built without this GPU's architecture (CONFIG_ERROR) or a
    faulty GPU fails here in a second, not after the model's load."""
    try:
        torch.ones(1, device=torch.device("cuda", local_rank)).add_(1).item()
    except RuntimeError as exc:
        code, reason = classify(exc)
        code = ExitCode.GPU_UNAVAILABLE if code == ExitCode.UNKNOWN else code
        raise TrainerError(code, f"GPU {local_rank} ({name}) fails its first kernel: {reason}") from exc


def check_driver(driver: DriverInfo, min_driver: str, runtime_cuda: str | None) -> None:
    if min_driver and version_tuple(driver.version) < version_tuple(min_driver):
        raise TrainerError(
            ExitCode.DRIVER_MISMATCH, f"NVIDIA driver {driver.version} is older than the minimum {min_driver}"
        )
    if runtime_cuda is None or driver.cuda is None:
        return
    runtime = tuple(version_tuple(runtime_cuda)[:2])
    if driver.cuda[0] < runtime[0]:
        raise TrainerError(
            ExitCode.DRIVER_MISMATCH,
            f"NVIDIA driver {driver.version} supports CUDA up to {driver.cuda[0]}.{driver.cuda[1]},"
            f" PyTorch was built for CUDA {runtime_cuda}: update the driver or use a matching image",
        )
    if driver.cuda < runtime:
        log.warning(
            "driver %s supports CUDA %d.%d < runtime %s: relying on CUDA minor-version compatibility",
            driver.version,
            *driver.cuda,
            runtime_cuda,
        )


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.strip().split(".") if part.isdigit())


def read_driver_info() -> DriverInfo | None:
    """Driver version and its CUDA version from NVML (via ctypes), else nvidia-smi; None if neither."""
    return _nvml_driver_info() or _nvidia_smi_driver_info()


def _nvml_driver_info() -> DriverInfo | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) != 0:
            return None
        cuda = ctypes.c_int(0)
        ok = nvml.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0
        return DriverInfo(buf.value.decode(), (cuda.value // 1000, cuda.value % 1000 // 10) if ok else None)
    finally:
        nvml.nvmlShutdown()


def _nvidia_smi_driver_info() -> DriverInfo | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return DriverInfo(lines[0].strip(), None) if lines else None
