"""Experiment tracking (spec.tracking): what TensorBoard, MLflow and W&B get from a run, one run per job
across attempts, and trackers that fail or are not configured costing training nothing.

Only local stores: MLflow's file store, W&B offline, TensorBoard's event files; the one server address
used is a closed loopback port.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode
from sftjob_trainer import checkpoints, trackers, tracking
from sftjob_trainer.checkpoints import TrainState
from sftjob_trainer.metrics import TrainerMetrics
from sftjob_trainer.trackers import MlflowTracker, WandbTracker
from sftjob_trainer.tracking import Trackers
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, train_log
from tests.trainer.test_tracking_rules import PLAN, _bare_config, _sample, _warnings, metrics_of_the_run

pytestmark = pytest.mark.trainer

UID = "0b6a3e0c-5a7e-4f7e-9d55-3f1c2a9b8e11"


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Local stores only: MLflow's file store allowed, W&B offline in its own folder. W&B reads its
    environment once per process (a trainer's attempt is one): torn down around each test, it reads
    this one's."""
    _wandb_teardown()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in _defaulted():  # restored after the test, whatever the trainer set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp_path / "wandb").mkdir()
    # Starting and finishing are given up on after seconds in a pod; a test's run must not be, whatever the
    # machine's load.
    for module, name in (
        (trackers, "FINISH_SECONDS"),
        (tracking, "FINISH_SECONDS"),
        (tracking, "PREEMPTED_FINISH_SECONDS"),
        (trackers, "WANDB_INIT_TIMEOUT_SECONDS"),
    ):
        monkeypatch.setattr(module, name, 300.0)
    yield tmp_path
    _wandb_teardown()


def _defaulted() -> list[str]:
    """The environment variables the trainer sets before importing MLflow or W&B, unless already set."""
    return [
        *trackers.MLFLOW_HTTP_DEFAULTS,
        *(name for d in trackers.TELEMETRY_DEFAULTS.values() for name in d),
    ]


