"""What a checkpoint folder holds (the trainable parameters, and a whole model's persistent buffers), who owns
it (one attempt at a time), and what happens to the checkpoints that do not load: set aside when an older
one does, the run stopped when none does, and the progress of the run never rotated away for them (whose
training the checkpoints are, and what fits the model: test_checkpoint_identity.py)."""

from __future__ import annotations

import errno
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
from sftjob_trainer import checkpoints, ownership, resume, rng
from sftjob_trainer.checkpoints import Trainables, TrainState, checkpoint_dirs
from tests.trainer.checkpoint_cases import ONE_PROCESS, attempt, bad, trainables, unloadable
from tests.trainer.runs import LAUNCH_TIMEOUT_SECONDS, stop_torchrun

pytestmark = pytest.mark.trainer


def _owner(root: Path) -> dict[str, object]:
    return dict(json.loads((root / CHECKPOINT_OWNER_FILE).read_text()))


def test_an_attempt_takes_over_the_folder_and_saves_into_it(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)
    assert _owner(tmp_path) == {"namespace": "default", "name": "job", "job": "uid-1", "attempt": 2}
    checkpoints.save(tmp_path, TrainState(step=5), trainables(), ONE_PROCESS, keep=2, job=attempt(2))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [5]


def test_a_save_of_an_attempt_superseded_meanwhile_is_discarded_not_committed(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    checkpoints.save(tmp_path, TrainState(step=4), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)  # the restart began while attempt 1 still ran

    with pytest.raises(TrainerError) as stopped:
        checkpoints.save(tmp_path, TrainState(step=6), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    assert stopped.value.code == ExitCode.PREEMPTED
    assert "superseded by attempt 2" in stopped.value.reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_an_attempt_that_starts_after_a_later_one_owns_the_folder_stops(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(3), ONE_PROCESS)
    with pytest.raises(TrainerError) as stopped:
        ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)
    assert stopped.value.code == ExitCode.PREEMPTED
    assert _owner(tmp_path)["attempt"] == 3


def test_a_job_recreated_under_the_same_name_takes_over_the_folder_it_kept(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(3, uid="old"), ONE_PROCESS)
    ownership.take_over(tmp_path, attempt(1, uid="new"), ONE_PROCESS)
    assert _owner(tmp_path)["job"] == "new" and _owner(tmp_path)["attempt"] == 1
    with pytest.raises(TrainerError, match="superseded by job new"):
        checkpoints.save(
            tmp_path, TrainState(step=2), trainables(), ONE_PROCESS, keep=2, job=attempt(3, "old")
        )


def test_the_checkpoint_folder_of_another_job_is_refused_as_a_config_error_naming_that_job(
    tmp_path: Path,
) -> None:
    ownership.take_over(tmp_path, JobRef(namespace="team-a", name="alpha", uid="a", attempt=1), ONE_PROCESS)
    with pytest.raises(TrainerError) as refused:  # two jobs given the same checkpoints.volume
        ownership.take_over(
            tmp_path, JobRef(namespace="team-a", name="beta", uid="b", attempt=1), ONE_PROCESS
        )
    assert refused.value.code == ExitCode.CONFIG_ERROR
    assert "team-a/alpha" in refused.value.reason and "its own checkpoints.volume" in refused.value.reason
    assert _owner(tmp_path)["name"] == "alpha"


def test_an_owner_file_that_names_no_job_is_taken_over_as_before(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT_OWNER_FILE).write_text(
        json.dumps({"job": "old", "attempt": 3})
    )  # an older trainer's
    ownership.take_over(tmp_path, attempt(1, uid="new"), ONE_PROCESS)
    assert _owner(tmp_path) == {"namespace": "default", "name": "job", "job": "new", "attempt": 1}


def test_an_owner_file_that_cannot_be_read_stops_the_save_as_a_storage_error_and_commits_nothing(
    tmp_path: Path,
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    checkpoints.save(tmp_path, TrainState(step=4), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    owner = tmp_path / CHECKPOINT_OWNER_FILE
    owner.unlink()
    owner.mkdir()  # reading it fails (IsADirectoryError) as an EIO or a stale NFS handle would

    with pytest.raises(TrainerError) as stopped:
        checkpoints.save(tmp_path, TrainState(step=6), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    assert stopped.value.code == ExitCode.STORAGE_ERROR  # not "no owner": it may name a later attempt
    assert f"could not read {owner}" in stopped.value.reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4]
    with pytest.raises(TrainerError) as refused:
        ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)
    assert refused.value.code == ExitCode.STORAGE_ERROR

    owner.rmdir()  # a folder without an owner is anyone's
    checkpoints.save(tmp_path, TrainState(step=6), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [6, 4]


def test_an_attempt_taking_over_removes_the_unfinished_saves_of_the_attempts_before_it(
    tmp_path: Path,
) -> None:
    leftover = tmp_path / ".tmp-checkpoint-4-attempt-1" / checkpoints.TENSORS_DIR
    leftover.mkdir(parents=True)  # attempt 1 was killed while saving step 4
    ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)
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
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=1), parts, ONE_PROCESS, keep=1, job=attempt(1))

    saved = FileSystemReader(path / checkpoints.TENSORS_DIR).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("model.")} == {"model.embed.weight"}

    before = model.embed.weight.detach().clone()
    with torch.no_grad():
        model.embed.weight.zero_()
    assert resume.load_latest(tmp_path, parts, ONE_PROCESS) is not None
    assert torch.equal(model.head.weight, before)  # the tied head came back with its embedding


