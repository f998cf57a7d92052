"""The rules the trainer holds every experiment tracker to (sftjob_trainer.tracking), with stub trackers: what
a failure costs (a warning, a count, a drop after three failed logs in a row), the gauge, the finish after a
SIGTERM, the run pages in the progress reports; the real libraries' runs are test_tracking.py's."""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import checkpoints, resume, trackers, tracking
from sftjob_trainer import observer as observer_module
from sftjob_trainer import train as train_module
from sftjob_trainer.metrics import TrainerMetrics
from sftjob_trainer.trackers import Outcome, mlflow_run_url
from sftjob_trainer.tracking import Trackers, outcome_of
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig
from tests.trainer.test_progress import Clock, Recorder, _observer, _step

pytestmark = pytest.mark.trainer

PLAN = ("attempt", "plan/micro_batch_size", "plan/gradient_accumulation_steps", "plan/gradient_checkpointing")


class Recording:
    """A tracker that records its calls, and fails the one named ``fail_on``."""

    name: ClassVar[str] = "wandb"

    def __init__(self, fail_on: str = "", url: str | None = None) -> None:
        self.fail_on, self.url = fail_on, url
        self.calls: list[tuple[str, Any]] = []

    def start(self, first_step: int) -> None:
        self._call("start", first_step)

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        self._call("log", (step, dict(values)))
        return True

    def finish(self, outcome: Outcome) -> None:
        self._call("finish", outcome)

    def _call(self, what: str, arg: Any) -> None:
        self.calls.append((what, arg))
        if what == self.fail_on:
            raise OSError(f"{what} failed")


class Failing(Recording):
    name: ClassVar[str] = "tensorboard"  # another tracker's label


class Flaky(Recording):
    """A tracker whose logs go as ``outcomes`` says, one letter a call: F fails, W works, ? is not known yet
    (MLflow before any batch it sent was answered)."""

    name: ClassVar[str] = "mlflow"

    def __init__(self, outcomes: str) -> None:
        super().__init__()
        self.outcomes = list(outcomes)

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        self.calls.append(("log", step))
        outcome = self.outcomes.pop(0)
        if outcome == "F":
            raise OSError(f"HTTP 503 at step {step}")
        return outcome == "W"


def metrics_of_the_run(monkeypatch: pytest.MonkeyPatch) -> list[TrainerMetrics]:
    """The metrics the next in-process run starts, kept for the test to read after the run."""
    started: list[TrainerMetrics] = []
    real_start_metrics = train_module.start_metrics

    def start_metrics(settings: TrainerConfig) -> TrainerMetrics | None:
        metrics = real_start_metrics(settings)
        assert metrics is not None
        started.append(metrics)
        return metrics

    monkeypatch.setattr(train_module, "start_metrics", start_metrics)
    return started


def _bare_config(**tracking_settings: Any) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": {"path": "m"},
            "dataset": {"path": "d"},
            "training": {"globalBatchSize": 1},
            "tracking": tracking_settings,
        }
    )


