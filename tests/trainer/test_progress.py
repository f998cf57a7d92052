"""When rank 0 reports progress: at logging steps, after a report interval of slow steps, and once per
setup phase, so the operator's stall clock (restartPolicy.stallTimeoutSeconds) only fires on a hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sftjob.config import TrainerConfig
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, PROGRESS_REPORT_INTERVAL_SECONDS
from sftjob.failures import ExitCode
from sftjob_trainer import observer as observer_module
from sftjob_trainer.batching import Course, Schedule, make_units
from sftjob_trainer.checkpoints import STATE_FILE, TrainState, checkpoint_dirs
from sftjob_trainer.data import Example
from sftjob_trainer.data_order import expected_course
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.flops import FlopsModel
from sftjob_trainer.loop import StepResult
from sftjob_trainer.metrics import TrainerMetrics
from sftjob_trainer.observer import Observer
from sftjob_trainer.train import run
from tests.trainer.runs import ONE_PACKED_EPOCH, MakeConfig, killed_at, train_log

pytestmark = pytest.mark.trainer

TOKENS_PER_STEP = 1000


class Recorder:
    """Stands in for ProgressReporter: keeps every progress record in the order it was sent."""

    def __init__(self) -> None:
        self.progress_records: list[dict[str, Any]] = []
        self.checkpoints: list[tuple[int, float | None]] = []  # (step, eval loss)
        self.bests: list[dict[str, Any] | None] = []  # the best checkpoint each checkpoint report names

    def progress(self, record: dict[str, Any]) -> None:
        self.progress_records.append(record)

    def checkpoint(
        self,
        step: int,
        path: str,
        saved_at: float | None = None,
        eval_loss: float | None = None,
        best: dict[str, Any] | None = None,
    ) -> None:
        self.checkpoints.append((step, eval_loss))
        self.bests.append(best)

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: recorder)
    return recorder


def _observer(
    tmp_path: Path,
    clock: Clock,
    every: int = 10,
    total: int | None = 100,
    evaluation: dict[str, Any] | None = None,
) -> Observer:
    config = TrainerConfig.model_validate(
        {
            "model": {"path": str(tmp_path / "model")},
            "dataset": {"path": str(tmp_path / "data.jsonl")},
            "training": {"loggingEverySteps": every, "globalBatchSize": 1},
            "outputDir": str(tmp_path),
            "report": {"metricsPort": None},
            "evaluation": evaluation,
        }
    )
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"))
    schedule = Schedule(units=1000, micro_batch_size=1, accumulation=1, world_size=1, seed=0)
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    return Observer(config, ctx, metrics, None, total, schedule, clock=clock)


def _step(observer: Observer, clock: Clock, step: int, seconds: float) -> None:
    clock.now += seconds
    result = StepResult(
        loss=1.0, grad_norm=0.5, learning_rate=1e-4, tokens=TOKENS_PER_STEP, samples=4, attention_pairs=0
    )
    observer.step(TrainState(step=step), result, seconds, 0.0, FlopsModel(6.0, 0.0))


def test_slow_steps_are_reported_before_the_next_would_leave_an_interval_without_a_report(
    tmp_path: Path, recorder: Recorder
) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10)
    for step in range(1, 7):
        _step(observer, clock, step, PROGRESS_REPORT_INTERVAL_SECONDS * 0.3)
    # Steps end 0.3, 0.6, 0.9 ... intervals in: waiting past step 3 would leave 1.2 intervals unreported.
    assert [r["step"] for r in recorder.progress_records] == [3, 6]
    assert [r["step"] for r in map(json.loads, (tmp_path / "train_log.jsonl").read_text().splitlines())] == [
        3,
        6,
    ]


def test_an_evaluation_is_reported_at_once_and_in_every_report_after_it_and_with_its_checkpoint(
    tmp_path: Path, recorder: Recorder
) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10, total=30)
    for step in range(1, 11):
        _step(observer, clock, step, 0.1)
    state = TrainState(step=10, loss=1.0, eval_loss=2.5, eval_step=10)
    observer.evaluating()
    observer.evaluated(state, 3.0)
    observer.checkpoint_saved(state, "/checkpoints/checkpoint-10", 1.0)
    for step in range(11, 21):
        _step(observer, clock, step, 0.1)
    observer.checkpoint_saved(
        TrainState(step=20, eval_loss=2.5, eval_step=10), "/checkpoints/checkpoint-20", 1.0
    )
    step_10, again, step_20 = recorder.progress_records
    assert "evalLoss" not in step_10
    assert again == step_10 | {"evalLoss": 2.5, "evalStep": 10}  # the step's figures kept
    assert (step_20["step"], step_20["evalLoss"], step_20["evalStep"]) == (20, 2.5, 10)
    assert recorder.checkpoints == [(10, 2.5), (20, None)]  # checkpoint 20's weights were not evaluated
    assert (
        observer.metrics.registry.get_sample_value("sftjob_train_eval_loss", {"sftjob": "run", "gpu": "cpu"})
        == 2.5
    )
    lines = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert {"step": 10, "evalLoss": 2.5, "evalSeconds": 3.0} in lines


@pytest.mark.parametrize("final_model", ["Last", "Best"])
def test_the_best_checkpoint_is_reported_only_when_the_rotation_keeps_it(
    tmp_path: Path, recorder: Recorder, final_model: str
) -> None:
    observer = _observer(tmp_path, Clock(), evaluation={"fraction": 0.1, "finalModel": final_model})
    state = TrainState(step=20, eval_step=20, eval_loss=2.0, best_step=10, best_eval_loss=1.5)
    observer.checkpoint_saved(state, "/checkpoints/checkpoint-20", 1.0)
    resumed = tmp_path / "checkpoints" / "checkpoint-20"
    resumed.mkdir(parents=True)
    (resumed / CHECKPOINT_COMPLETE_MARKER).write_text("step 20\n")
    observer.resumed_from(state, resumed)

    if final_model == "Last":  # rotated like any other: a path in the report could name a folder gone
        assert recorder.bests == [None, None]
    else:
        assert recorder.bests == [
            {"step": 10, "path": "/checkpoints/checkpoint-10", "evalLoss": 1.5},
            {"step": 10, "path": str(resumed.parent / "checkpoint-10"), "evalLoss": 1.5},
        ]
    assert recorder.checkpoints == [(20, 2.0), (20, 2.0)]


def test_fast_steps_are_reported_only_at_logging_steps(tmp_path: Path, recorder: Recorder) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10, total=25)
    for step in range(1, 26):
        _step(observer, clock, step, 0.1)
    assert [r["step"] for r in recorder.progress_records] == [10, 20, 25]


def test_the_rates_of_a_time_based_report_cover_every_step_since_the_previous_report(
    tmp_path: Path, recorder: Recorder
) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10)
    _step(observer, clock, 1, 1.0)  # fast: not reported
    _step(observer, clock, 2, PROGRESS_REPORT_INTERVAL_SECONDS)  # slow: reported with step 1 in its window
    _step(observer, clock, 3, PROGRESS_REPORT_INTERVAL_SECONDS)  # a window of its own
    first, second = recorder.progress_records
    assert first["tokensPerSecond"] == round(
        2 * TOKENS_PER_STEP / (1.0 + PROGRESS_REPORT_INTERVAL_SECONDS), 1
    )
    assert second["tokensPerSecond"] == round(TOKENS_PER_STEP / PROGRESS_REPORT_INTERVAL_SECONDS, 1)


def test_a_setup_phase_restarts_the_report_interval(tmp_path: Path, recorder: Recorder) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10)
    clock.now += 10 * PROGRESS_REPORT_INTERVAL_SECONDS  # a long model load
    observer.phase("model loaded", 0)
    _step(observer, clock, 1, PROGRESS_REPORT_INTERVAL_SECONDS / 4)
    assert recorder.progress_records == [
        {"step": 0, "totalSteps": 100, "epoch": 0.0, "phase": "model loaded"}
    ]


def test_setup_phases_are_reported_before_the_first_step(
    trainer_config: MakeConfig, recorder: Recorder
) -> None:
    config = trainer_config("messages", training={"maxSteps": 6, "loggingEverySteps": 100})
    assert run(str(config)) == ExitCode.OK
    phases = [(r["phase"], r["step"]) for r in recorder.progress_records if "phase" in r]
    assert phases == [("data ready", 0), ("model loaded", 0), ("starting", 0)]
    assert recorder.progress_records[3:] == [r for r in recorder.progress_records if "phase" not in r]
    assert [r["step"] for r in recorder.progress_records[3:]] == [6]  # fast steps: the last one only
    assert list(train_log(config)) == [6]


def test_a_restart_reports_the_step_it_resumes_from_while_it_loads(
    trainer_config: MakeConfig, recorder: Recorder
) -> None:
    config = trainer_config("text", training={"maxSteps": 5}, checkpoints={"everySteps": 2})
    assert run(str(config)) == ExitCode.OK  # checkpoints at steps 2 and 4, and 5 (an adapter's last)
    recorder.progress_records.clear()
    settings = json.loads(config.read_text())
    settings["training"]["maxSteps"] = 6
    config.write_text(json.dumps(settings))
    assert run(str(config)) == ExitCode.OK
    phases = [(r["phase"], r["step"]) for r in recorder.progress_records if "phase" in r]
    assert phases == [("data ready", 5), ("model loaded", 5), ("resumed", 5)]
    assert recorder.progress_records[2]["loss"] > 0


def test_a_resume_after_a_replan_reports_the_total_and_epoch_of_its_course_from_the_first_setup_report(
    trainer_config: MakeConfig, recorder: Recorder
) -> None:
    config = trainer_config("messages", **ONE_PACKED_EPOCH)
    assert run(str(config)) == ExitCode.OK
    settings = killed_at(config, 6)
    settings["training"]["packingLength"] = 64  # an OOM re-plan halved the rows: twice the steps an epoch
    config.write_text(json.dumps(settings))
    recorder.progress_records.clear()
    assert run(str(config)) == ExitCode.OK
    setup = [r for r in recorder.progress_records if "phase" in r]
    assert [r["phase"] for r in setup] == ["data ready", "model loaded", "resumed"]
    summary = json.loads((Path(settings["outputDir"]) / "summary.json").read_text())
    resumed = setup[-1]
    assert resumed["totalSteps"] == summary["totalSteps"] and 0 < resumed["epoch"] < 1
    for record in setup[:2]:
        assert (record["step"], record["totalSteps"], record["epoch"]) == (
            6,
            summary["totalSteps"],
            resumed["epoch"],
        )


def test_setup_reports_leave_the_total_and_epoch_out_until_the_course_is_known(
    tmp_path: Path, recorder: Recorder
) -> None:
    observer = _observer(tmp_path, Clock(), total=None)  # the newest checkpoint's state did not read
    observer.phase("data ready", 40)
    observer.follow(Schedule(1000, 1, 1, 1, 0, offset=10), 90)  # restored: its course
    observer.phase("resumed", 40)
    assert recorder.progress_records == [
        {"step": 40, "phase": "data ready"},
        {"step": 40, "totalSteps": 90, "epoch": 0.05, "phase": "resumed"},
    ]


def test_the_expected_course_is_unknown_when_the_newest_checkpoints_state_does_not_read(
    trainer_config: MakeConfig,
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2})
    assert run(str(config)) == ExitCode.OK
    settings = TrainerConfig.model_validate_json(config.read_text())
    root = Path(settings.checkpoints.dir)
    units = make_units([Example(np.ones(4, np.int32), np.ones(4, np.int32), row) for row in range(16)], None)
    schedule = Schedule(len(units), 4, 2, 1, 0)

    def expected(folder: Path) -> tuple[Course, Schedule] | None:
        return expected_course(folder, settings.training, 4, units, schedule, None)

    known = expected(root)
    assert known is not None and known[0] == Course.fresh(4)
    ((_, newest), *_) = checkpoint_dirs(root)
    (newest / STATE_FILE).write_text("{")  # cut off: the resume skips it
    assert expected(root) is None
    assert expected(root / "none-yet") == (Course.fresh(4), schedule)


def test_a_run_without_evaluation_exports_no_eval_loss() -> None:
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    labels = {"sftjob": "run", "gpu": "cpu"}
    assert metrics.registry.get_sample_value("sftjob_train_eval_loss", labels) is None


def test_a_long_evaluation_repeats_the_last_report_every_interval(tmp_path: Path, recorder: Recorder) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10, total=30)
    for step in range(1, 11):
        _step(observer, clock, step, 0.1)
    observer.evaluating()
    for _ in range(5):  # batches of a third of an interval each
        clock.now += PROGRESS_REPORT_INTERVAL_SECONDS / 3
        observer.still_evaluating()
    assert [r["step"] for r in recorder.progress_records] == [10, 10]


def test_no_eta_is_exported_before_the_first_logging_window(tmp_path: Path, recorder: Recorder) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10, total=30)
    labels = {"sftjob": "run", "gpu": "cpu"}
    assert observer.metrics.registry.get_sample_value("sftjob_train_eta_seconds", labels) is None
    for step in range(1, 11):
        _step(observer, clock, step, 0.1)
    assert observer.metrics.registry.get_sample_value("sftjob_train_eta_seconds", labels) == pytest.approx(
        2.0
    )


def test_the_eta_counts_the_evaluations_and_saves_between_steps_but_the_token_rate_does_not(
    tmp_path: Path, recorder: Recorder
) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=10, total=100)
    observer.training_started()
    for step in range(1, 61):
        _step(observer, clock, step, 2.0)
        if step == 50:
            clock.now += 60.0  # an evaluation and a save after step 50
    report = recorder.progress_records[-1]
    assert report["step"] == 60
    assert report["etaSeconds"] == 40 * (2.0 + 60.0 / 60)  # the minute spread over the 60 steps so far
    assert report["tokensPerSecond"] == TOKENS_PER_STEP / 2.0  # what the steps compute
    labels = {"sftjob": "run", "gpu": "cpu"}
    assert observer.metrics.registry.get_sample_value("sftjob_train_eta_seconds", labels) == 120.0


def test_a_nan_loss_is_written_to_the_train_log_as_null(tmp_path: Path, recorder: Recorder) -> None:
    clock = Clock()
    observer = _observer(tmp_path, clock, every=1)
    clock.now += 1.0
    diverged = StepResult(
        loss=float("nan"), grad_norm=float("inf"), learning_rate=1e-4, tokens=1, samples=1, attention_pairs=0
    )
    observer.step(TrainState(step=1), diverged, 1.0, 0.0, FlopsModel(6.0, 0.0))
    observer.evaluated(TrainState(step=1, eval_loss=float("nan"), eval_step=1), 1.0)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    lines = (tmp_path / "train_log.jsonl").read_text().splitlines()
    step, evaluation = (json.loads(line, parse_constant=refuse) for line in lines)
    assert (step["loss"], step["gradNorm"], evaluation["evalLoss"]) == (None, None, None)