class _Routed(torch.nn.Module):
    """A whole model (nothing frozen) with a buffer from its pretrained weights, like the router bias of
    GLM-4.5 MoE and DeepSeek-V3, and one computed from the config, like RoPE's frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, 2)
        self.register_buffer("e_score_correction_bias", torch.zeros(2))
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + self.e_score_correction_bias * self.inv_freq


def _routed() -> Trainables:
    model = _Routed()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)


def test_a_checkpoint_of_a_whole_model_holds_its_persistent_buffers_and_a_resume_restores_them(
    tmp_path: Path,
) -> None:
    parts = _routed()
    with torch.no_grad():
        parts.model.e_score_correction_bias.copy_(torch.tensor([0.5, -0.25]))  # the pretrained values
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=2), parts, ONE_PROCESS, keep=1, job=attempt(1))
    saved = FileSystemReader(path / checkpoints.TENSORS_DIR).read_metadata().state_dict_metadata
    assert {key for key in saved if key.startswith("model.")} == {
        "model.gate.weight",
        "model.gate.bias",
        "model.e_score_correction_bias",
    }

    resumed = _routed()  # built from the config under FSDP: the buffer as the model class makes it
    loaded = resume.load_latest(tmp_path, resumed, ONE_PROCESS)
    assert loaded is not None and loaded.without_buffers == []
    assert torch.equal(resumed.model.e_score_correction_bias, torch.tensor([0.5, -0.25]))


def test_an_older_checkpoint_without_buffers_resumes_with_the_buffers_as_they_were_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    with monkeypatch.context() as older_trainer:
        older_trainer.setattr(checkpoints, "persistent_buffers", lambda model, state: set())
        checkpoints.save(tmp_path, TrainState(step=2), _routed(), ONE_PROCESS, keep=1, job=attempt(1))

    resumed = _routed()
    with torch.no_grad():
        resumed.model.e_score_correction_bias.fill_(3.0)  # loaded with the pretrained weights
    loaded = resume.load_latest(tmp_path, resumed, ONE_PROCESS)
    assert loaded is not None and loaded.without_buffers == ["e_score_correction_bias"]
    assert torch.equal(resumed.model.e_score_correction_bias, torch.full((2,), 3.0))
    assert "holds none of the model's buffers" in caplog.text


def test_checkpoints_newer_than_the_one_resumed_from_are_set_aside_and_no_later_save_deletes_the_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (4, 10):
        checkpoints.save(tmp_path, TrainState(step=step), trainables(), ONE_PROCESS, keep=5, job=attempt(1))
    unloadable(tmp_path / "checkpoint-10")

    ownership.take_over(tmp_path, attempt(2), ONE_PROCESS)
    resumed = resume.load_latest(tmp_path, trainables(), ONE_PROCESS)
    assert resumed is not None and resumed[0].step == 4
    assert bad(tmp_path) == [".bad-checkpoint-10"]
    assert "setting checkpoint" in caplog.text and "its tensors do not load" in caplog.text
    # keep 1: before, checkpoint-10 ranked newest and each save deleted itself and the one resumed from.
    checkpoints.save(tmp_path, TrainState(step=6), trainables(), ONE_PROCESS, keep=1, job=attempt(2))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [6]
    assert bad(tmp_path) == [".bad-checkpoint-10"]  # kept for inspection
    assert resume.load_latest(tmp_path, trainables(), ONE_PROCESS) is not None


def test_a_save_keeps_the_checkpoint_it_committed_whatever_is_newer(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (4, 10, 6):
        checkpoints.save(tmp_path, TrainState(step=step), trainables(), ONE_PROCESS, keep=1, job=attempt(1))
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [10, 6]


def test_checkpoints_whose_small_files_do_not_load_stop_the_run_rather_than_start_it_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (2, 4):
        path = checkpoints.save(
            tmp_path, TrainState(step=step), trainables(), ONE_PROCESS, keep=2, job=attempt(1)
        )
        (path / checkpoints.SCHEDULER_FILE).write_bytes(b"cut off")

    with pytest.raises(TrainerError) as stopped:
        resume.load_latest(tmp_path, trainables(), ONE_PROCESS)
    assert stopped.value.code == ExitCode.STORAGE_ERROR
    assert "no checkpoint" in stopped.value.reason and "checkpoint-4, checkpoint-2" in stopped.value.reason
    assert "its files do not load" in caplog.text
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4, 2] and bad(tmp_path) == []


def test_a_fresh_start_sets_incomplete_checkpoints_aside(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    path = checkpoints.save(tmp_path, TrainState(step=2), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    (path / CHECKPOINT_COMPLETE_MARKER).unlink()
    assert resume.load_latest(tmp_path, trainables(), ONE_PROCESS) is None
    assert checkpoint_dirs(tmp_path) == [] and bad(tmp_path) == [".bad-checkpoint-2"]


@pytest.mark.parametrize("where", ["listing", "small files", "tensors"])
def test_a_storage_error_reading_a_checkpoint_stops_the_run_and_sets_nothing_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (2, 4):
        checkpoints.save(tmp_path, TrainState(step=step), trainables(), ONE_PROCESS, keep=2, job=attempt(1))

    def stale(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ESTALE, "Stale file handle")

    target = {
        "listing": (FileSystemReader, "read_metadata"),
        "small files": (torch, "load"),
        "tensors": (FileSystemReader, "read_data"),
    }[where]
    monkeypatch.setattr(*target, stale)
    with pytest.raises(TrainerError) as stopped:
        resume.load_latest(tmp_path, trainables(), ONE_PROCESS)
    assert stopped.value.code == ExitCode.STORAGE_ERROR and "Stale file handle" in stopped.value.reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4, 2] and bad(tmp_path) == []


class _FakeCuda:
    """The CUDA RNG calls of torch.cuda, on a machine with ``visible`` GPUs and this rank's on ``device``."""

    def __init__(self, visible: int, device: int) -> None:
        self.visible, self.device = visible, device
        self.restored: list[torch.Tensor] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(
            torch.cuda, "get_rng_state", lambda: torch.full((4,), self.device, dtype=torch.uint8)
        )
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.restored.append)


