"""The rank-0 metrics endpoint: up from the start of an attempt, every metric of the contract while a run
is in progress, each setup phase, the start of training, the checkpoint interval and step times."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode
from sftjob_trainer import checkpoints, output, resume
from sftjob_trainer import train as train_module
from sftjob_trainer.batching import Schedule, StepBatches
from sftjob_trainer.checkpoints import TrainState
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.flops import FlopsModel
from sftjob_trainer.loop import StepResult
from sftjob_trainer.metrics import TrainerMetrics, start_metrics
from sftjob_trainer.observer import Observer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, scrape, start_trainer, trainer_output, wait_for_step

pytestmark = pytest.mark.trainer

CONTRACT_METRICS = [
    "sftjob_train_loss",
    "sftjob_train_learning_rate",
    "sftjob_train_grad_norm",
    "sftjob_train_step",
    "sftjob_train_total_steps",
    "sftjob_train_epoch",
    "sftjob_train_tokens_total",
    "sftjob_train_samples_total",
    "sftjob_train_tokens_per_second",
    "sftjob_train_planned_tokens_per_second",
    "sftjob_train_samples_per_second",
    "sftjob_train_step_duration_seconds_bucket",
    "sftjob_train_mfu_ratio",
    "sftjob_train_gpu_memory_allocated_bytes",
    "sftjob_train_gpu_memory_reserved_bytes",
    "sftjob_train_gpu_memory_peak_bytes",
    "sftjob_train_gpu_memory_total_bytes",
    "sftjob_train_dataloader_wait_seconds_total",
    "sftjob_train_checkpoint_save_duration_seconds_bucket",
    "sftjob_train_last_checkpoint_step",
    "sftjob_train_last_checkpoint_timestamp_seconds",
    "sftjob_train_restarts_seen",
    "sftjob_train_bad_rows_total",
    "sftjob_train_info",
    "sftjob_train_phase",
    "sftjob_train_attempt_start_timestamp_seconds",
    "sftjob_train_checkpoint_interval_seconds",
    "sftjob_train_download_bytes",
    "sftjob_train_eta_seconds",
    "sftjob_train_eval_loss",
    "sftjob_train_eval_step",
    "sftjob_train_eval_duration_seconds_bucket",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_endpoint_serves_every_contract_metric_during_a_run(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    port = _free_port()
    config = trainer_config(
        training={"maxSteps": 400},
        checkpoints={"everySteps": 2},
        evaluation={"fraction": 0.05},
        report={"metricsPort": port},
        job={"name": "tiny", "attempt": 2},
    )
    proc = start_trainer(config, termination_log)
    try:
        wait_for_step(config, proc, 3)
        deadline = time.monotonic() + 30
        while True:
            text = scrape(port)
            samples = {
                line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")
            }
            if all(name in samples for name in CONTRACT_METRICS) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert [name for name in CONTRACT_METRICS if name not in samples] == [], trainer_output(config)
    assert 'sftjob_train_restarts_seen{gpu="cpu",sftjob="tiny"} 2.0' in text
    assert 'method="lora"' in text and 'precision="fp32"' in text
    step = next(line for line in text.splitlines() if line.startswith("sftjob_train_step{"))
    assert float(step.rsplit(" ", 1)[1]) >= 3


# ---------------------------------------------------------------------------------------------------
# In-process runs, scraped at chosen moments: a wrapped function of the trainer scrapes /metrics the
# first time it is called, then does its work.


def value(text: str, name: str, **labels: str) -> float:
    """The sample ``name`` of an exposition whose labels include ``labels``."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in:\n{text}")


def phase(text: str) -> str:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "sftjob_train_phase"]
    (current,) = [s.labels["phase"] for s in family.samples if s.value == 1]
    return current


