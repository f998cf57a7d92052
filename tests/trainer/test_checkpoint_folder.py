"""What a checkpoint folder holds (the trainable parameters only) and who owns it: one attempt at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_OWNER_FILE
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import checkpoints
from sftjob_trainer.checkpoints import Trainables, TrainState, checkpoint_dirs
from sftjob_trainer.distributed import DistContext

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _attempt(n: int, uid: str = "uid-1") -> JobRef:
    return JobRef(name="job", uid=uid, attempt=n)


def _owner(root: Path) -> dict[str, object]:
    return dict(json.loads((root / CHECKPOINT_OWNER_FILE).read_text()))


def _trainables() -> Trainables:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Trainables(model, optimizer, scheduler, scaler=None)


def test_an_attempt_takes_over_the_folder_and_saves_into_it(tmp_path: Path) -> None:
    checkpoints.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    assert _owner(tmp_path) == {"job": "uid-1", "attempt": 2}
    checkpoints.save(tmp_path, TrainState(step=5), _trainables(), ONE_PROCESS, keep=2, job=_attempt(2))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [5]


def test_a_save_of_an_attempt_superseded_meanwhile_is_discarded_not_committed(tmp_path: Path) -> None:
    checkpoints.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    checkpoints.save(tmp_path, TrainState(step=4), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1))
    checkpoints.take_over(tmp_path, _attempt(2), ONE_PROCESS)  # the restart began while attempt 1 still ran

    with pytest.raises(TrainerError) as stopped:
        checkpoints.save(tmp_path, TrainState(step=6), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1))
    assert stopped.value.code == ExitCode.PREEMPTED
    assert "superseded by attempt 2" in stopped.value.reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_an_attempt_that_starts_after_a_later_one_owns_the_folder_stops(tmp_path: Path) -> None:
    checkpoints.take_over(tmp_path, _attempt(3), ONE_PROCESS)
    with pytest.raises(TrainerError) as stopped:
        checkpoints.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    assert stopped.value.code == ExitCode.PREEMPTED
    assert _owner(tmp_path)["attempt"] == 3


def test_a_job_recreated_under_the_same_name_takes_over_the_folder_it_kept(tmp_path: Path) -> None:
    checkpoints.take_over(tmp_path, _attempt(3, uid="old"), ONE_PROCESS)
    checkpoints.take_over(tmp_path, _attempt(1, uid="new"), ONE_PROCESS)
    assert _owner(tmp_path) == {"job": "new", "attempt": 1}
    with pytest.raises(TrainerError, match="superseded by job new"):
        checkpoints.save(
            tmp_path, TrainState(step=2), _trainables(), ONE_PROCESS, keep=2, job=_attempt(3, "old")
        )


def test_an_attempt_taking_over_removes_the_unfinished_saves_of_the_attempts_before_it(
    tmp_path: Path,
) -> None:
    leftover = tmp_path / ".tmp-checkpoint-4-attempt-1" / checkpoints.TENSORS_DIR
    leftover.mkdir(parents=True)  # attempt 1 was killed while saving step 4
    checkpoints.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_OWNER_FILE]


def test_a_checkpoint_holds_the_trainable_parameters_only_not_buffers_frozen_weights_or_a_tied_copy(
    tmp_path: Path,
) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight  # tied, as in small Llama and Qwen models
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.register_buffer("absmax", torch.ones(4))  # like bitsandbytes' quantisation statistics

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.frozen(self.embed(ids)) * self.absmax)

    model = Tied()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    parts = Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)
    checkpoints.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=1), parts, ONE_PROCESS, keep=1, job=_attempt(1))

    saved = FileSystemReader(path / checkpoints.TENSORS_DIR).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("model.")} == {"model.embed.weight"}

    before = model.embed.weight.detach().clone()
    with torch.no_grad():
        model.embed.weight.zero_()
    assert checkpoints.load_latest(tmp_path, parts, ONE_PROCESS) is not None
    assert torch.equal(model.head.weight, before)  # the tied head came back with its embedding