def test_the_rng_state_saved_is_this_ranks_gpu_only_and_restores_on_a_machine_with_fewer_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _FakeCuda(visible=8, device=3).install(monkeypatch)
    state = rng.capture_rng()
    assert torch.equal(state["cuda"], torch.full((4,), 3, dtype=torch.uint8))

    one_gpu = _FakeCuda(visible=1, device=0)  # the restart's pod sees one GPU (CUDA_VISIBLE_DEVICES)
    one_gpu.install(monkeypatch)
    rng.restore_rng(state)
    assert len(one_gpu.restored) == 1 and torch.equal(one_gpu.restored[0], state["cuda"])


def test_an_older_checkpoints_rng_states_of_every_gpu_restore_this_devices_or_none_when_it_has_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    old = rng.capture_rng() | {"cuda": [torch.full((4,), n, dtype=torch.uint8) for n in range(2)]}
    second = _FakeCuda(visible=2, device=1)
    second.install(monkeypatch)
    rng.restore_rng(old)
    assert len(second.restored) == 1 and torch.equal(second.restored[0], old["cuda"][1])

    beyond = _FakeCuda(visible=4, device=3)
    beyond.install(monkeypatch)
    with caplog.at_level("INFO"):
        rng.restore_rng(old)
    assert beyond.restored == [] and "no CUDA RNG state of device 3" in caplog.text


