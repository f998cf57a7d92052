"""MLflow under spec.tracking, against its real client and a local file store: batches sent in the
background and their failures, the run always ended, parameters logged once, short requests and no
telemetry, a deleted experiment named."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path

import pytest

from sftjob.config import TrainerConfig
from sftjob_trainer import tracking
from sftjob_trainer.metrics import TrainerMetrics
from sftjob_trainer.trackers import MlflowTracker, WandbTracker
from sftjob_trainer.tracking import Trackers
from tests.trainer.test_tracking import UID, _history, _mlflow
from tests.trainer.test_tracking_rules import _bare_config, _sample, _warnings

pytestmark = pytest.mark.trainer


def test_mlflow_batches_failing_in_the_background_are_noticed_at_later_logs_and_the_run_is_ended_after_a_drop(
    stores: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _bare_config(mlflow={"trackingUri": f"file://{stores / 'mlruns'}", "experiment": "e"})
    assert config.tracking.mlflow is not None
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    tracker = MlflowTracker(config.tracking.mlflow, config)
    trackers = Trackers(config, metrics, [tracker])
    trackers.start(0)
    assert trackers.live == ["mlflow"]

    def errors() -> float | None:
        return _sample(metrics, "sftjob_train_tracking_errors_total", "mlflow")

    def settle() -> None:
        """Every batch sent so far answered (MLflow's file store takes milliseconds)."""
        futures.wait(tracker._checks, timeout=30)

    def log_until(done: Callable[[], bool], step: int) -> None:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)
            trackers.log(step, {"train/loss": 1.0})
        assert done()

    # A batch MLflow refuses fails in its thread: the failure comes at a later log, the tracker is kept.
    trackers.log(1, {"bad\x00name": 1.0})  # returns at once
    log_until(lambda: errors() == 1.0, 2)
    assert trackers.live == ["mlflow"]
    assert "experiment tracker mlflow failed to log (1 in a row, dropped at 3" in caplog.text
    settle()
    trackers.log(2, {"train/loss": 1.0})  # learns that the batches since got through: the count starts again
    settle()

    # The store goes away: every batch fails, and the third failure in a row drops MLflow.
    os.rename(stores / "mlruns", stores / "away")
    log_until(lambda: not trackers.live, 3)
    assert errors() == 4.0
    assert "experiment tracker mlflow failed to log 3 times in a row, dropped" in caplog.text
    assert _sample(metrics, "sftjob_train_tracking_active", "mlflow") == 0.0

    # It comes back before the attempt ends: the dropped tracker's run is ended all the same.
    os.rename(stores / "away", stores / "mlruns")
    trackers.finish("failed")
    client = _mlflow(stores)
    experiment = client.get_experiment_by_name("e")
    assert experiment is not None
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.status == "FAILED"
    assert {step for step, _ in _history(stores, mlflow_run.info.run_id, "train/loss")} >= {2}
    assert errors() == 4.0  # the batches that failed meanwhile were counted when noticed, not again


def test_an_mlflow_run_is_ended_even_when_a_batch_still_being_sent_fails(stores: Path) -> None:
    config = _bare_config(mlflow={"trackingUri": f"file://{stores / 'mlruns'}", "experiment": "e"})
    assert config.tracking.mlflow is not None
    tracker = MlflowTracker(config.tracking.mlflow, config)
    tracker.start(1)
    assert tracker.log(1, {"train/loss": 1.0}) is False  # sent, not answered yet
    tracker.log(2, {"bad\x00name": 1.0})  # refused by MLflow in its thread
    tracker.finish("killed")
    experiment = _mlflow(stores).get_experiment_by_name("e")
    assert experiment is not None
    (mlflow_run,) = _mlflow(stores).search_runs([experiment.experiment_id])
    assert mlflow_run.info.status == "KILLED"


def test_an_mlflow_run_is_ended_before_the_batches_still_being_sent_are_waited_for(
    stores: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _bare_config(mlflow={"trackingUri": f"file://{stores / 'mlruns'}", "experiment": "e"})
    assert config.tracking.mlflow is not None
    tracker = MlflowTracker(config.tracking.mlflow, config)
    tracker.start(1)
    never: Future[None] = Future()  # a batch a slow server never answers before the finish is given up on
    monkeypatch.setattr(tracker, "_checks", [never])
    with pytest.raises(TimeoutError):
        tracking.within(2, "finishing mlflow", lambda: tracker.finish("failed"))
    experiment = _mlflow(stores).get_experiment_by_name("e")
    assert experiment is not None
    (mlflow_run,) = _mlflow(stores).search_runs([experiment.experiment_id])
    assert mlflow_run.info.status == "FAILED"
    never.set_result(None)


def test_a_resumed_mlflow_run_without_parameters_gets_them_from_the_next_attempt(stores: Path) -> None:
    config = TrainerConfig.model_validate(
        _bare_config(mlflow={"trackingUri": f"file://{stores / 'mlruns'}", "experiment": "e"}).model_dump()
        | {"job": {"namespace": "team-a", "name": "job", "uid": UID, "attempt": 1}}
    )
    client = _mlflow(stores)
    experiment_id = client.create_experiment("e")
    client.create_run(experiment_id, tags={"sftjob.io/uid": UID})  # its attempt failed before the parameters
    assert config.tracking.mlflow is not None
    tracker = MlflowTracker(config.tracking.mlflow, config)
    tracker.start(5)
    tracker.finish("finished")
    (mlflow_run,) = client.search_runs([experiment_id])
    assert mlflow_run.data.params["method"] == "lora" and mlflow_run.info.status == "FINISHED"


def test_the_trainer_sets_short_mlflow_timeouts_and_no_telemetry_unless_the_pods_environment_says_else(
    stores: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the pod's own (spec.env): kept
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")
    config = _bare_config(
        mlflow={"trackingUri": f"file://{stores / 'mlruns'}"}, wandb={"project": "sftjob-tests"}
    )
    assert config.tracking.mlflow is not None and config.tracking.wandb is not None
    for tracker in (
        MlflowTracker(config.tracking.mlflow, config),
        WandbTracker(config.tracking.wandb, config),
    ):
        tracker.start(1)
        tracker.finish("finished")
    names = ["MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_DISABLE_TELEMETRY"]
    assert {name: os.environ.get(name) for name in [*names, "WANDB_ERROR_REPORTING"]} == {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
        "MLFLOW_DISABLE_TELEMETRY": "false",
        "WANDB_ERROR_REPORTING": "false",
    }


def test_a_deleted_mlflow_experiment_is_named_in_the_warning_with_what_to_do(
    stores: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = _mlflow(stores)
    experiment_id = client.create_experiment("support-bot")
    client.delete_experiment(experiment_id)
    config = _bare_config(mlflow={"trackingUri": f"file://{stores / 'mlruns'}", "experiment": "support-bot"})
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    trackers = Trackers(config, metrics)
    trackers.start(0)
    assert trackers.live == [] and trackers.started == []
    assert _warnings(caplog) == [
        "experiment tracker mlflow failed to start, dropped for the rest of this attempt (training goes on):"
        " RuntimeError: MLflow experiment 'support-bot' is deleted: restore it (mlflow experiments restore"
        f" --experiment-id {experiment_id}) or name another experiment in spec.tracking.mlflow.experiment"
    ]
    assert _sample(metrics, "sftjob_train_tracking_active", "mlflow") == 0.0
