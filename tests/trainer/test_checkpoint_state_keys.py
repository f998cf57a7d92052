"""A checkpoint's trainer_state.json across trainer versions: an image rolled back resumes a newer
trainer's checkpoint, ignoring the counters it does not know; a state without its step is not resumed. It
records the training it is of and, beside it, the transformers and peft that saved it; a job recreated
with its hub model on a volume resumes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sftjob.failures import ExitCode
from sftjob_trainer.checkpoints import STATE_FILE, TrainState, checkpoint_dirs
from sftjob_trainer.identity import model_code
from sftjob_trainer.resume import saved_state
from sftjob_trainer.tiny import write_dataset
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer


def _newest_state(config: Path) -> dict[str, Any]:
    """The newest checkpoint's trainer_state.json."""
    return dict(json.loads((_newest(config) / STATE_FILE).read_text()))


def _newest(config: Path) -> Path:
    root = Path(json.loads(config.read_text())["checkpoints"]["dir"])
    return max(checkpoint_dirs(root))[1]


def _edit_newest_state(config: Path, **changes: object) -> Path:
    """Rewrite the newest checkpoint's trainer_state.json with ``changes`` (None: the key removed)."""
    newest = _newest(config)
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


def test_a_checkpoint_records_the_transformers_and_peft_that_saved_it_beside_its_training(
    trainer_config: MakeConfig,
) -> None:
    config = trainer_config("text", training={"maxSteps": 2}, checkpoints={"everySteps": 2, "keep": 1})
    assert run(str(config)) == ExitCode.OK
    saved = _newest_state(config)
    assert saved["versions"] == model_code() and {"transformers", "peft"} <= saved["versions"].keys()
    assert "versions" not in saved["identity"]  # an image of newer versions may resume the same training


def test_a_job_recreated_with_its_hub_model_on_a_volume_resumes_its_checkpoints_with_a_warning(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2, "keep": 2})
    assert run(str(config)) == ExitCode.OK
    trained = _newest_state(config)["identity"]
    moved_from = trained | {"model.name": "org/tiny", "model.path": None}  # as if trained from the hub
    _edit_newest_state(config, identity=moved_from)

    assert run(str(config)) == ExitCode.OK  # the NetworkError's advice: "put the model on a volume"
    assert _resumed_from(config) == 4
    assert "model.name was org/tiny, now unset" in caplog.text and "as the same training" in caplog.text


def test_a_saved_state_keeps_every_field_this_trainer_knows(tmp_path: Path) -> None:
    saved = {"step": 6, "tokens": 600, "samples": 48, "loss": 1.5, "course": {"epochs": 1.0}, "later": 1}
    assert saved_state(saved, tmp_path) == TrainState(
        step=6, tokens=600, samples=48, loss=1.5, course={"epochs": 1.0}
    )
    assert saved_state({"step": 6, "tokens": 600, "samples": 48}, tmp_path).nonfinite_in_a_row == 0
    with pytest.raises(ValueError, match="has no tokens, samples"):
        saved_state({"step": 6}, tmp_path)
