"""The heartbeats. While a setup phase downloads from the hub, rank 0 reports each growth of the hub
cache, so a long download never looks stalled to the operator; a download that stops growing sends
nothing, so the stall clock still ends a hung one. While a checkpoint is saved or restored, or the output
written, rank 0 repeats its last report, for at most a bound from the checkpoint's size, after which
the stall clock ends one that hangs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode
from sftjob_trainer import checkpoints, heartbeat, output, resume
from sftjob_trainer import observer as observer_module
from sftjob_trainer.batching import Schedule
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.heartbeat import (
    BUSY_BASE_SECONDS,
    DownloadHeartbeat,
    busy,
    downloads,
    folder_bytes,
    hub_folders,
    io_seconds,
    weights_seconds,
)
from sftjob_trainer.metrics import Phase, TrainerMetrics
from sftjob_trainer.observer import Observer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

INTERVAL = 0.01


def _wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(INTERVAL)


def _wait_for(reports: list[Any], count: int) -> None:
    _wait_until(lambda: len(reports) >= count)


def _grow(blob: Path, size: int) -> None:
    with blob.open("ab") as fh:
        fh.write(b"x" * size)


class Recorder:
    """Stands in for ProgressReporter: keeps every progress record."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def progress(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def checkpoint(self, step: int, path: str, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _config(tmp_path: Path, model: dict[str, str], dataset: dict[str, str]) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "model": model,
            "dataset": dataset,
            "training": {"globalBatchSize": 1},
            "outputDir": str(tmp_path / "out"),
            "checkpoints": {"dir": str(tmp_path / "checkpoints")},
            "report": {"metricsPort": None},
        }
    )


