"""Every way the trainer fails ends with its documented exit code and a one-line reason."""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn, cast

import pytest
import torch

from sftjob.config import GpuExpectation, ModelSource
from sftjob.failures import ExitCode, OomPhase, TrainerError, oom_phase
from sftjob_trainer import loop, preflight
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.failures import OOM_PHASES, classify, load_failure
from sftjob_trainer.preflight import DriverInfo, check_driver, check_gpu, check_model_files
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer


def _rewrite(config: Path, **changes: object) -> Path:
    data = json.loads(config.read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    config.write_text(json.dumps(data))
    return config


def _reason(termination_log: Path) -> str:
    text = termination_log.read_text()
    assert text.count("\n") == 1, text
    return text.strip()


def test_a_bad_model_path_exits_model_load_error(
    trainer_config: MakeConfig, tmp_path: Path, termination_log: Path
) -> None:
    config = _rewrite(trainer_config(), model__path=str(tmp_path / "no-such-model"))
    assert run(str(config)) == ExitCode.MODEL_LOAD_ERROR
    assert "no-such-model" in _reason(termination_log)


def test_a_truncated_model_shard_exits_model_load_error(
    trainer_config: MakeConfig, tiny_model: Path, tmp_path: Path, termination_log: Path
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for file in tiny_model.iterdir():
        data = file.read_bytes()
        (broken / file.name).write_bytes(data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    config = _rewrite(trainer_config(), model__path=str(broken))
    assert run(str(config)) == ExitCode.MODEL_LOAD_ERROR
    assert "truncated" in _reason(termination_log)


def test_a_model_sharded_into_pytorch_bin_files_passes_preflight_unless_a_shard_is_missing_or_empty(
    tmp_path: Path,
) -> None:
    shards = [f"pytorch_model-0000{n}-of-00002.bin" for n in (1, 2)]
    (tmp_path / "config.json").write_text("{}")
    index = {"weight_map": {"embed.weight": shards[0], "head.weight": shards[1]}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    for shard in shards:
        (tmp_path / shard).write_bytes(b"weights")
    check_model_files(ModelSource(path=str(tmp_path)))

    (tmp_path / shards[1]).write_bytes(b"")  # a copy cut off
    with pytest.raises(TrainerError, match=r"00002-of-00002\.bin is missing or empty") as refused:
        check_model_files(ModelSource(path=str(tmp_path)))
    assert refused.value.code == ExitCode.MODEL_LOAD_ERROR


def test_an_empty_dataset_exits_data_error(trainer_config: MakeConfig, termination_log: Path) -> None:
    config = trainer_config()
    Path(json.loads(config.read_text())["dataset"]["path"]).write_text("")
    assert run(str(config)) == ExitCode.DATA_ERROR
    assert "empty" in _reason(termination_log)


def test_malformed_rows_past_the_threshold_exit_data_error(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config("alpaca", rows=40)
    data = Path(json.loads(config.read_text())["dataset"]["path"])
    lines = data.read_text().splitlines()
    lines[3] = "{not json"
    lines[7] = json.dumps({"instruction": "no output here"})
    data.write_text("\n".join(lines) + "\n")
    _rewrite(config, dataset__maxBadRowFraction=0.02)
    assert run(str(config)) == ExitCode.DATA_ERROR
    reason = _reason(termination_log)
    assert "2 of 40 rows" in reason and "maxBadRowFraction" in reason

    _rewrite(config, dataset__maxBadRowFraction=0.1, training__maxSteps=1)
    assert run(str(config)) == ExitCode.OK  # under the threshold they are skipped


def test_an_unwritable_checkpoint_dir_exits_storage_error(
    trainer_config: MakeConfig, tmp_path: Path, termination_log: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    config = _rewrite(trainer_config(), checkpoints__dir=str(blocker / "checkpoints"))
    assert run(str(config)) == ExitCode.STORAGE_ERROR
    assert "checkpoint directory" in _reason(termination_log)


def test_an_invalid_config_exits_config_error(tmp_path: Path, termination_log: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {"path": "/m"}, "dataset": {"path": "/d"}, "method": "dpo"}))
    assert run(str(config)) == ExitCode.CONFIG_ERROR
    assert "method" in _reason(termination_log)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), ExitCode.CUDA_OOM),
        (torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be"), ExitCode.CUDA_OOM),
        *[
            (
                # NCCL's "Last error" after an allocation failed (its last WARN: NVIDIA/nccl src/debug.cc):
                # CUCHECK's WARN("Cuda failure %d '%s'", err, errStr) (src/include/cudawrap.h: cuMemCreate),
                # CUDACHECK's WARN("Cuda failure '%s'", ...) (src/include/checks.h: cudaMalloc), then
                # ncclCudaCalloc's WARN("Failed to CUDA calloc %ld bytes", ...) (src/include/alloc.h).
                torch.distributed.DistBackendError(
                    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda"
                    " error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
                    f"ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n{last}"
                ),
                ExitCode.CUDA_OOM,  # not the communication error its NCCL wording suggests
            )
            for last in (
                "Cuda failure 2 'out of memory'",
                "Cuda failure 'out of memory'",
                "Failed to CUDA calloc 6291456 bytes",
                "Failed to CUDA malloc 2097152 bytes",
            )
        ],
        (
            RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"),
            ExitCode.COMMUNICATION_ERROR,
        ),
        (OSError(28, "No space left on device"), ExitCode.STORAGE_ERROR),
        (torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"), ExitCode.GPU_UNAVAILABLE),
        (
            torch.distributed.DistBackendError(
                "NCCL error: unhandled cuda error; Last error: Cuda failure 'uncorrectable NVLink error was"
                " detected during the execution'"
            ),
            ExitCode.GPU_UNAVAILABLE,  # the GPU's links failed, not the network
        ),
        (
            torch.AcceleratorError("CUDA error: no kernel image is available for execution on the device"),
            ExitCode.CONFIG_ERROR,  # the image was built without this GPU's architecture
        ),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), ExitCode.UNKNOWN),
        (ModuleNotFoundError("No module named 'peft'"), ExitCode.UNKNOWN),  # the operator knows whose image
        (TrainerError(ExitCode.DATA_ERROR, "bad\ndata"), ExitCode.DATA_ERROR),
        (KeyError("surprise"), ExitCode.UNKNOWN),
    ],
)
def test_exceptions_map_to_their_exit_codes_with_one_line_reasons(exc: BaseException, code: ExitCode) -> None:
    got, reason = classify(exc)
    assert got == code
    assert "\n" not in reason