class Scrapes:
    """What /metrics said when each wrapped function was first called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, port: int) -> None:
        self.monkeypatch, self.port = monkeypatch, port
        self.seen: dict[str, str] = {}

    def at(self, module: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(module, name)

        def scraped_first(*args: Any, **kwargs: Any) -> Any:
            self.seen.setdefault(name, scrape(self.port))
            return real(*args, **kwargs)

        self.monkeypatch.setattr(module, name, scraped_first)


def scraping(monkeypatch: pytest.MonkeyPatch, port: int) -> Scrapes:
    scrapes = Scrapes(monkeypatch, port)
    scrapes.at(train_module, "init_distributed")  # before the rendezvous
    scrapes.at(train_module, "load_examples")
    scrapes.at(train_module, "load_model")
    scrapes.at(resume, "load_latest")
    scrapes.at(train_module, "train_step")
    return scrapes


def test_metrics_are_served_before_the_rendezvous_and_show_each_setup_phase(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _free_port()
    config = trainer_config(training={"maxSteps": 2}, report={"metricsPort": port})
    scrapes = scraping(monkeypatch, port)
    before = time.time()
    assert run(str(config)) == ExitCode.OK
    seen = scrapes.seen
    assert {name: phase(text) for name, text in seen.items()} == {
        "init_distributed": "initializing",
        "load_examples": "loading_data",
        "load_model": "loading_model",
        "load_latest": "restoring",
        "train_step": "training",
    }
    started = "sftjob_train_attempt_start_timestamp_seconds"
    assert value(seen["load_latest"], started) == 0  # still setting up
    assert before <= value(seen["train_step"], started) <= time.time()
    assert value(seen["init_distributed"], "sftjob_train_step", sftjob="tiny", gpu="cpu") == 0
    for name in ("sftjob_train_loss", "sftjob_train_learning_rate", "sftjob_train_grad_norm"):
        assert f"\n{name}{{" not in seen["train_step"], f"{name} before the first step"


def test_a_resumed_attempt_shows_its_step_while_it_loads_and_counts_from_its_own_start(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config(training={"maxSteps": 5}, checkpoints={"everySteps": 2})
    assert run(str(config)) == ExitCode.OK
    port = _free_port()
    settings = json.loads(config.read_text())
    resumes_at = checkpoints.newest_complete_step(Path(settings["checkpoints"]["dir"]))
    assert resumes_at > 0
    settings["training"]["maxSteps"] = 8
    settings["report"]["metricsPort"] = port
    config.write_text(json.dumps(settings))
    scrapes = scraping(monkeypatch, port)
    before = time.time()
    assert run(str(config)) == ExitCode.OK
    loading = scrapes.seen["load_model"]
    assert value(loading, "sftjob_train_step") == resumes_at
    assert value(loading, "sftjob_train_epoch") > 0
    assert value(loading, "sftjob_train_attempt_start_timestamp_seconds") == 0
    training = scrapes.seen["train_step"]
    saved_at = value(training, "sftjob_train_last_checkpoint_timestamp_seconds")
    assert 0 < saved_at < before <= value(training, "sftjob_train_attempt_start_timestamp_seconds")


def test_step_time_leaves_out_the_wait_for_data(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    delay, steps = 0.5, 3

    class SlowBatches(StepBatches):
        def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:
            time.sleep(delay)
            return super().__getitem__(index)

    kept: list[TrainerMetrics] = []
    real_start_metrics = train_module.start_metrics

    def keep(config: TrainerConfig) -> TrainerMetrics | None:
        metrics = real_start_metrics(config)
        assert metrics is not None  # rank 0 of one process
        kept.append(metrics)
        return metrics

    monkeypatch.setattr(train_module, "StepBatches", SlowBatches)
    monkeypatch.setattr(train_module, "start_metrics", keep)
    assert run(str(trainer_config(training={"maxSteps": steps}))) == ExitCode.OK
    (metrics,) = kept
    registry, labels = metrics.registry, {"sftjob": "tiny", "gpu": "cpu"}
    waited = registry.get_sample_value("sftjob_train_dataloader_wait_seconds_total", labels)
    stepped = registry.get_sample_value("sftjob_train_step_duration_seconds_sum", labels)
    assert waited is not None and stepped is not None
    assert waited >= steps * delay * 0.9
    assert stepped < waited - steps * delay * 0.5, "the step time holds the wait for data"


class Phases:
    """The phase /metrics said at every call of each wrapped function, in the order of the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, port: int) -> None:
        self.monkeypatch, self.port = monkeypatch, port
        self.seen: list[tuple[str, str]] = []

    def at(self, module: Any, name: str, then: Callable[[int], None] = lambda calls: None) -> None:
        """Scrape at each call of ``module.name``; ``then(calls so far)`` after the scrape."""
        real: Callable[..., Any] = getattr(module, name)

        def scraped(*args: Any, **kwargs: Any) -> Any:
            self.seen.append((name, phase(scrape(self.port))))
            then(sum(called == name for called, _ in self.seen))
            return real(*args, **kwargs)

        self.monkeypatch.setattr(module, name, scraped)


