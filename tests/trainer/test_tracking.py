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
from pathlib import Path
from typing import Any

import pytest

from sftjob.failures import ExitCode
from sftjob_trainer import checkpoints
from sftjob_trainer.checkpoints import TrainState
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, train_log
from tests.trainer.test_tracking_rules import PLAN, metrics_of_the_run

pytestmark = pytest.mark.trainer

UID = "0b6a3e0c-5a7e-4f7e-9d55-3f1c2a9b8e11"


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