def _sample(metrics: TrainerMetrics, name: str, tracker: str) -> float | None:
    labels = {"sftjob": "run", "gpu": "cpu", "tracker": tracker}
    return metrics.registry.get_sample_value(name, labels)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_tracker_failing_every_log_is_warned_about_each_time_dropped_at_the_third_and_still_finished(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    works, fails = Recording(), Failing(fail_on="log")
    trackers = Trackers(_bare_config(), metrics, [fails, works])
    trackers.start(40)  # logs the plan at step 41: the first failure
    trackers.log(42, {"train/loss": math.nan, "train/grad_norm": math.inf, "train/learning_rate": 1e-4})
    trackers.log(43, {"train/loss": math.nan})  # nothing left to log: no call, no failure
    assert trackers.live == ["tensorboard", "wandb"]
    trackers.log(44, {"train/loss": 1.5})  # the third failure in a row
    assert trackers.live == ["wandb"]
    trackers.log(45, {"train/loss": 1.25})
    trackers.finish(outcome_of(None))

    plan = dict(zip(PLAN, (0.0, 1.0, 1.0, 0.0), strict=True))  # the config's defaults
    assert works.calls == [
        ("start", 41),
        ("log", (41, plan)),
        ("log", (42, {"train/learning_rate": 1e-4})),
        ("log", (44, {"train/loss": 1.5})),
        ("log", (45, {"train/loss": 1.25})),
        ("finish", "finished"),
    ]
    assert fails.calls == [  # dropped: never logged to again, but finished
        ("start", 41),
        ("log", (41, plan)),
        ("log", (42, {"train/learning_rate": 1e-4})),
        ("log", (44, {"train/loss": 1.5})),
        ("finish", "finished"),
    ]
    assert _warnings(caplog) == [
        "experiment tracker tensorboard failed to log (1 in a row, dropped at 3; training goes on): OSError:"
        " log failed",
        "experiment tracker tensorboard failed to log (2 in a row, dropped at 3; training goes on): OSError:"
        " log failed",
        "experiment tracker tensorboard failed to log 3 times in a row, dropped for the rest of this attempt"
        " (training goes on): OSError: log failed",
    ]
    assert _sample(metrics, "sftjob_train_tracking_errors_total", "tensorboard") == 3.0
    assert _sample(metrics, "sftjob_train_tracking_errors_total", "wandb") == 0.0


def test_mlflow_failing_to_log_once_or_twice_is_kept_and_dropped_after_three_failures_in_a_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The plan's log at the start, then one call a step from 2 on: a log that works starts the count again;
    # one whose outcome is not known yet (MLflow's batches in flight) leaves it as it is.
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    mlflow = Flaky("FFWF?FW?FF?F")
    trackers = Trackers(_bare_config(), metrics, [mlflow])
    trackers.start(0)
    for step in range(2, 12):
        trackers.log(step, {"train/loss": 1.0})
        assert trackers.live == ["mlflow"], step
    trackers.log(12, {"train/loss": 1.0})  # F ? F at steps 10 to 12: the third failure in a row
    assert trackers.live == []
    trackers.log(13, {"train/loss": 1.0})
    trackers.finish("failed")

    assert [call for call, _ in mlflow.calls] == ["start"] + ["log"] * 12 + ["finish"]
    assert mlflow.calls[-1] == ("finish", "failed")  # ended, dropped as it is
    assert [message.split(": OSError")[0] for message in _warnings(caplog)] == [
        "experiment tracker mlflow failed to log (1 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log (2 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log (1 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log (2 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log (1 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log (2 in a row, dropped at 3; training goes on)",
        "experiment tracker mlflow failed to log 3 times in a row, dropped for the rest of this attempt"
        " (training goes on)",
    ]
    assert _warnings(caplog)[-1].endswith(": OSError: HTTP 503 at step 12")
    assert _sample(metrics, "sftjob_train_tracking_errors_total", "mlflow") == 7.0


def test_the_tracking_active_gauge_is_1_while_a_tracker_is_logged_to_0_once_failed_or_dropped() -> None:
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    tensorboard, mlflow, wandb = Failing(fail_on="start"), Flaky("WFFF"), Recording()
    trackers = Trackers(_bare_config(), metrics, [tensorboard, mlflow, wandb])

    def active() -> dict[str, float | None]:
        return {
            name: _sample(metrics, "sftjob_train_tracking_active", name)
            for name in ("tensorboard", "mlflow", "wandb")
        }

    # Setting up (hours of downloads and loads, maybe): no series yet, so no alert; the errors are at 0.
    assert active() == {"tensorboard": None, "mlflow": None, "wandb": None}
    assert _sample(metrics, "sftjob_train_tracking_errors_total", "tensorboard") == 0.0
    trackers.start(0)
    assert active() == {"tensorboard": 0.0, "mlflow": 1.0, "wandb": 1.0}
    for step in (1, 2):
        trackers.log(step, {"train/loss": 1.0})
    assert active() == {"tensorboard": 0.0, "mlflow": 1.0, "wandb": 1.0}  # two failures: kept
    trackers.log(3, {"train/loss": 1.0})
    assert active() == {"tensorboard": 0.0, "mlflow": 0.0, "wandb": 1.0}  # the third: dropped
    trackers.finish("finished")
    assert active() == {"tensorboard": 0.0, "mlflow": 0.0, "wandb": 1.0}  # as it was: the pod ends
    assert tensorboard.calls == [("start", 1)]  # it never started: nothing to finish


def test_an_attempt_ended_by_preemption_is_killed_and_one_ended_by_any_other_error_failed() -> None:
    assert outcome_of(None) == "finished"
    assert outcome_of(TrainerError(ExitCode.PREEMPTED, "preempted (SIGTERM)")) == "killed"
    assert outcome_of(KeyboardInterrupt()) == "killed"
    assert outcome_of(TrainerError(ExitCode.CUDA_OOM, "CUDA out of memory")) == "failed"
    assert outcome_of(RuntimeError("boom")) == "failed"


@pytest.mark.parametrize(
    ("error", "sigterm", "outcome", "seconds"),
    [
        (None, False, "finished", trackers.FINISH_SECONDS),
        (RuntimeError("CUDA error: an illegal memory access"), False, "failed", trackers.FINISH_SECONDS),
        (
            TrainerError(ExitCode.PREEMPTED, "preempted (SIGTERM)"),
            True,
            "killed",
            tracking.PREEMPTED_FINISH_SECONDS,
        ),
        # torchrun SIGTERMs every rank when one ends: a collective broken by a peer's shutdown ends this one.
        (RuntimeError("NCCL communicator was aborted"), True, "killed", tracking.PREEMPTED_FINISH_SECONDS),
        # A SIGTERM after the last step: the output is written, the job completed, inside the grace period.
        (None, True, "finished", tracking.PREEMPTED_FINISH_SECONDS),
    ],
)
def test_an_attempt_that_got_sigterm_is_finished_as_killed_in_the_preempted_time_whatever_error_ended_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException | None,
    sigterm: bool,
    outcome: Outcome,
    seconds: float,
) -> None:
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: Recorder())
    budgets: list[float] = []

    def within(budget: float, doing: str, call: Callable[[], None]) -> None:
        budgets.append(budget)
        call()

    monkeypatch.setattr(tracking, "within", within)
    observer = _observer(tmp_path, Clock())
    dropped, live = Failing(fail_on="log"), Recording()
    observer.trackers = Trackers(observer.trackers.config, observer.metrics, [dropped, live])
    observer.start_tracking(0)
    for step in (1, 2):
        observer.trackers.log(step, {"train/loss": 1.0})
    assert observer.trackers.live == ["wandb"]
    observer.close(error, sigterm=sigterm)
    assert dropped.calls[-1] == live.calls[-1] == ("finish", outcome)
    assert budgets == [seconds, seconds]


