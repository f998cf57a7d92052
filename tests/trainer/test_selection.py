"""spec.evaluation.earlyStopping and finalModel: when training stops early, which checkpoint the rotation
spares, and which weights the output is written from."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from sftjob.config import EvaluationSettings, JobRef, TrainerConfig
from sftjob.failures import ExitCode
from sftjob_trainer import checkpoint_loading, checkpoints, ownership, selection
from sftjob_trainer.checkpoints import Trainables, TrainState, checkpoint_dirs
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
JOB = JobRef(name="job", uid="uid-1", attempt=1)


def _evaluate(state: TrainState, settings: EvaluationSettings, step: int, loss: float) -> bool:
    state.step, state.eval_step, state.eval_loss = step, step, loss
    selection.evaluated(state, settings)
    return selection.stops_early(state, settings)


def test_training_stops_after_patience_evaluations_without_an_improvement_larger_than_min_delta() -> None:
    settings = EvaluationSettings(fraction=0.1, early_stopping={"patience": 2, "minDelta": 0.05})
    state = TrainState()
    assert not _evaluate(state, settings, 10, 2.0)
    assert not _evaluate(state, settings, 20, 1.5)  # an improvement: the count starts again
    assert not _evaluate(state, settings, 30, 1.47)  # lower, but by less than minDelta
    assert _evaluate(state, settings, 40, 1.6)
    assert state.lowest_eval_loss == pytest.approx(1.47) and state.evals_without_improvement == 2


def test_a_nan_evaluation_counts_as_no_improvement_and_without_early_stopping_nothing_stops() -> None:
    state = TrainState()
    plain = EvaluationSettings(fraction=0.1)
    for step, loss in enumerate([1.0, float("nan"), 2.0, 3.0], start=1):
        assert not _evaluate(state, plain, step, loss)
    assert state.lowest_eval_loss == 1.0 and state.evals_without_improvement == 3


def test_the_best_checkpoint_is_the_saved_one_with_the_lowest_loss_and_the_output_comes_from_it() -> None:
    best = EvaluationSettings(fraction=0.1, final_model="Best")
    state = TrainState()
    for step, loss in [(10, 2.0), (20, 1.2), (30, 1.4)]:
        state.step, state.eval_step, state.eval_loss = step, step, loss
        selection.saving(state)
    state.step = 31  # an evaluation between checkpoints is no candidate: its weights were never saved
    state.eval_step, state.eval_loss = 31, 1.3
    assert (state.best_step, state.best_eval_loss) == (20, 1.2)
    assert selection.output_step(state, best) == 20
    assert selection.output_step(state, EvaluationSettings(fraction=0.1)) is None  # finalModel Last
    state.eval_loss = 1.1  # the final weights evaluated lower still: they are the output
    assert selection.output_step(state, best) is None


def _trainables() -> Trainables:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Trainables(model, optimizer, scheduler, scaler=None)


def test_rotation_spares_the_best_checkpoint_and_its_weights_load_back_into_the_model(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, JOB, ONE_PROCESS)
    parts = _trainables()
    saved = {}
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            parts.model.weight.fill_(float(step))
        saved[step] = parts.model.weight.detach().clone()
        state = TrainState(step=step, best_step=2, best_eval_loss=0.5)
        checkpoints.save(tmp_path, state, parts, ONE_PROCESS, keep=1, job=JOB, keep_best=True)
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4, 2]

    checkpoint_loading.load_weights(tmp_path / "checkpoint-2", parts, ONE_PROCESS)
    assert torch.equal(parts.model.weight, saved[2])


def _broken_part_way(checkpoint: Path) -> None:
    """The model tensor read last made unloadable (zeros), its file as long as the index says: loading the
    checkpoint in place would overwrite the others first."""
    folder = checkpoint / checkpoints.TENSORS_DIR
    storage = FileSystemReader(folder).read_metadata().storage_data
    model = [(index.index, info) for index, info in storage.items() if index.fqn.startswith("model.")]
    _, last = max(model, key=lambda item: item[1].offset)
    tensors = folder / last.relative_path
    data = bytearray(tensors.read_bytes())
    data[last.offset : last.offset + last.length] = bytes(last.length)
    tensors.write_bytes(bytes(data))
    assert checkpoints.problem(checkpoint) is None


def test_a_best_checkpoint_whose_tensors_do_not_load_leaves_the_last_steps_weights_as_the_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, JOB, ONE_PROCESS)
    parts = _trainables()
    for step, value in ((2, 2.0), (4, 4.0)):
        with torch.no_grad():
            parts.model.weight.fill_(value)
            parts.model.bias.fill_(value)
        checkpoints.save(tmp_path, TrainState(step=step), parts, ONE_PROCESS, keep=2, job=JOB)
    _broken_part_way(tmp_path / "checkpoint-2")
    with torch.no_grad():
        parts.model.weight.fill_(5.0)  # the last step's weights, of a full fine-tune: in no checkpoint
        parts.model.bias.fill_(5.0)
    config = TrainerConfig(
        model={"path": "/model"},
        dataset={"path": "/data"},
        evaluation={"fraction": 0.1, "finalModel": "Best"},
        training={"globalBatchSize": 1},
        checkpoints={"dir": str(tmp_path)},
    )
    state = TrainState(step=5, eval_step=5, eval_loss=0.9, best_step=2, best_eval_loss=0.5)

    # Before, the run failed here with a storage error, and so did every restart.
    assert selection.load_output(config, parts, state, ONE_PROCESS) == 5
    assert "the best checkpoint" in caplog.text and "the output is the last step's" in caplog.text
    assert all(torch.equal(p, torch.full_like(p, 5.0)) for p in parts.model.parameters())

    state.best_step = 4  # a best checkpoint that loads is still the output
    assert selection.load_output(config, parts, state, ONE_PROCESS) == 4
    assert all(torch.equal(p, torch.full_like(p, 4.0)) for p in parts.model.parameters())


def test_a_run_that_stops_early_writes_the_best_checkpoint_as_its_output(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The held-out losses at steps 1, 2, 3, 4 (and 5: never reached).
    config = _stopping_early(trainer_config, monkeypatch, [3.0, 1.0, 2.0, 2.5, 0.5])
    assert run(str(config)) == ExitCode.OK
    settings = json.loads(config.read_text())
    output, root = Path(settings["outputDir"]), Path(settings["checkpoints"]["dir"])
    summary = json.loads((output / "summary.json").read_text())
    assert summary["stoppedEarly"] and (summary["steps"], summary["totalSteps"]) == (4, 12)
    assert summary["outputStep"] == 2
    assert [step for step, _ in checkpoint_dirs(root)] == [4, 2]  # keep: 1, and the best one

    adapter = load_file(output / "adapter_model.safetensors")
    best, last = (
        _lora_weights(root / "checkpoint-2", tmp_path / "2.pt"),
        _lora_weights(root / "checkpoint-4", tmp_path / "4.pt"),
    )
    assert adapter.keys() == best.keys()
    assert all(torch.equal(adapter[name], best[name]) for name in adapter)
    assert not all(torch.equal(adapter[name], last[name]) for name in adapter)


def _stopping_early(trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, losses: list[float]) -> Path:
    """A run checkpointed every step, patience 2, finalModel Best, whose evaluations give ``losses``."""
    scripted = iter(losses)
    monkeypatch.setattr("sftjob_trainer.train.evaluate", lambda *args, **kwargs: (next(scripted), 0.01))
    return trainer_config(
        "messages",
        checkpoints={"everySteps": 1, "keep": 1},
        evaluation={"fraction": 0.1, "finalModel": "Best", "earlyStopping": {"patience": 2}},
    )


def _lora_weights(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter weights under the names PEFT saves them with."""
    dcp_to_torch_save(checkpoint / checkpoints.TENSORS_DIR, scratch)
    model = torch.load(scratch, weights_only=True)["model"]
    return {name.replace(".default.", "."): tensor for name, tensor in model.items()}