def _raised(run: Callable[[], object]) -> BaseException:
    """The exception ``run`` raised, with its traceback."""
    with pytest.raises(BaseException) as raised:
        run()
    return raised.value


def _out_of_memory(*args: object, **kwargs: object) -> NoReturn:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB")


def test_an_oom_in_the_optimizer_step_says_so_where_the_operator_reads_it() -> None:
    optimizer = SimpleNamespace(step=_out_of_memory)
    parts = cast(Trainables, SimpleNamespace(optimizer=optimizer, scaler=None))
    code, reason = classify(_raised(lambda: loop._update(parts, 1.0, 1.0)))
    assert code == ExitCode.CUDA_OOM
    assert reason.startswith("CUDA out of memory in the optimizer step: CUDA out of memory. Tried")
    assert oom_phase(reason) is OomPhase.OPTIMIZER_STEP


def test_an_oom_while_loading_the_model_says_so_first_where_the_operator_reads_it() -> None:
    failure = load_failure(_raised(_out_of_memory), "the model from org/model")
    assert failure is not None and failure.code == ExitCode.CUDA_OOM
    assert failure.reason.startswith("CUDA out of memory while loading the model from org/model: CUDA out of")
    assert oom_phase(failure.reason) is OomPhase.LOADING


def test_an_oom_in_the_forward_or_backward_pass_names_no_phase() -> None:
    code, reason = classify(_raised(_out_of_memory))
    assert (code, oom_phase(reason)) == (ExitCode.CUDA_OOM, None)
    assert reason.startswith("CUDA out of memory: CUDA out of memory. Tried")


@pytest.mark.parametrize(("module", "function"), sorted(OOM_PHASES))
def test_every_function_an_oom_phase_is_read_from_is_the_trainers(module: str, function: str) -> None:
    assert callable(getattr(importlib.import_module(f"sftjob_trainer.{module}"), function))


