"""A folder the trainer's user may not write is the job's configuration, not the storage failing: it ends
the attempt with CONFIG_ERROR (no restart fixes it, where a StorageError would be retried three times),
naming the folder, whose it is, whom the trainer runs as and how to hand it over. The same holds for
reading the checkpoints on a resume (files a root process left 0600, nfs root_squash)."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from sftjob.config import JobRef
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import checkpoints, ownership, resume
from sftjob_trainer.checkpoints import Trainables, TrainState, checkpoint_dirs
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.failures import classify, load_failure
from sftjob_trainer.preflight import check_writable

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _denied(path: Path, code: int = errno.EACCES) -> OSError:
    return PermissionError(code, os.strerror(code), str(path))


def _names_owner_and_remedy(reason: str, folder: Path) -> None:
    owner = folder.stat()
    assert f"{folder} belongs to uid {owner.st_uid}, gid {owner.st_gid}" in reason
    assert f"the trainer runs as uid {os.getuid()}, gid {os.getgid()}" in reason
    assert f"chown -R {os.getuid()}:{os.getgid()}" in reason


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_permission_denied_anywhere_is_a_config_error_naming_the_folders_owner(
    tmp_path: Path, code: int
) -> None:
    exit_code, reason = classify(_denied(tmp_path / "checkpoint-4" / "scheduler.pt", code))
    assert exit_code == ExitCode.CONFIG_ERROR
    _names_owner_and_remedy(reason, tmp_path)  # the nearest folder that exists


def test_a_full_disk_is_still_a_storage_error(tmp_path: Path) -> None:
    exit_code, _ = classify(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path)))
    assert exit_code == ExitCode.STORAGE_ERROR


def test_a_checkpoint_folder_the_trainer_may_not_write_stops_preflight_with_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(*args: Any, dir: str, **kwargs: Any) -> Any:
        raise _denied(Path(dir) / ".preflight-x")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", denied)
    with pytest.raises(TrainerError) as refused:
        check_writable(str(tmp_path), "checkpoint directory (checkpoints.dir)")
    assert refused.value.code == ExitCode.CONFIG_ERROR
    assert refused.value.reason.startswith(
        f"checkpoint directory (checkpoints.dir) {tmp_path} is not writable"
    )
    _names_owner_and_remedy(refused.value.reason, tmp_path)


def test_a_save_into_a_folder_the_trainer_may_not_write_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobRef(name="job", uid="uid-1", attempt=1)
    ownership.take_over(tmp_path, job, ONE_PROCESS)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    parts = Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)

    def denied(self: Path, *args: Any, **kwargs: Any) -> None:
        raise _denied(self)

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(TrainerError) as refused:
        checkpoints.save(tmp_path, TrainState(step=4), parts, ONE_PROCESS, keep=1, job=job)
    assert refused.value.code == ExitCode.CONFIG_ERROR
    assert "could not save checkpoint" in refused.value.reason
    _names_owner_and_remedy(refused.value.reason, tmp_path)


def test_a_model_the_trainer_may_not_read_is_not_retried_as_a_storage_error(tmp_path: Path) -> None:
    assert (
        load_failure(_denied(tmp_path / "model.safetensors"), "the model") is None
    )  # the loader's own error


def _parts() -> Trainables:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    return Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)


@pytest.mark.parametrize("where", ["folder", "listing", "small files", "tensors"])
def test_checkpoints_the_trainer_may_not_read_stop_the_resume_with_a_config_error_and_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    job = JobRef(name="job", uid="uid-1", attempt=1)
    ownership.take_over(tmp_path, job, ONE_PROCESS)
    for step in (2, 4):
        checkpoints.save(tmp_path, TrainState(step=step), _parts(), ONE_PROCESS, keep=2, job=job)
    saved = checkpoint_dirs(tmp_path)

    def denied(*args: Any, **kwargs: Any) -> Any:
        raise _denied(tmp_path / "checkpoint-4" / "file")

    target = {
        "folder": (os, "listdir"),  # pathlib's glob would have listed no checkpoint: a fresh start
        "listing": (FileSystemReader, "read_metadata"),
        "small files": (torch, "load"),
        "tensors": (FileSystemReader, "read_data"),
    }[where]
    monkeypatch.setattr(*target, denied)
    with pytest.raises(TrainerError) as refused:
        resume.load_latest(tmp_path, _parts(), ONE_PROCESS)
    monkeypatch.undo()

    assert refused.value.code == ExitCode.CONFIG_ERROR
    assert "Permission denied" in refused.value.reason and "restart" not in refused.value.reason
    _names_owner_and_remedy(refused.value.reason, tmp_path / "checkpoint-4")  # the file's folder
    assert checkpoint_dirs(tmp_path) == saved and not list(tmp_path.glob(".bad-*"))