def _summary(config: Path) -> dict[str, Any]:
    return dict(json.loads((Path(json.loads(config.read_text())["outputDir"]) / "summary.json").read_text()))


def test_an_attempt_resumed_where_early_stopping_ended_the_run_trains_no_further(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _stopping_early(trainer_config, monkeypatch, [3.0, 1.0, 2.0, 2.5])  # a resume evaluates nothing
    assert run(str(config)) == ExitCode.OK
    (Path(json.loads(config.read_text())["outputDir"]) / "summary.json").unlink()  # as if writing it failed
    assert run(str(config)) == ExitCode.OK
    again = _summary(config)
    assert (again["resumedFromStep"], again["steps"], again["totalSteps"]) == (4, 4, 12)
    assert again["stoppedEarly"] and again["outputStep"] == 2


def test_patience_running_out_at_the_last_step_is_no_early_stop_even_after_a_resume(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = iter([1.0, 2.0, 3.0])  # evaluated at the checkpoints of steps 4, 8 and 12
    monkeypatch.setattr("sftjob_trainer.train.evaluate", lambda *args, **kwargs: (next(losses), 0.01))
    config = trainer_config("messages", evaluation={"fraction": 0.1, "earlyStopping": {"patience": 2}})
    assert run(str(config)) == ExitCode.OK
    assert not _summary(config)["stoppedEarly"]
    (Path(json.loads(config.read_text())["outputDir"]) / "summary.json").unlink()
    assert run(str(config)) == ExitCode.OK
    again = _summary(config)
    assert not again["stoppedEarly"] and (again["steps"], again["totalSteps"]) == (12, 12)


def test_a_checkpoint_whose_evaluation_a_sigterm_stopped_is_evaluated_when_the_run_resumes(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sftjob_trainer.train.evaluate", lambda *args, **kwargs: (None, 0.01))  # stopped
    config = trainer_config("messages", evaluation={"fraction": 0.1, "finalModel": "Best"})
    assert run(str(config)) == ExitCode.PREEMPTED  # the checkpoint of step 4 saved without its evaluation
    losses = iter([1.0, 7.0, 8.0])  # step 4 at the resume, then 8 and 12
    monkeypatch.setattr("sftjob_trainer.train.evaluate", lambda *args, **kwargs: (next(losses), 0.01))
    assert run(str(config)) == ExitCode.OK
    summary = _summary(config)
    assert summary["resumedFromStep"] == 4 and summary["outputStep"] == 4


def test_a_short_run_without_one_finite_loss_still_ends_with_its_termination_message(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, termination_log: Path
) -> None:
    from dataclasses import replace

    from sftjob_trainer import train

    real = train.train_step
    monkeypatch.setattr(
        "sftjob_trainer.train.train_step",
        lambda *args, **kwargs: replace(real(*args, **kwargs), loss=float("nan"), skipped="non-finite"),
    )
    assert run(str(trainer_config("messages", training={"maxSteps": 3}))) == ExitCode.OK
    assert "completed 3 steps, final loss n/a" in termination_log.read_text()


def _evaluated_steps(config: Path) -> list[int]:
    log = Path(json.loads(config.read_text())["outputDir"]) / "train_log.jsonl"
    return [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "evalLoss" in r]


def test_a_run_preempted_between_two_evaluations_stops_early_at_the_step_the_uninterrupted_run_does(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Evaluated at the checkpoints of steps 4, 8, 12 and 16; with minDelta 100 none after the first improves,
    # so patience 2 runs out at step 12.
    overrides: dict[str, Any] = {
        "training": {"maxSteps": 16},
        "checkpoints": {"everySteps": 4, "keep": 5},
        "evaluation": {"fraction": 0.1, "earlyStopping": {"patience": 2, "minDelta": 100}},
    }
    uninterrupted = trainer_config("messages", name="uninterrupted", **overrides)
    assert run(str(uninterrupted)) == ExitCode.OK
    expected = _summary(uninterrupted)
    assert expected["stoppedEarly"] and expected["steps"] == 12
    assert _evaluated_steps(uninterrupted) == [4, 8, 12]

    from sftjob_trainer import train

    real, steps = train.train_step, []

    def preempted_at_step_6(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        steps.append(1)
        if len(steps) == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # the pod is deleted during step 6
        return result

    interrupted = trainer_config("messages", name="interrupted", **overrides)
    monkeypatch.setattr(train, "train_step", preempted_at_step_6)
    assert run(str(interrupted)) == ExitCode.PREEMPTED  # its save of step 6 is not evaluated
    monkeypatch.setattr(train, "train_step", real)
    assert run(str(interrupted)) == ExitCode.OK
    got = _summary(interrupted)
    assert got["resumedFromStep"] == 6
    assert (got["stoppedEarly"], got["steps"], got["evalStep"]) == (True, 12, 12)
    assert _evaluated_steps(interrupted) == [4, 8, 12]  # none at step 6, which would have stopped it at 8