def test_an_old_driver_or_a_driver_older_than_the_cuda_runtime_is_a_driver_mismatch() -> None:
    with pytest.raises(TrainerError) as old:
        check_driver(DriverInfo("470.82.01", (11, 4)), "525.60.11", "12.1")
    assert old.value.code == ExitCode.DRIVER_MISMATCH
    with pytest.raises(TrainerError) as behind:
        check_driver(DriverInfo("535.54.03", (12, 2)), "525.60.11", "13.0")
    assert behind.value.code == ExitCode.DRIVER_MISMATCH and "CUDA up to 12.2" in behind.value.reason
    check_driver(DriverInfo("535.54.03", (12, 2)), "525.60.11", "12.8")  # minor-version compatible


def _cuda_does_not_start(monkeypatch: pytest.MonkeyPatch, error: str) -> TrainerError:
    """check_gpu where NVML reads driver 580 (CUDA 13.0) but CUDA fails to start with ``error``."""

    def init() -> None:
        raise RuntimeError(error)

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(preflight, "read_driver_info", lambda: DriverInfo("580.95.05", (13, 0)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    with pytest.raises(TrainerError) as raised:
        check_gpu(GpuExpectation(), local_rank=0, local_world_size=8)
    return raised.value


def test_cuda_error_802_on_an_nvswitch_board_is_a_gpu_fault_naming_the_fabric_manager_not_a_driver_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = "Unexpected error from cudaGetDeviceCount(). Error 802: system not yet initialized"
    failure = _cuda_does_not_start(monkeypatch, error)
    assert failure.code == ExitCode.GPU_UNAVAILABLE
    assert error in failure.reason
    assert "nvidia-fabricmanager, of the driver's version 580.95.05, must run on the node" in failure.reason


def test_cuda_that_does_not_start_is_a_driver_mismatch_only_when_cuda_says_the_driver_cannot_serve_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    too_old = "The NVIDIA driver on your system is too old (found version 12080)."
    assert _cuda_does_not_start(monkeypatch, too_old).code == ExitCode.DRIVER_MISMATCH
    other = _cuda_does_not_start(
        monkeypatch, "CUDA driver initialization failed, you might not have a CUDA gpu."
    )
    assert other.code == ExitCode.GPU_UNAVAILABLE and "initialization failed" in other.reason


def test_a_gpu_that_fails_its_first_kernel_fails_preflight_with_the_class_of_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def failing(error: str) -> object:
        def ones(*args: object, **kwargs: object) -> None:
            raise torch.AcceleratorError(error)

        return ones

    monkeypatch.setattr(
        preflight.torch,
        "ones",
        failing("CUDA error: no kernel image is available for execution on the device"),
    )
    with pytest.raises(TrainerError) as no_kernels:
        preflight.check_first_kernel(0, "NVIDIA L40S")
    assert no_kernels.value.code == ExitCode.CONFIG_ERROR and "spec.image" in no_kernels.value.reason
    monkeypatch.setattr(preflight.torch, "ones", failing("CUDA error: unspecified launch failure"))
    with pytest.raises(TrainerError) as faulty:
        preflight.check_first_kernel(0, "NVIDIA L40S")
    assert faulty.value.code == ExitCode.GPU_UNAVAILABLE and "GPU 0 (NVIDIA L40S)" in faulty.value.reason


def test_an_image_whose_pytorch_has_no_cuda_is_a_config_error_not_a_node_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only wheel in the user's spec.image
    monkeypatch.setattr(preflight, "read_driver_info", lambda: DriverInfo("550.54.15", (12, 4)))
    with pytest.raises(TrainerError) as cpu_only:
        check_gpu(GpuExpectation(), local_rank=0, local_world_size=1)
    assert cpu_only.value.code == ExitCode.CONFIG_ERROR
    assert "PyTorch" in cpu_only.value.reason and "no CUDA support" in cpu_only.value.reason


def test_a_run_whose_loss_stays_nan_exits_diverged_before_saving_a_checkpoint_of_it(
    trainer_config: MakeConfig, tiny_model: Path, tmp_path: Path, termination_log: Path
) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = float("nan")  # every logit NaN, whatever the batch
    save_file(tensors, weights, metadata={"format": "pt"})
    config = _rewrite(trainer_config(), model__path=str(broken), checkpoints__everySteps=8)

    assert run(str(config)) == ExitCode.DIVERGED
    assert "diverged" in _reason(termination_log) and "up to step 5" in _reason(termination_log)
    assert not list((tmp_path / "run" / "checkpoints").glob("checkpoint-*"))
    lines = (tmp_path / "run" / "output" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [None] * 5
