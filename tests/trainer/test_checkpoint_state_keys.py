"""A checkpoint's trainer_state.json across trainer versions: an image rolled back resumes a newer
trainer's checkpoint, ignoring the counters it does not know; a state without its step is not resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftjob.failures import ExitCode
from sftjob_trainer.checkpoints import STATE_FILE, TrainState, checkpoint_dirs
from sftjob_trainer.resume import saved_state
from sftjob_trainer.tiny import write_dataset
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer


def _edit_newest_state(config: Path, **changes: object) -> Path:
    """Rewrite the newest checkpoint's trainer_state.json with ``changes`` (None: the key removed)."""
    root = Path(json.loads(config.read_text())["checkpoints"]["dir"])
    newest = max(checkpoint_dirs(root))[1]
    state = json.loads((newest / STATE_FILE).read_text())
    for key, value in changes.items():
        if value is None:
            state.pop(key)
        else:
            state[key] = value
    (newest / STATE_FILE).write_text(json.dumps(state))
    return newest


def _resumed_from(config: Path) -> object:
    output = Path(json.loads(config.read_text())["outputDir"])
    return json.loads((output / "summary.json").read_text())["resumedFromStep"]


def test_a_trainer_rolled_back_resumes_a_newer_trainers_checkpoint_ignoring_keys_it_does_not_know(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK
    _edit_newest_state(config, tokensSeenByANewerTrainer=7)

    assert run(str(config)) == ExitCode.OK
    assert _resumed_from(config) == 4
    assert "ignoring tokensSeenByANewerTrainer" in caplog.text


def test_a_checkpoint_whose_state_has_no_step_is_skipped_for_the_one_before_it(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK
    _edit_newest_state(config, step=None)

    assert run(str(config)) == ExitCode.OK
    assert _resumed_from(config) == 2
    assert f"{STATE_FILE} has no step" in caplog.text


def test_a_checkpoint_saved_before_states_recorded_their_training_resumes_as_before(
    trainer_config: MakeConfig,
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK
    _edit_newest_state(config, identity=None, nonfinite_in_a_row=None)
    settings = json.loads(config.read_text())
    settings["dataset"]["path"] = str(write_dataset(config.parent / "moved.jsonl", "text", rows=128))
    config.write_text(json.dumps(settings))

    assert run(str(config)) == ExitCode.OK  # nothing to compare the moved dataset with
    assert _resumed_from(config) == 4


def test_a_saved_state_keeps_every_field_this_trainer_knows(tmp_path: Path) -> None:
    saved = {"step": 6, "tokens": 600, "samples": 48, "loss": 1.5, "course": {"epochs": 1.0}, "later": 1}
    assert saved_state(saved, tmp_path) == TrainState(
        step=6, tokens=600, samples=48, loss=1.5, course={"epochs": 1.0}
    )
    assert saved_state({"step": 6, "tokens": 600, "samples": 48}, tmp_path).nonfinite_in_a_row == 0
    with pytest.raises(ValueError, match="has no tokens, samples"):
        saved_state({"step": 6}, tmp_path)