def test_a_growing_cache_is_reported_with_growing_byte_counts(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "abc.incomplete"
    blob.parent.mkdir()
    _grow(blob, 100)  # an earlier attempt's bytes: no progress of this one
    sizes: list[int] = []
    with DownloadHeartbeat({"org/model": blob.parent}, sizes.append, INTERVAL):
        for reports in (1, 2, 3):
            _grow(blob, 100)
            _wait_for(sizes, reports)
    assert sizes == [200, 300, 400]


def test_a_cache_that_does_not_grow_sends_nothing(tmp_path: Path) -> None:
    (tmp_path / "blobs").mkdir()
    _grow(tmp_path / "blobs" / "abc.incomplete", 100)
    sizes: list[int] = []
    with DownloadHeartbeat(
        {"org/model": tmp_path / "blobs", "org/data": tmp_path / "missing"}, sizes.append, INTERVAL
    ):
        time.sleep(20 * INTERVAL)
    assert sizes == []


def test_the_heartbeat_stops_when_the_phase_ends(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "abc.incomplete"
    blob.parent.mkdir()
    sizes: list[int] = []
    beat = DownloadHeartbeat({"org/model": blob.parent}, sizes.append, INTERVAL)
    with pytest.raises(RuntimeError), beat:
        _grow(blob, 10)
        _wait_for(sizes, 1)
        raise RuntimeError("the load failed")
    assert not beat.running
    _grow(blob, 10)
    time.sleep(10 * INTERVAL)
    assert sizes == [10]


def test_the_cache_folders_are_the_hub_repos_of_the_phase(tmp_path: Path) -> None:
    config = _config(tmp_path, {"name": "meta-llama/Llama-3.1-70B"}, {"name": "org/chats"})
    assert hub_folders(config, Phase.LOADING_DATA, tmp_path) == {
        "meta-llama/Llama-3.1-70B": tmp_path / "models--meta-llama--Llama-3.1-70B" / "blobs",
        "org/chats": tmp_path / "datasets--org--chats" / "blobs",
    }
    assert list(hub_folders(config, Phase.LOADING_MODEL, tmp_path)) == ["meta-llama/Llama-3.1-70B"]
    local = _config(tmp_path, {"path": str(tmp_path / "model")}, {"path": str(tmp_path / "data.jsonl")})
    assert hub_folders(local, Phase.LOADING_DATA, tmp_path) == {}


def test_a_data_download_on_rank_0_is_reported_through_a_reporter_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    monkeypatch.setattr(heartbeat, "ProgressReporter", lambda settings: recorder)
    config = _config(tmp_path, {"path": str(tmp_path / "model")}, {"name": "org/chats"})
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    blobs = tmp_path / "hub" / "datasets--org--chats" / "blobs"
    blobs.mkdir(parents=True)
    with downloads(config, Phase.LOADING_DATA, metrics, hub_cache=tmp_path / "hub", interval=INTERVAL):
        with (blobs / "abc.incomplete").open("wb") as blob:
            blob.write(bytes(2_000_000))
        _wait_for(recorder.records, 1)
    assert recorder.records == [
        {
            "step": 0,
            "phase": "loading_data",
            "message": "downloading org/chats: 2.0 MB",
            "downloadedBytes": 2_000_000,
        }
    ]
    assert recorder.closed
    gauge = metrics.registry.get_sample_value("sftjob_train_download_bytes", {"sftjob": "run", "gpu": "cpu"})
    assert gauge == 2_000_000


def test_a_file_whose_length_is_set_first_counts_the_bytes_written_into_it(tmp_path: Path) -> None:
    blob = tmp_path / "blobs" / "abc.incomplete"
    blob.parent.mkdir()
    with blob.open("wb") as fh:
        fh.truncate(35_200_000_000)  # sparse: the length, none of the bytes
    sizes: list[int] = []
    with DownloadHeartbeat({"org/model": blob.parent}, sizes.append, INTERVAL):
        with blob.open("r+b") as fh:
            fh.write(bytes(1_048_576))
            fh.flush()
            os.fsync(fh.fileno())
        _wait_for(sizes, 1)
    assert sizes == [1_048_576]


def _heartbeats() -> int:
    return _threads("download-heartbeat")


def test_other_ranks_and_local_models_watch_nothing(tmp_path: Path) -> None:
    hub = _config(tmp_path, {"name": "org/model"}, {"name": "org/chats"})
    local = _config(tmp_path, {"path": str(tmp_path / "model")}, {"path": str(tmp_path / "data.jsonl")})
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    with downloads(hub, Phase.LOADING_DATA, None, hub_cache=tmp_path):  # not rank 0: no metrics
        assert _heartbeats() == 0
    with downloads(local, Phase.LOADING_MODEL, metrics, hub_cache=tmp_path):
        assert _heartbeats() == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _observer(tmp_path: Path, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> Observer:
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: recorder)
    config = _config(tmp_path, {"path": str(tmp_path / "model")}, {"path": str(tmp_path / "data.jsonl")})
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"))
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    observer = Observer(config, ctx, metrics, None, 100, Schedule(1000, 1, 1, 1, 0))
    observer.phase("resumed", 40, 1.25)
    return observer


def test_a_long_save_repeats_the_last_report_every_interval_saying_what_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    observer = _observer(tmp_path, recorder, monkeypatch)
    with busy(observer, "saving the checkpoint of step 40", seconds=3600, interval=INTERVAL):
        _wait_for(recorder.records, 4)
    resumed, *beats = recorder.records
    assert beats[0] == resumed | {"phase": "saving the checkpoint of step 40"}
    assert all(beat == beats[0] for beat in beats)
    sent = len(recorder.records)
    time.sleep(10 * INTERVAL)
    assert len(recorder.records) == sent  # none after the save


def test_a_save_that_outlasts_its_bound_stops_reporting_so_the_stall_timeout_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    observer = _observer(tmp_path, recorder, monkeypatch)
    clock = Clock()
    with busy(observer, "saving the checkpoint of step 40", seconds=600, interval=INTERVAL, clock=clock):
        _wait_for(recorder.records, 3)
        clock.now = 600.0  # the save hangs past its bound
        _wait_until(lambda: _threads("busy-heartbeat") == 0)
        sent = len(recorder.records)
        time.sleep(10 * INTERVAL)
        assert len(recorder.records) == sent


def test_other_ranks_keep_no_busy_heartbeat() -> None:
    with busy(None, "saving the checkpoint of step 40", seconds=3600, interval=INTERVAL):
        assert _threads("busy-heartbeat") == 0


def test_the_bound_of_a_save_grows_with_the_trainable_weights_and_their_optimizer_state() -> None:
    gib_of_weights = torch.nn.Linear(16384, 16384, bias=False, device="meta")  # 2**28 fp32 weights
    assert io_seconds(gib_of_weights) == BUSY_BASE_SECONDS + 3 * heartbeat.BUSY_SECONDS_PER_GIB
    gib_of_weights.requires_grad_(False)  # frozen: a LoRA run's base is in no checkpoint
    assert io_seconds(gib_of_weights) == BUSY_BASE_SECONDS


def test_saves_restores_and_the_output_of_a_run_are_reported_while_they_run(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: recorder)
    monkeypatch.setattr(heartbeat, "PROGRESS_REPORT_INTERVAL_SECONDS", INTERVAL)
    for module, name in ((checkpoints, "save"), (resume, "load_latest"), (output, "save")):
        monkeypatch.setattr(module, name, _slow(getattr(module, name)))
    config = trainer_config(training={"maxSteps": 2}, checkpoints={"everySteps": 1})
    assert run(str(config)) == ExitCode.OK
    phases = {record.get("phase") for record in recorder.records}
    assert {
        "restoring the newest checkpoint",
        "saving the checkpoint of step 1",
        "saving the checkpoint of step 2",
        "writing the output",
    } <= phases


def test_a_slow_read_of_the_base_weights_from_a_local_folder_keeps_reporting_progress(
    trainer_config: MakeConfig, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    recorder = Recorder()
    monkeypatch.setattr(observer_module, "ProgressReporter", lambda settings: recorder)
    monkeypatch.setattr(heartbeat, "PROGRESS_REPORT_INTERVAL_SECONDS", INTERVAL)
    # Reading a 70B model from NFS: minutes in which no file grows.
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _slow(AutoModelForCausalLM.from_pretrained))
    config = trainer_config(training={"maxSteps": 1})
    assert run(str(config)) == ExitCode.OK
    phases = [record["phase"] for record in recorder.records if "phase" in record]
    setup = phases[: phases.index("starting") + 1]
    reading = f"loading the weights of {tiny_model}"
    assert setup[0] == "data ready" and setup[-2:] == ["model loaded", "starting"]
    assert set(setup[1:-2]) == {reading} and len(setup) >= 5
    assert all(r["step"] == 0 and r["totalSteps"] == 1 for r in recorder.records if r.get("phase") == reading)


def _weights_config(tmp_path: Path, model: dict[str, str]) -> TrainerConfig:
    return _config(tmp_path, model, {"path": str(tmp_path / "data.jsonl")})


def _beats(recorder: Recorder, doing: str) -> int:
    return sum(record.get("phase") == doing for record in recorder.records)


def test_a_read_of_local_weights_reports_for_a_bound_from_their_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(3_000_000))
    (model / "config.json").write_text("{}")
    size = 3_000_002
    assert folder_bytes(model) == size
    recorder = Recorder()
    observer = _observer(tmp_path, recorder, monkeypatch)
    config = _weights_config(tmp_path, {"path": str(model)})
    clock, doing = Clock(), f"loading the weights of {model}"
    metrics = observer.metrics
    with downloads(
        config, Phase.LOADING_MODEL, metrics, observer, tmp_path / "hub", INTERVAL, weights=True, clock=clock
    ):
        _wait_until(lambda: _beats(recorder, doing) >= 2)
        clock.now = weights_seconds(size) - 1
        sent = _beats(recorder, doing)
        _wait_until(lambda: _beats(recorder, doing) > sent)  # still inside the bound
        clock.now = weights_seconds(size)  # the read hangs past it
        time.sleep(5 * INTERVAL)
        sent = _beats(recorder, doing)
        time.sleep(10 * INTERVAL)
        assert _beats(recorder, doing) == sent
    assert weights_seconds(140 * 10**9) == pytest.approx(BUSY_BASE_SECONDS + 1304, abs=1)  # a 70B in bf16


def test_the_read_after_a_download_is_reported_for_its_bound_from_the_last_growth_of_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    observer = _observer(tmp_path, recorder, monkeypatch)
    config = _weights_config(tmp_path, {"name": "org/model"})
    blobs = tmp_path / "hub" / "models--org--model" / "blobs"
    blobs.mkdir(parents=True)
    clock, doing = Clock(), "loading the weights of org/model"
    with downloads(
        config,
        Phase.RESTORING,
        observer.metrics,
        observer,
        tmp_path / "hub",
        INTERVAL,
        weights=True,
        clock=clock,
    ):
        clock.now = 5000.0  # a long download, all of it reported as growth
        _grow(blobs / "abc.incomplete", 1_000_000)
        _wait_until(lambda: any("downloadedBytes" in record for record in recorder.records))
        sent = _beats(recorder, doing)
        _wait_until(lambda: _beats(recorder, doing) > sent)  # the read that follows: its own bound
        clock.now = 5000.0 + weights_seconds(1_000_000)
        time.sleep(5 * INTERVAL)
        sent = _beats(recorder, doing)
        time.sleep(10 * INTERVAL)
        assert _beats(recorder, doing) == sent


def test_other_ranks_report_no_read_of_the_weights(tmp_path: Path) -> None:
    config = _weights_config(tmp_path, {"path": str(tmp_path / "model")})
    with downloads(config, Phase.LOADING_MODEL, None, None, tmp_path, INTERVAL, weights=True):
        assert _heartbeats() == 0


def _slow(real: Callable[..., Any]) -> Callable[..., Any]:
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(20 * INTERVAL)
        return real(*args, **kwargs)

    return slow


def _threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())