def test_the_phase_reads_saving_while_a_checkpoint_or_the_output_is_written_and_training_again_after(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _free_port()
    config = trainer_config(
        training={"maxSteps": 3}, checkpoints={"everySteps": 2}, report={"metricsPort": port}
    )
    phases = Phases(monkeypatch, port)
    for module, name in ((train_module, "train_step"), (checkpoints, "save"), (output, "write_model")):
        phases.at(module, name)
    assert run(str(config)) == ExitCode.OK
    assert phases.seen == [
        ("train_step", "training"),
        ("train_step", "training"),
        ("save", "saving"),  # the checkpoint of step 2
        ("train_step", "training"),
        ("save", "saving"),  # an adapter's last step
        ("write_model", "saving"),
    ]


def test_the_phase_reads_saving_while_the_checkpoint_a_sigterm_asked_for_is_written(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _free_port()
    config = trainer_config(
        training={"maxSteps": 6}, checkpoints={"everySteps": 100}, report={"metricsPort": port}
    )
    phases = Phases(monkeypatch, port)

    def sigterm_at_the_second(calls: int) -> None:
        if calls == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the step finishes, then its checkpoint is saved

    phases.at(train_module, "train_step", then=sigterm_at_the_second)
    phases.at(checkpoints, "save")
    assert run(str(config)) == ExitCode.PREEMPTED
    assert phases.seen == [("train_step", "training"), ("train_step", "training"), ("save", "saving")]


# ---------------------------------------------------------------------------------------------------
# The checkpoint interval the CheckpointTooOld alert scales with.


def _config(tmp_path: Path, checkpoints_every: dict[str, Any]) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "job": {"name": "job"},
            "model": {"path": str(tmp_path / "model")},
            "dataset": {"path": str(tmp_path / "data.jsonl")},
            "training": {"loggingEverySteps": 10, "globalBatchSize": 1},
            "checkpoints": checkpoints_every,
            "outputDir": str(tmp_path),
            "report": {"enabled": False, "metricsPort": None},
        }
    )


def _observer(tmp_path: Path, checkpoints_every: dict[str, Any]) -> tuple[Observer, TrainerMetrics]:
    config = _config(tmp_path, checkpoints_every)
    metrics = start_metrics(config)
    assert metrics is not None
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"))
    schedule = Schedule(units=1000, micro_batch_size=1, accumulation=1, world_size=1, seed=0)
    return Observer(config, ctx, metrics, None, 100, schedule), metrics


def _interval(metrics: TrainerMetrics) -> float | None:
    return metrics.registry.get_sample_value(
        "sftjob_train_checkpoint_interval_seconds", {"sftjob": "job", "gpu": "cpu"}
    )


def test_the_checkpoint_interval_is_the_configured_minutes_from_the_start(tmp_path: Path) -> None:
    metrics = start_metrics(_config(tmp_path, {"everyMinutes": 1440}))
    assert metrics is not None
    assert _interval(metrics) == 86400


