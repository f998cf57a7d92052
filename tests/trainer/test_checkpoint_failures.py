"""torch.distributed.checkpoint gathers every rank's failure into one CheckpointException: what the trainer
ends with is read from the errors inside it, not from the wrapper. A CUDA OOM while saving or loading the
tensors is an OOM in a named phase (the operator skips the micro-batch ladder for it), not the storage
failing; a full disk is a StorageError and a folder the trainer may not write a ConfigError."""

from __future__ import annotations

import errno
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

from sftjob.config import JobRef
from sftjob.failures import ExitCode, OomPhase, TrainerError, oom_phase
from sftjob_trainer import checkpoints, ownership
from sftjob_trainer.checkpoint_loading import tensors_failure
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.distributed import DistContext

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _gathered(*errors: BaseException) -> CheckpointException:
    return CheckpointException(
        "failed", {rank: (error, traceback.StackSummary()) for rank, error in enumerate(errors)}
    )


def _save_failing_with(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *errors: BaseException
) -> TrainerError:
    job = JobRef(name="job", uid="uid-1", attempt=1)
    ownership.take_over(tmp_path, job, ONE_PROCESS)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    parts = Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)

    def failing(*args: Any, **kwargs: Any) -> None:
        raise _gathered(*errors)

    monkeypatch.setattr(checkpoints.dcp, "save", failing)
    with pytest.raises(TrainerError) as failed:
        checkpoints.save(tmp_path, TrainState(step=4), parts, ONE_PROCESS, keep=1, job=job)
    return failed.value


def test_a_rank_running_out_of_gpu_memory_while_saving_is_an_oom_while_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed = _save_failing_with(monkeypatch, tmp_path, RuntimeError("peer gave up"), OOM)
    assert failed.code == ExitCode.CUDA_OOM
    assert oom_phase(failed.reason) == OomPhase.SAVING
    assert "Tried to allocate 2.00 GiB" in failed.reason


def test_a_full_disk_under_a_save_is_a_storage_error_in_the_disks_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x.distcp"))
    failed = _save_failing_with(monkeypatch, tmp_path, full)
    assert failed.code == ExitCode.STORAGE_ERROR
    assert "No space left on device" in failed.reason


def test_a_save_the_trainer_may_not_write_is_a_config_error_even_from_inside_the_gathered_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x.distcp"))
    failed = _save_failing_with(monkeypatch, tmp_path, denied)
    assert failed.code == ExitCode.CONFIG_ERROR
    assert f"the trainer runs as uid {os.getuid()}" in failed.reason


def test_an_oom_while_loading_a_checkpoints_tensors_stops_the_attempt_instead_of_skipping_the_checkpoint(
    tmp_path: Path,
) -> None:
    stop = tensors_failure(_gathered(OOM), tmp_path / "checkpoint-4")
    assert stop is not None
    assert stop.code == ExitCode.CUDA_OOM
    assert oom_phase(stop.reason) == OomPhase.LOADING


def test_tensors_that_fail_to_load_for_the_checkpoints_sake_skip_it(tmp_path: Path) -> None:
    assert tensors_failure(_gathered(KeyError("model.weight")), tmp_path / "checkpoint-4") is None
