"""The download heartbeat: while a setup phase downloads from the hub, rank 0 reports each growth of the
hub cache, so a long download never looks stalled to the operator; a download that stops growing sends
nothing, so the stall clock still ends a hung one."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import TrainerConfig
from sftjob_trainer import heartbeat
from sftjob_trainer.heartbeat import DownloadHeartbeat, downloads, hub_folders
from sftjob_trainer.metrics import Phase, TrainerMetrics

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
    return sum(t.name == "download-heartbeat" for t in threading.enumerate())


def test_other_ranks_and_local_models_watch_nothing(tmp_path: Path) -> None:
    hub = _config(tmp_path, {"name": "org/model"}, {"name": "org/chats"})
    local = _config(tmp_path, {"path": str(tmp_path / "model")}, {"path": str(tmp_path / "data.jsonl")})
    metrics = TrainerMetrics("run", "cpu", "m", "lora", "fp32")
    with downloads(hub, Phase.LOADING_DATA, None, hub_cache=tmp_path):  # not rank 0: no metrics
        assert _heartbeats() == 0
    with downloads(local, Phase.LOADING_MODEL, metrics, hub_cache=tmp_path):
        assert _heartbeats() == 0