def test_a_step_based_checkpoint_interval_is_estimated_from_the_wall_time_of_recent_steps(
    tmp_path: Path,
) -> None:
    observer, metrics = _observer(tmp_path, {"everySteps": 50, "everyMinutes": None})
    assert _interval(metrics) == 0  # not measured yet: the alert's fixed threshold applies
    result = StepResult(loss=1.0, grad_norm=0.5, learning_rate=1e-4, tokens=100, samples=1, attention_pairs=0)
    for step in range(1, 11):  # step 10 is a logging step: its window is measured
        observer.step(TrainState(step=step), result, 2.0, 0.5, FlopsModel(6.0, 0.0))
    assert _interval(metrics) == pytest.approx(50 * 2.5)


# ---------------------------------------------------------------------------------------------------
# What the series read before and between the events that set them.

LABELS = {"sftjob": "job", "gpu": "cpu"}


def _metrics() -> TrainerMetrics:
    return TrainerMetrics("job", "cpu", "model", "lora", "bf16")


def test_the_plans_predicted_rate_is_served_from_the_start_beside_the_measured_one(tmp_path: Path) -> None:
    # SFTJobSlowerThanPlanned divides the two: the same labels, and the prediction before the first step.
    config = _config(tmp_path, {"everyMinutes": 30})
    planned = config.model_copy(
        update={"report": config.report.model_copy(update={"planned_tokens_per_second": 1234.5})}
    )
    metrics = start_metrics(planned)
    assert metrics is not None
    assert metrics.registry.get_sample_value("sftjob_train_planned_tokens_per_second", LABELS) == 1234.5
    assert metrics.registry.get_sample_value("sftjob_train_tokens_per_second", LABELS) == 0


def test_a_config_without_a_plan_serves_a_predicted_rate_of_zero_that_no_measured_rate_is_below(
    tmp_path: Path,
) -> None:
    # The series exists (every metric an alert reads is served), and SFTJobSlowerThanPlanned's
    # "measured < ratio x planned" cannot hold for it.
    metrics = start_metrics(_config(tmp_path, {"everyMinutes": 30}))
    assert metrics is not None
    assert metrics.registry.get_sample_value("sftjob_train_planned_tokens_per_second", LABELS) == 0


def test_the_etas_help_says_it_counts_evaluations_and_saves_not_only_the_window_step_rate() -> None:
    (family,) = [f for f in _metrics().registry.collect() if f.name == "sftjob_train_eta_seconds"]
    assert "window's step rate" not in family.documentation
    assert "evaluations and saves spread over its steps" in family.documentation


def test_loss_learning_rate_and_grad_norm_have_no_series_until_the_first_step_sets_them() -> None:
    metrics = _metrics()
    per_step = ("sftjob_train_loss", "sftjob_train_learning_rate", "sftjob_train_grad_norm")
    assert [metrics.registry.get_sample_value(name, LABELS) for name in per_step] == [None, None, None]
    metrics.record_step(
        step=1, epoch=0.1, loss=2.5, learning_rate=1e-4, grad_norm=0.7, tokens=10, samples=1,
        seconds=0.2, dataloader_wait=0.0,
    )  # fmt: skip
    assert [metrics.registry.get_sample_value(name, LABELS) for name in per_step] == [2.5, 1e-4, 0.7]


def test_checkpoint_saves_of_hours_and_steps_of_minutes_fall_into_buckets_of_their_own() -> None:
    metrics = _metrics()
    metrics.record_checkpoint(100, 5000.0)  # a 70B full checkpoint on slow network storage
    metrics.step_duration.observe(500.0)

    def bucket(name: str, le: str) -> float | None:
        return metrics.registry.get_sample_value(f"{name}_bucket", LABELS | {"le": le})

    save = "sftjob_train_checkpoint_save_duration_seconds"
    assert (bucket(save, "3600.0"), bucket(save, "7200.0")) == (0, 1)
    assert bucket(save, "14400.0") == 1
    step = "sftjob_train_step_duration_seconds"
    assert (bucket(step, "300.0"), bucket(step, "600.0")) == (0, 1)
