"""Checkpoints survive kill -9 and SIGTERM, and a resumed run continues exactly where it stopped."""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest

from sftjob.constants import CHECKPOINT_COMPLETE_MARKER
from sftjob.failures import ExitCode
from sftjob_trainer.checkpoints import TENSORS_DIR, checkpoint_dirs, problem
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, start_trainer, train_log, trainer_output, wait_for_step

pytestmark = pytest.mark.trainer

STEPS = 24


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
    wait_for_step(interrupted, proc, random.randint(4, 10))
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


def test_truncated_and_unmarked_checkpoints_are_skipped_with_a_warning(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 7}, checkpoints={"everySteps": 2, "keep": 3})
    assert run(str(config)) == ExitCode.OK
    root = _checkpoint_root(config)
    assert [step for step, _ in checkpoint_dirs(root)] == [6, 4, 2]
    (root / "checkpoint-6" / CHECKPOINT_COMPLETE_MARKER).unlink()  # killed before the marker
    tensors = max((root / "checkpoint-4" / TENSORS_DIR).glob("*.distcp"), key=lambda p: p.stat().st_size)
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # a lost write
    (root / ".tmp-checkpoint-8").mkdir()  # a save that never finished

    assert run(str(config)) == ExitCode.OK
    assert _summary(config)["resumedFromStep"] == 2
    assert (
        "skipping checkpoint" in caplog.text
        and "checkpoint-6" in caplog.text
        and "checkpoint-4" in caplog.text
    )
    assert [step for step, _ in checkpoint_dirs(root)] == [6, 4, 2]
    assert not (root / ".tmp-checkpoint-8").exists()


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


def test_a_run_whose_only_checkpoints_fail_to_load_stops_rather_than_train_from_half_loaded_weights(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 5}, checkpoints={"everySteps": 2, "keep": 3})
    assert run(str(config)) == ExitCode.OK
    root = _checkpoint_root(config)
    for _step, path in checkpoint_dirs(root):
        for tensors in (path / TENSORS_DIR).glob("*.distcp"):
            tensors.write_bytes(bytes(tensors.stat().st_size))  # same length, so it looks complete
        assert problem(path) is None

    assert run(str(config)) == ExitCode.STORAGE_ERROR
    assert "checkpoint-4" in caplog.text and "checkpoint-2" in caplog.text
    assert "no checkpoint" in caplog.text and "move them away" in caplog.text