def test_an_attempt_whose_collective_a_peers_shutdown_broke_after_its_sigterm_ends_its_runs_as_killed(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2})
    stub = Recording()
    budgets: list[float] = []

    def within(budget: float, doing: str, call: Callable[[], None]) -> None:
        budgets.append(budget)
        call()

    def save(*args: Any, **kwargs: Any) -> Path:
        os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("NCCL communicator was aborted on rank 0")  # a peer stopped first

    monkeypatch.setattr(tracking, "configured", lambda settings: [stub])
    monkeypatch.setattr(tracking, "within", within)
    monkeypatch.setattr(checkpoints, "save", save)
    assert run(str(config)) == ExitCode.COMMUNICATION_ERROR
    assert stub.calls[0] == ("start", 1)
    assert stub.calls[-1] == ("finish", "killed")
    assert budgets == [tracking.PREEMPTED_FINISH_SECONDS]


class Closing(Recorder):
    """The progress reporter, knowing whether its last report went out (``close``)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("ends", ["completed", "after a peer failed"])
def test_the_termination_message_and_the_last_progress_report_are_out_before_the_trackers_finish(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    # torchrun gives a rank 30 s to exit once a peer failed: finishing the trackers may take all of it.
    config = trainer_config("text", training={"maxSteps": 4}, checkpoints={"everySteps": 2})
    reporter = Closing()
    seen_at_finish: list[tuple[str | None, bool]] = []  # (the termination message, the reports closed)

    class Watching(Recording):
        def finish(self, outcome: Outcome) -> None:
            message = termination_log.read_text() if termination_log.exists() else None
            seen_at_finish.append((message, reporter.closed))
            super().finish(outcome)

    def save(*args: Any, **kwargs: Any) -> Path:
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stops this rank
        raise RuntimeError("NCCL communicator was aborted on rank 0")  # a peer stopped first

    stub = Watching()
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: reporter)
    monkeypatch.setattr(tracking, "configured", lambda settings: [stub])
    if ends == "completed":
        assert run(str(config)) == ExitCode.OK
        expected = "completed 4 steps"
    else:
        monkeypatch.setattr(checkpoints, "save", save)
        assert run(str(config)) == ExitCode.COMMUNICATION_ERROR
        expected = "NCCL communicator was aborted on rank 0"
    ((message, closed),) = seen_at_finish
    assert message is not None and expected in message
    assert closed
    assert stub.calls[-1][0] == "finish"


def test_no_tracker_is_started_once_a_sigterm_came_before_they_start(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 4})
    stub = Recording()
    started = metrics_of_the_run(monkeypatch)

    def restore(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # while the checkpoint loads, just before the trackers start
        return real_restore(*args, **kwargs)

    caplog.set_level(logging.INFO, logger="sftjob_trainer")
    real_restore = resume.restore
    monkeypatch.setattr(tracking, "configured", lambda settings: [stub])
    monkeypatch.setattr(resume, "restore", restore)
    assert run(str(config)) == ExitCode.PREEMPTED
    assert stub.calls == []
    assert "SIGTERM received: experiment tracker wandb not started" in caplog.text
    labels = {"sftjob": "tiny", "gpu": "cpu", "tracker": "wandb"}
    assert started[0].registry.get_sample_value("sftjob_train_tracking_active", labels) is None
    assert started[0].registry.get_sample_value("sftjob_train_tracking_errors_total", labels) == 0.0


def test_the_progress_reports_link_the_runs_of_the_trackers_that_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: recorder)
    clock = Clock()
    observer = _observer(tmp_path, clock, every=5, total=10)
    page = "https://wandb.ai/my-team/support-bot/runs/uid-1"
    observer.trackers = Trackers(observer.trackers.config, observer.metrics, [Failing(), Recording(url=page)])
    _step(observer, clock, 5, 0.1)
    observer.start_tracking(5)
    _step(observer, clock, 10, 0.1)
    before, *_, after = recorder.progress_records
    assert "trackingUrls" not in before
    assert after["trackingUrls"] == {"wandb": page}  # TensorBoard (Failing's label) has no page
    assert (
        mlflow_run_url("http://mlflow.mlops:5000/", "3", "abc")
        == "http://mlflow.mlops:5000/#/experiments/3/runs/abc"
    )
    assert mlflow_run_url("file:///tmp/mlruns", "3", "abc") is None  # no UI