def _wandb_teardown() -> None:
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def _tracked(stores: Path, **trackers: Any) -> dict[str, Any]:
    """Config overrides for a job of uid UID sending its run to every tracker, in ``stores``."""
    settings = {
        "tensorboardDir": str(stores / "tensorboard"),
        "mlflow": {"trackingUri": f"file://{stores / 'mlruns'}"},
        "wandb": {"project": "sftjob-tests"},
    }
    return {
        "job": {"namespace": "team-a", "name": "tiny", "uid": UID, "attempt": 1},
        "tracking": settings | trackers,
    }


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each TensorBoard tag, as TensorBoard shows them (purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _mlflow(stores: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"file://{stores / 'mlruns'}")


def _mlflow_runs(stores: Path) -> list[Any]:
    client = _mlflow(stores)
    experiment = client.get_experiment_by_name("team-a")  # the job's namespace: no experiment configured
    assert experiment is not None
    return list(client.search_runs([experiment.experiment_id]))


def _history(stores: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in _mlflow(stores).get_metric_history(run_id, key))


def _wandb_records(run_folder: Path) -> list[Any]:
    """The records of an offline W&B run's ``.wandb`` file (W&B 0.31 writes no summary or config file in
    offline mode): a 7-byte header, then LevelDB-log blocks of 32 KiB holding protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _assert_close(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, with values equal to float32 precision (TensorBoard keeps float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)


class WandbRun:
    """An offline W&B run, as its ``.wandb`` file holds it."""

    def __init__(self, folder: Path) -> None:
        self.records = _wandb_records(folder)
        kinds = [r.WhichOneof("record_type") for r in self.records]
        (run,) = [r.run for r in self.records if r.WhichOneof("record_type") == "run"]
        self.id, self.name, self.project = run.run_id, run.display_name, run.project
        self.started = run.start_time.ToNanoseconds()
        self.config = {item.key: json.loads(item.value_json) for item in run.config.update}
        self.preempting = "preempting" in kinds
        (self.exit_code,) = [r.exit.exit_code for r in self.records if r.WhichOneof("record_type") == "exit"]

    def history(self, key: str) -> list[tuple[int, float]]:
        """(train/step, value) of ``key`` in the run's rows."""
        rows = []
        for record in self.records:
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                if key in row:
                    rows.append((int(row["train/step"]), float(row[key])))
        return rows


def _wandb_runs(stores: Path) -> list[WandbRun]:
    """The offline runs, one per attempt, in the order they started."""
    runs = [WandbRun(folder) for folder in (stores / "wandb" / "wandb").glob("offline-run-*")]
    return sorted(runs, key=lambda r: r.started)


def test_a_run_sends_the_same_losses_as_its_train_log_to_tensorboard_mlflow_and_wandb(
    trainer_config: MakeConfig, stores: Path
) -> None:
    config = trainer_config(
        "messages",
        training={"loggingEverySteps": 3},
        evaluation={"fraction": 0.1, "everySteps": 6},
        **_tracked(stores),
    )
    assert run(str(config)) == ExitCode.OK
    losses = train_log(config)
    assert sorted(losses) == [3, 6, 9, 12]  # the logging steps: the trackers get the same
    evals = {
        r["step"]: r["evalLoss"]
        for r in map(json.loads, (config.parent / "output" / "train_log.jsonl").read_text().splitlines())
        if "evalLoss" in r
    }
    assert sorted(evals) == [4, 6, 8, 12]  # the saves, every 6 steps and the last
    expected_loss = sorted(losses.items())
    expected_eval = sorted(evals.items())
    first = [(1, 1.0), (1, 4.0), (1, 2.0), (1, 0.0)]  # this attempt's plan, at its first step

    scalars = _scalars(stores / "tensorboard")
    _assert_close(scalars["train/loss"], expected_loss)
    _assert_close(scalars["eval/loss"], expected_eval)
    assert [scalars[key][0] for key in PLAN] == first
    for key in ("learning_rate", "grad_norm", "tokens_per_second", "mfu", "epoch", "tokens"):
        assert [step for step, _ in scalars[f"train/{key}"]] == [3, 6, 9, 12], key
    tokens = [value for _, value in scalars["train/tokens"]]
    assert tokens == sorted(tokens) and tokens[0] > 0  # cumulative

    (mlflow_run,) = _mlflow_runs(stores)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tiny"
    assert mlflow_run.data.tags["sftjob.io/uid"] == UID
    assert mlflow_run.data.tags["sftjob.io/namespace"] == "team-a"
    params = mlflow_run.data.params
    assert params["method"] == "lora" and params["lora_r"] == "8" and params["global_batch_size"] == "8"
    run_id = mlflow_run.info.run_id
    _assert_close(_history(stores, run_id, "train/loss"), expected_loss)
    _assert_close(_history(stores, run_id, "eval/loss"), expected_eval)
    assert [_history(stores, run_id, key)[0] for key in PLAN] == first

    (wandb_run,) = _wandb_runs(stores)
    assert (wandb_run.id, wandb_run.name, wandb_run.project) == (UID, "tiny", "sftjob-tests")
    assert wandb_run.config["method"] == "lora" and wandb_run.config["job"]["uid"] == UID
    _assert_close(wandb_run.history("train/loss"), expected_loss)
    _assert_close(wandb_run.history("eval/loss"), expected_eval)
    assert [wandb_run.history(key)[0] for key in PLAN] == first
    assert wandb_run.exit_code == 0 and not wandb_run.preempting


def test_a_job_resumed_below_what_it_logged_is_one_run_everywhere_and_tensorboard_shows_each_step_once(
    trainer_config: MakeConfig, stores: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config("text", checkpoints={"everySteps": 4, "keep": 3}, **_tracked(stores))
    settings = json.loads(config.read_text())
    root = Path(settings["checkpoints"]["dir"])

    def attempt(number: int, **training: int) -> None:
        settings["job"]["attempt"] = number
        settings["training"] |= training
        config.write_text(json.dumps(settings))

    # Attempt 1 logs all 12 steps; its checkpoints after step 4 are then lost: as if it was killed after
    # step 12 with checkpoint-4 its newest, so attempt 2 logs steps 5 to 8 again.
    assert run(str(config)) == ExitCode.OK
    for step in (8, 12):
        shutil.rmtree(root / f"checkpoint-{step}")

    # Attempt 2, re-planned (half the micro batch, twice the accumulation), is preempted saving step 8.
    def save(root: Path, state: TrainState, *args: Any, **kwargs: Any) -> Path:
        if state.step == 8:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(root, state, *args, **kwargs)

    real_save = checkpoints.save
    attempt(2, microBatchSize=2, gradientAccumulationSteps=4)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "save", save)
        assert run(str(config)) == ExitCode.PREEMPTED
    (mlflow_run,) = _mlflow_runs(stores)
    assert mlflow_run.info.status == "KILLED"

    attempt(3)  # resumes from step 8
    assert run(str(config)) == ExitCode.OK
    losses = sorted(train_log(config).items())  # each step's latest loss: what the last attempts trained
    assert [step for step, _ in losses] == list(range(1, 13))

    scalars = _scalars(stores / "tensorboard")
    _assert_close(scalars["train/loss"], losses)  # steps 5 to 12 of attempt 1 purged
    assert scalars["attempt"] == [(1, 1.0), (5, 2.0), (9, 3.0)]
    assert scalars["plan/micro_batch_size"] == [(1, 4.0), (5, 2.0), (9, 2.0)]
    assert scalars["plan/gradient_accumulation_steps"] == [(1, 2.0), (5, 4.0), (9, 4.0)]

    (mlflow_run,) = _mlflow_runs(stores)
    assert mlflow_run.info.status == "FINISHED"
    run_id = mlflow_run.info.run_id
    assert _history(stores, run_id, "attempt") == [(1, 1.0), (5, 2.0), (9, 3.0)]
    assert {step for step, _ in _history(stores, run_id, "train/loss")} == set(range(1, 13))

    runs = _wandb_runs(stores)
    assert [(r.id, r.exit_code, r.preempting) for r in runs] == [
        (UID, 0, False),
        (UID, 1, True),
        (UID, 0, False),
    ]
    assert [r.history("attempt") for r in runs] == [[(1, 1.0)], [(5, 2.0)], [(9, 3.0)]]
    _assert_close(runs[2].history("train/loss"), losses[8:])


def test_trackers_that_fail_to_start_are_warned_about_counted_and_dropped_while_training_completes(
    trainer_config: MakeConfig,
    stores: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    (stores / "not-a-folder").write_text("")
    config = trainer_config(
        "text",
        training={"maxSteps": 4},
        **_tracked(
            stores,
            tensorboardDir=str(stores / "not-a-folder"),
            mlflow={"trackingUri": "http://127.0.0.1:9"},  # the discard port: nothing listens
        ),
    )
    started = metrics_of_the_run(monkeypatch)
    began = time.monotonic()
    assert run(str(config)) == ExitCode.OK
    assert time.monotonic() - began < 60
    assert sorted(train_log(config)) == [1, 2, 3, 4]

    warnings = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "tracker" in r.getMessage()
    ]
    assert len(warnings) == 2
    assert "experiment tracker tensorboard failed to start" in warnings[0]
    assert "not-a-folder" in warnings[0]
    assert "experiment tracker mlflow failed to start" in warnings[1] and "127.0.0.1" in warnings[1]
    errors = {
        tracker: started[0].registry.get_sample_value(
            "sftjob_train_tracking_errors_total", {"sftjob": "tiny", "gpu": "cpu", "tracker": tracker}
        )
        for tracker in ("tensorboard", "mlflow", "wandb")
    }
    assert errors == {"tensorboard": 1.0, "mlflow": 1.0, "wandb": 0.0}
    (wandb_run,) = _wandb_runs(stores)  # the tracker that works goes on
    assert [step for step, _ in wandb_run.history("train/loss")] == [1, 2, 3, 4]


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
    assert {name: os.environ.get(name) for name in _defaulted()} == {
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


NO_TRACKER_LIBRARIES = """
import sys
from sftjob_trainer.train import run
code = run(sys.argv[1])
libraries = ("mlflow", "wandb", "tensorboard", "torch.utils.tensorboard")
print(int(code), [name for name in libraries if name in sys.modules])
"""


def test_a_run_without_tracking_imports_no_tracker_library(trainer_config: MakeConfig) -> None:
    config = trainer_config("text", training={"maxSteps": 2})
    done = subprocess.run(
        [sys.executable, "-c", NO_TRACKER_LIBRARIES, str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.stdout.strip().splitlines()[-1:] == ["0 []"], done.stderr[-3000:]