def test_rotation_leaves_unfinished_saves_to_the_attempt_that_takes_the_folder_over(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    in_progress = tmp_path / ".tmp-checkpoint-8-attempt-2"  # the save of a restart that took over meanwhile
    in_progress.mkdir()
    checkpoints.save(tmp_path, TrainState(step=6), trainables(), ONE_PROCESS, keep=1, job=attempt(1))
    assert in_progress.is_dir()


# Two ranks resume together, where rank 1 cannot read its RNG file of checkpoint-4 ("one"), and of every
# checkpoint ("all"); then they save into folders their "nodes" do not share ("unshared": a hostPath).
# One launch for all: starting torchrun and importing torch takes most of it.
TWO_RANKS_RESUME = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from sftjob.config import JobRef, TrainerConfig
from sftjob.failures import TrainerError
from sftjob_trainer import checkpoints, ownership, resume
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
        resumed = resume.load_latest(root, parts(), ctx)
        result = {"step": resumed[0].step if resumed else None}
    except TrainerError as exc:
        result = {"code": int(exc.code)}
    (root / f"rank{ctx.rank}.json").write_text(json.dumps(result))

# Rank 1 may not read its RNG file while rank 0's storage fails: both stop, on the permission.
denied = Path(sys.argv[1]) / "denied"
ownership.take_over(denied, job, ctx)
checkpoints.save(denied, TrainState(step=2), parts(), ctx, keep=2, job=job)
load = torch.load
def failing_load(path, *args, **kwargs):
    if Path(path).name == rng_file(1):
        raise PermissionError(13, "Permission denied", str(path))
    if Path(path).name == rng_file(0):
        raise OSError(116, "Stale file handle")
    return load(path, *args, **kwargs)
torch.load = failing_load
try:
    resume.load_latest(denied, parts(), ctx)
    result = {"step": 2}
except TrainerError as exc:
    result = {"code": int(exc.code), "reason": exc.reason}
torch.load = load
(denied / f"rank{ctx.rank}.json").write_text(json.dumps(result))

unshared = Path(sys.argv[1]) / "unshared"
node = unshared / f"node{ctx.rank}"
ownership.take_over(node, job, ctx)
try:
    checkpoints.save(node, TrainState(step=5), parts(), ctx, keep=2, job=job)
    result = {"saved": True}
except TrainerError as exc:
    result = {"code": int(exc.code), "reason": exc.reason}
(unshared / f"rank{ctx.rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The folder TWO_RANKS_RESUME ran in, and its output."""
    folder = tmp_path_factory.mktemp("two-ranks")
    script = folder / "resume.py"
    script.write_text(TWO_RANKS_RESUME)
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.Popen(
        [*launcher, str(script), str(folder)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_SECONDS)
    finally:
        stop_torchrun(proc)
    assert proc.returncode == 0, output[-6000:]
    return folder, output


def _results(folder: Path) -> list[dict[str, object]]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_checkpoints_a_rank_cannot_read_are_skipped_by_all_ranks_together_and_stop_the_run_if_none_loads(
    two_ranks: tuple[Path, str],
) -> None:
    tmp_path, output = two_ranks

    def results(case: str) -> list[dict[str, object]]:
        return _results(tmp_path / case)

    assert results("one") == [{"step": 2}, {"step": 2}]
    assert bad(tmp_path / "one") == [".bad-checkpoint-4"]
    assert "1 other rank(s) cannot read its files" in output
    # No checkpoint loads on every rank: both stop (rather than start afresh), neither waits for the other.
    assert results("all") == [{"code": ExitCode.STORAGE_ERROR}] * 2
    assert [step for step, _ in checkpoint_dirs(tmp_path / "all")] == [4, 2]


def test_a_rank_denied_permission_to_read_a_checkpoint_stops_every_rank_with_a_config_error(
    two_ranks: tuple[Path, str],
) -> None:
    denied = two_ranks[0] / "denied"
    results = _results(denied)
    assert [result["code"] for result in results] == [ExitCode.CONFIG_ERROR] * 2
    # Rank 0's own storage failure gives way: it names the folder's owner as rank 1 does its file's.
    assert "1 other rank(s) may not read checkpoint" in str(results[0]["reason"])
    assert "Permission denied" in str(results[1]["reason"])
    assert all("chown -R" in str(result["reason"]) for result in results)
    assert [step for step, _ in checkpoint_dirs(denied)] == [2] and bad(denied) == []


def test_a_save_into_a_folder_the_nodes_do_not_share_fails_as_a_storage_error_and_is_never_marked_complete(
    two_ranks: tuple[Path, str],
) -> None:
    unshared = two_ranks[0] / "unshared"
    results = _results(unshared)
    assert [result["code"] for result in results] == [ExitCode.STORAGE_ERROR] * 2
    assert "checkpoints.dir is not shared by the job's nodes" in str(results[0]["reason"])
    assert "rng-rank1.pt" in str(results[0]["reason"])
    assert checkpoint_dirs(unshared / "node0") == [] and checkpoint_dirs(unshared / "node1") == []
