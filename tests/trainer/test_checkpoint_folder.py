"""What a checkpoint folder holds (the trainable parameters only), who owns it (one attempt at a time), and
what happens to the checkpoints that do not load: set aside when an older one does, the run stopped when
none does, and the progress of the run never rotated away for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_OWNER_FILE
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import checkpoints, ownership
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
    ownership.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    assert _owner(tmp_path) == {"job": "uid-1", "attempt": 2}
    checkpoints.save(tmp_path, TrainState(step=5), _trainables(), ONE_PROCESS, keep=2, job=_attempt(2))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [5]


def test_a_save_of_an_attempt_superseded_meanwhile_is_discarded_not_committed(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    checkpoints.save(tmp_path, TrainState(step=4), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1))
    ownership.take_over(tmp_path, _attempt(2), ONE_PROCESS)  # the restart began while attempt 1 still ran

    with pytest.raises(TrainerError) as stopped:
        checkpoints.save(tmp_path, TrainState(step=6), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1))
    assert stopped.value.code == ExitCode.PREEMPTED
    assert "superseded by attempt 2" in stopped.value.reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_an_attempt_that_starts_after_a_later_one_owns_the_folder_stops(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(3), ONE_PROCESS)
    with pytest.raises(TrainerError) as stopped:
        ownership.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    assert stopped.value.code == ExitCode.PREEMPTED
    assert _owner(tmp_path)["attempt"] == 3


def test_a_job_recreated_under_the_same_name_takes_over_the_folder_it_kept(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(3, uid="old"), ONE_PROCESS)
    ownership.take_over(tmp_path, _attempt(1, uid="new"), ONE_PROCESS)
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
    ownership.take_over(tmp_path, _attempt(2), ONE_PROCESS)
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
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=1), parts, ONE_PROCESS, keep=1, job=_attempt(1))

    saved = FileSystemReader(path / checkpoints.TENSORS_DIR).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("model.")} == {"model.embed.weight"}

    before = model.embed.weight.detach().clone()
    with torch.no_grad():
        model.embed.weight.zero_()
    assert checkpoints.load_latest(tmp_path, parts, ONE_PROCESS) is not None
    assert torch.equal(model.head.weight, before)  # the tied head came back with its embedding


def _unloadable(path: Path) -> None:
    """Tensor files as long as the index says but not loadable: the checks pass, loading fails part-way."""
    for tensors in (path / checkpoints.TENSORS_DIR).glob("*.distcp"):
        tensors.write_bytes(bytes(tensors.stat().st_size))


def _bad(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(checkpoints.BAD_PREFIX))


def test_checkpoints_newer_than_the_one_resumed_from_are_set_aside_and_no_later_save_deletes_the_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    for step in (4, 10):
        checkpoints.save(tmp_path, TrainState(step=step), _trainables(), ONE_PROCESS, keep=5, job=_attempt(1))
    _unloadable(tmp_path / "checkpoint-10")

    ownership.take_over(tmp_path, _attempt(2), ONE_PROCESS)
    resumed = checkpoints.load_latest(tmp_path, _trainables(), ONE_PROCESS)
    assert resumed is not None and resumed[0].step == 4
    assert _bad(tmp_path) == [".bad-checkpoint-10"]
    assert "setting checkpoint" in caplog.text and "its tensors do not load" in caplog.text
    # keep 1: before, checkpoint-10 ranked newest and each save deleted itself and the one resumed from.
    checkpoints.save(tmp_path, TrainState(step=6), _trainables(), ONE_PROCESS, keep=1, job=_attempt(2))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [6]
    assert _bad(tmp_path) == [".bad-checkpoint-10"]  # kept for inspection
    assert checkpoints.load_latest(tmp_path, _trainables(), ONE_PROCESS) is not None


def test_a_save_keeps_the_checkpoint_it_committed_whatever_is_newer(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    for step in (4, 10, 6):
        checkpoints.save(tmp_path, TrainState(step=step), _trainables(), ONE_PROCESS, keep=1, job=_attempt(1))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [10, 6]


def test_checkpoints_whose_small_files_do_not_load_stop_the_run_rather_than_start_it_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    for step in (2, 4):
        path = checkpoints.save(
            tmp_path, TrainState(step=step), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1)
        )
        (path / checkpoints.SCHEDULER_FILE).write_bytes(b"cut off")

    with pytest.raises(TrainerError) as stopped:
        checkpoints.load_latest(tmp_path, _trainables(), ONE_PROCESS)
    assert stopped.value.code == ExitCode.STORAGE_ERROR
    assert "no checkpoint" in stopped.value.reason and "checkpoint-4, checkpoint-2" in stopped.value.reason
    assert "its files do not load" in caplog.text
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4, 2] and _bad(tmp_path) == []


def test_a_fresh_start_sets_incomplete_checkpoints_aside(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=2), _trainables(), ONE_PROCESS, keep=2, job=_attempt(1))
    (path / CHECKPOINT_COMPLETE_MARKER).unlink()
    assert checkpoints.load_latest(tmp_path, _trainables(), ONE_PROCESS) is None
    assert checkpoint_dirs(tmp_path) == [] and _bad(tmp_path) == [".bad-checkpoint-2"]


def test_rotation_leaves_unfinished_saves_to_the_attempt_that_takes_the_folder_over(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, _attempt(1), ONE_PROCESS)
    in_progress = tmp_path / ".tmp-checkpoint-8-attempt-2"  # the save of a restart that took over meanwhile
    in_progress.mkdir()
    checkpoints.save(tmp_path, TrainState(step=6), _trainables(), ONE_PROCESS, keep=1, job=_attempt(1))
    assert in_progress.is_dir()


# Two ranks resume together, where rank 1 cannot read its RNG file of checkpoint-4 ("one"), and of every
# checkpoint ("all"). One launch for both: starting torchrun and importing torch twice takes most of it.
TWO_RANKS_RESUME = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from sftjob.config import JobRef
from sftjob.failures import TrainerError
from sftjob_trainer import checkpoints, ownership
from sftjob_trainer.checkpoints import Trainables, TrainState, rng_file
from sftjob_trainer.distributed import DistContext

dist.init_process_group("gloo")
ctx = DistContext(dist.get_rank(), 2, dist.get_rank(), 2, torch.device("cpu"))
job = JobRef(name="job", uid="uid", attempt=1)

def parts():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)

for case, broken in {"one": [4], "all": [4, 2]}.items():
    root = Path(sys.argv[1]) / case
    ownership.take_over(root, job, ctx)
    for step in (2, 4):
        checkpoints.save(root, TrainState(step=step), parts(), ctx, keep=2, job=job)
    if ctx.rank == 1:
        for step in broken:
            (root / f"checkpoint-{step}" / rng_file(1)).write_bytes(b"cut off")
    dist.barrier()
    try:
        resumed = checkpoints.load_latest(root, parts(), ctx)
        result = {"step": resumed[0].step if resumed else None}
    except TrainerError as exc:
        result = {"code": int(exc.code)}
    (root / f"rank{ctx.rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
"""


def test_checkpoints_a_rank_cannot_read_are_skipped_by_all_ranks_together_and_stop_the_run_if_none_loads(
    tmp_path: Path,
) -> None:
    script = tmp_path / "resume.py"
    script.write_text(TWO_RANKS_RESUME)
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*launcher, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def results(case: str) -> list[dict[str, int]]:
        return [json.loads((tmp_path / case / f"rank{rank}.json").read_text()) for rank in (0, 1)]

    assert results("one") == [{"step": 2}, {"step": 2}]
    assert _bad(tmp_path / "one") == [".bad-checkpoint-4"]
    assert "1 other rank(s) cannot read its files" in done.stdout + done.stderr
    # No checkpoint loads on every rank: both stop (rather than start afresh), neither waits for the other.
    assert results("all") == [{"code": ExitCode.STORAGE_ERROR}] * 2
    assert [step for step, _ in checkpoint_dirs(tmp_path / "all")] == [4, 2]
