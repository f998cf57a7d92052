"""Checkpoints survive kill -9 and SIGTERM, a resumed run continues exactly where it stopped, and
checkpoints that do not load neither cost the run its later progress nor let it start afresh unnoticed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from sftjob.constants import CHECKPOINT_COMPLETE_MARKER
from sftjob.failures import ExitCode
from sftjob_trainer import checkpoints
from sftjob_trainer.batching import Schedule
from sftjob_trainer.checkpoints import BAD_PREFIX, TENSORS_DIR, TrainState, checkpoint_dirs, problem
from sftjob_trainer.data_order import same_data_order
from sftjob_trainer.tiny import write_dataset
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, start_trainer, train_log, trainer_output, wait_for_step

pytestmark = pytest.mark.trainer

STEPS = 24
# Past the second checkpoint, between saves (every 3 steps): fixed, so a failure can be rerun as it was.
KILL_AFTER_STEP = 7


def _checkpoint_root(config: Path) -> Path:
    return Path(json.loads(config.read_text())["checkpoints"]["dir"])


def _summary(config: Path) -> dict[str, object]:
    output = Path(json.loads(config.read_text())["outputDir"])
    return dict(json.loads((output / "summary.json").read_text()))


def test_kill_9_then_restart_resumes_with_the_losses_of_an_uninterrupted_run(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    # LoRA with dropout: the RNG state has to be restored too for the losses to match.
    overrides = {"training": {"maxSteps": STEPS}, "checkpoints": {"everySteps": 3, "keep": 2}}
    reference = trainer_config("messages", name="reference", **overrides)
    assert run(str(reference)) == ExitCode.OK
    expected = train_log(reference)

    interrupted = trainer_config("messages", name="interrupted", **overrides)
    proc = start_trainer(interrupted, termination_log)
    wait_for_step(interrupted, proc, KILL_AFTER_STEP)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, trainer_output(interrupted)
    killed_at = max(train_log(interrupted))
    assert killed_at < STEPS

    assert run(str(interrupted)) == ExitCode.OK
    resumed_from = _summary(interrupted)["resumedFromStep"]
    assert isinstance(resumed_from, int) and 3 <= resumed_from <= killed_at
    got = train_log(interrupted)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(resumed_from + 1, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-4), step


def _unloadable(path: Path) -> None:
    """Tensor files as long as the index says but not loadable: the checks pass, loading fails part-way."""
    for tensors in (path / TENSORS_DIR).glob("*.distcp"):
        tensors.write_bytes(bytes(tensors.stat().st_size))
    assert problem(path) is None


def _set_aside(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(BAD_PREFIX))


def test_truncated_and_unmarked_checkpoints_are_skipped_with_a_warning_and_set_aside(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 8}, checkpoints={"everySteps": 3, "keep": 3})
    assert run(str(config)) == ExitCode.OK
    root = _checkpoint_root(config)
    assert [step for step, _ in checkpoint_dirs(root)] == [8, 6, 3]  # an adapter's last step is saved too
    (root / "checkpoint-8" / CHECKPOINT_COMPLETE_MARKER).unlink()  # killed before the marker
    tensors = max((root / "checkpoint-6" / TENSORS_DIR).glob("*.distcp"), key=lambda p: p.stat().st_size)
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # a lost write
    (root / ".tmp-checkpoint-9").mkdir()  # a save that never finished

    assert run(str(config)) == ExitCode.OK
    assert _summary(config)["resumedFromStep"] == 3
    assert (
        "skipping checkpoint" in caplog.text
        and "checkpoint-8" in caplog.text
        and "checkpoint-6" in caplog.text
    )
    assert [step for step, _ in checkpoint_dirs(root)] == [8, 6, 3]
    assert _set_aside(root) == [".bad-checkpoint-6", ".bad-checkpoint-8"]
    assert not (root / ".tmp-checkpoint-9").exists()


def test_a_run_resumed_below_a_checkpoint_that_failed_to_load_keeps_its_own_progress(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 10}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK
    root = _checkpoint_root(config)
    assert [step for step, _ in checkpoint_dirs(root)] == [10, 8]
    _unloadable(root / "checkpoint-10")

    # The next attempt resumes from step 8 and ends before it passes step 10: the reviewer's interrupted
    # restart, shortened here by a run length of 9. Before, checkpoint-10 still ranked newest, so keep 1
    # deleted each new save and the one resumed from, and the attempt after could only fail.
    settings = json.loads(config.read_text())
    settings["training"]["maxSteps"], settings["checkpoints"]["keep"] = 9, 1
    config.write_text(json.dumps(settings))
    assert run(str(config)) == ExitCode.OK
    assert _summary(config)["resumedFromStep"] == 8
    assert "setting checkpoint" in caplog.text and ".bad-checkpoint-10" in caplog.text
    assert [step for step, _ in checkpoint_dirs(root)] == [9]
    assert _set_aside(root) == [".bad-checkpoint-10"]

    assert run(str(config)) == ExitCode.OK
    assert _summary(config)["resumedFromStep"] == 9


def test_a_full_fine_tune_saves_no_checkpoint_of_its_last_step(trainer_config: MakeConfig) -> None:
    config = trainer_config(
        "text", method="full", training={"maxSteps": 5}, checkpoints={"everySteps": 2, "keep": 3}
    )
    assert run(str(config)) == ExitCode.OK
    assert [step for step, _ in checkpoint_dirs(_checkpoint_root(config))] == [4, 2]


def test_sigterm_finishes_the_step_saves_a_checkpoint_and_exits_preempted(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config("messages", training={"maxSteps": 400}, checkpoints={"everySteps": 1000})
    proc = start_trainer(config, termination_log)
    wait_for_step(config, proc, 3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == ExitCode.PREEMPTED, trainer_output(config)
    last_step = max(train_log(config))
    (newest, path), *_ = checkpoint_dirs(_checkpoint_root(config))
    assert newest == last_step and problem(path) is None
    assert "preempted" in termination_log.read_text()


def test_sigterm_during_a_scheduled_save_stops_after_that_save_without_another_step_or_save(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config("messages", training={"maxSteps": 12}, checkpoints={"everySteps": 4, "keep": 5})
    saves: list[int] = []

    def save(root: Path, state: TrainState, *args: Any, **kwargs: Any) -> Path:
        saves.append(state.step)
        if state.step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # the pod is deleted while the save of step 4 runs
        return real_save(root, state, *args, **kwargs)

    real_save = checkpoints.save
    monkeypatch.setattr(checkpoints, "save", save)
    assert run(str(config)) == ExitCode.PREEMPTED
    assert saves == [4] and max(train_log(config)) == 4
    assert "checkpoint saved at step 4" in termination_log.read_text()


def test_a_run_whose_only_checkpoints_fail_to_load_stops_rather_than_train_from_half_loaded_weights(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 5}, checkpoints={"everySteps": 2, "keep": 3})
    assert run(str(config)) == ExitCode.OK
    root = _checkpoint_root(config)
    for _step, path in checkpoint_dirs(root):
        _unloadable(path)

    assert run(str(config)) == ExitCode.STORAGE_ERROR
    assert "checkpoint-5, checkpoint-4, checkpoint-2" in caplog.text
    assert "no checkpoint" in caplog.text and "move them away" in caplog.text
    assert [step for step, _ in checkpoint_dirs(root)] == [5, 4, 2] and _set_aside(root) == []


def test_a_job_created_again_over_its_checkpoints_with_other_data_or_adapters_is_refused_as_a_config_error(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK  # finished: its last step saved, as an adapter run's is
    trained = json.loads(config.read_text())
    other_data = write_dataset(config.parent / "fixed.jsonl", "text", rows=128, seed=1)

    # Before, the new job resumed the finished course: no step, and the old adapter as its output.
    config.write_text(json.dumps(trained | {"dataset": trained["dataset"] | {"path": str(other_data)}}))
    assert run(str(config)) == ExitCode.CONFIG_ERROR
    reason = termination_log.read_text()
    assert f"dataset.path was {trained['dataset']['path']}, now {other_data}" in reason
    assert [step for step, _ in checkpoint_dirs(_checkpoint_root(config))] == [4, 2]

    config.write_text(json.dumps(trained | {"lora": trained["lora"] | {"r": 16}}))
    assert run(str(config)) == ExitCode.CONFIG_ERROR
    assert "lora.r was 8, now 16" in termination_log.read_text()

    # What may change over kept checkpoints by design resumes them.
    training = trained["training"] | {"maxSteps": 6, "learningRate": 1e-3, "weightDecay": 0.1}
    config.write_text(json.dumps(trained | {"training": training}))
    assert run(str(config)) == ExitCode.OK
    assert _summary(config)["resumedFromStep"] == 4 and _summary(config)["steps"] == 6


def test_a_resume_on_another_number_of_gpus_with_the_same_global_batch_keeps_the_data_order() -> None:
    def units_of(schedule: Schedule, step: int) -> list[int]:
        return sorted(
            u for rank in range(schedule.world_size) for mb in schedule.micro_batches(step, rank) for u in mb
        )

    one_gpu, two_gpus = Schedule(100, 2, 4, 1, seed=7), Schedule(100, 2, 2, 2, seed=7)
    assert all(units_of(one_gpu, step) == units_of(two_gpus, step) for step in range(40))
    now = {"units": 100, "perStep": 8, "seed": 7, "packing": True}
    assert same_data_order(now | {"worldSize": 1}, now)  # written by an older trainer on one GPU
    where = {"used": {"epoch": 0, "rows": ""}, "rest": {"epoch": 0, "step": 3, "rows": ""}}
    assert same_data_order(now | where, now)  # where the order stands is not its layout
    assert not same_data_order(now | {"perStep": 4}, now)
