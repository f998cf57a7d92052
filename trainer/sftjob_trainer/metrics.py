"""The trainer's Prometheus metrics, served over HTTP by rank 0 (names fixed in contract-notes.md).

Every series carries the bounded labels ``sftjob`` (job name) and ``gpu`` (GPU profile key, or
``cpu``). GPU memory gauges read 0 on a CPU run. Rates (tokens/s, samples/s, MFU) are over the
last logging window, not since start, so they show what the job does now.

The endpoint is up from the first moment of an attempt, before the rendezvous and the hours a data or
model load can take: a scraped pod never refuses its declared metrics port, and ``sftjob_train_phase``
says what the attempt is doing until ``sftjob_train_attempt_start_timestamp_seconds`` marks the start of
its training loop.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from sftjob.config import CheckpointSettings, TrainerConfig
from sftjob_trainer.flops import peak_flops

log = logging.getLogger(__name__)

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
# Up to hours: a full checkpoint of a 70B model on network storage takes half an hour and more.
SAVE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400)


class Phase(StrEnum):
    """What rank 0 is doing: ``sftjob_train_phase{phase=...}`` is 1 for the current one, 0 for the rest."""

    INITIALIZING = "initializing"  # joining the other ranks (rendezvous), preflight checks
    LOADING_DATA = "loading_data"  # tokenizer, dataset download and tokenization
    LOADING_MODEL = "loading_model"  # model, adapters, sharding, optimizer
    RESTORING = "restoring"  # the newest checkpoint, or (FSDP, fresh start) the pretrained weights
    TRAINING = "training"  # the optimizer steps
    EVALUATING = "evaluating"  # the loss on spec.evaluation's held-out examples, between two steps
    SAVING = "saving"  # writing a checkpoint, or the final output


def checkpoint_interval(every: CheckpointSettings, seconds_per_step: float | None) -> float:
    """Seconds between two checkpoints as configured: ``every_minutes``, or ``every_steps`` times the wall
    time of a recent step (``seconds_per_step``), the sooner of the two; 0 while neither is known."""
    intervals = []
    if every.every_minutes is not None:
        intervals.append(every.every_minutes * 60)
    if every.every_steps is not None and seconds_per_step:
        intervals.append(every.every_steps * seconds_per_step)
    return min(intervals, default=0.0)


class FirstSet:
    """The job's series of a labelled gauge, exported from its first value on: before it there is none,
    where a plain child would read 0 (a loss of 0 from every attempt's setup until its first step)."""

    def __init__(self, gauge: Gauge, labels: dict[str, str]) -> None:
        self._gauge, self._labels = gauge, labels

    def set(self, value: float) -> None:
        self._gauge.labels(**self._labels).set(value)


@dataclass(frozen=True)
class WindowRates:
    tokens_per_second: float
    samples_per_second: float
    mfu: float


class TrainerMetrics:
    def __init__(self, job: str, gpu: str, model: str, method: str, precision: str) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"sftjob": job, "gpu": gpu}
        self._server: Any = None
        names = list(self._labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**self._labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**self._labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(**self._labels)

        def first_set(name: str, doc: str) -> FirstSet:
            return FirstSet(Gauge(name, doc, names, registry=self.registry), self._labels)

        # From the first step on (a resumed attempt: its checkpoint's loss as soon as it loads).
        self.loss = first_set("sftjob_train_loss", "Mean training loss of the last optimizer step")
        self.learning_rate = first_set(
            "sftjob_train_learning_rate", "Learning rate of the last optimizer step"
        )
        self.grad_norm = first_set("sftjob_train_grad_norm", "Gradient norm before clipping, last step")
        self.step = gauge("sftjob_train_step", "Optimizer steps done")
        self.total_steps = gauge("sftjob_train_total_steps", "Optimizer steps the job will run")
        self.epoch = gauge("sftjob_train_epoch", "Fractional epoch")
        self.tokens = counter("sftjob_train_tokens", "Real (non-padding) tokens trained on, all ranks")
        self.samples = counter("sftjob_train_samples", "Samples trained on, all ranks")
        self.tokens_per_second = gauge("sftjob_train_tokens_per_second", "Real tokens/s, last window")
        # The plan's prediction, from the start (start_metrics); 0 for a config without a plan, which the
        # SFTJobSlowerThanPlanned alert (measured below a fraction of it) never fires on.
        self.planned_tokens_per_second = gauge(
            "sftjob_train_planned_tokens_per_second",
            "Real tokens/s the job's plan predicted for its GPUs (0: no plan), to compare with the measured",
        )
        self.samples_per_second = gauge("sftjob_train_samples_per_second", "Samples/s, last window")
        # From the first logging window on: during setup there is no estimate (not an ETA of 0).
        self._eta_seconds = first_set(
            "sftjob_train_eta_seconds",
            "Estimated time to the last step: the steps left x (the last window's time a step + this"
            " attempt's evaluations and saves spread over its steps)",
        )
        self.step_duration = histogram(
            "sftjob_train_step_duration_seconds",
            "Optimizer step time, without the wait for its batch",
            STEP_BUCKETS,
        )
        self.mfu = gauge(
            "sftjob_train_mfu_ratio", "Model FLOPs utilisation (0-1) against the dense bf16 peak"
        )
        self.memory_allocated = gauge(
            "sftjob_train_gpu_memory_allocated_bytes", "GPU memory allocated (rank 0)"
        )
        self.memory_reserved = gauge("sftjob_train_gpu_memory_reserved_bytes", "GPU memory reserved (rank 0)")
        self.memory_peak = gauge("sftjob_train_gpu_memory_peak_bytes", "Peak GPU memory allocated (rank 0)")
        self.memory_total = gauge("sftjob_train_gpu_memory_total_bytes", "GPU memory of the card (rank 0)")
        self.dataloader_wait = counter(
            "sftjob_train_dataloader_wait_seconds", "Time spent waiting for batches"
        )
        self.checkpoint_save = histogram(
            "sftjob_train_checkpoint_save_duration_seconds", "Checkpoint save time", SAVE_BUCKETS
        )
        self.last_checkpoint_step = gauge(
            "sftjob_train_last_checkpoint_step", "Step of the newest checkpoint"
        )
        self.last_checkpoint_time = gauge(
            "sftjob_train_last_checkpoint_timestamp_seconds", "Unix time of the newest checkpoint"
        )
        self.checkpoint_interval = gauge(
            "sftjob_train_checkpoint_interval_seconds",
            "Configured time between checkpoints (everySteps: estimated from recent steps; 0 until known)",
        )
        self.attempt_start_time = gauge(
            "sftjob_train_attempt_start_timestamp_seconds",
            "Unix time this attempt's training loop started (0 while it sets up)",
        )
        self._phase = Gauge(
            "sftjob_train_phase",
            "What the attempt is doing (1 = now)",
            [*names, "phase"],
            registry=self.registry,
        )
        self.enter(Phase.INITIALIZING)
        self.download_bytes = gauge(
            "sftjob_train_download_bytes",
            "Bytes of the job's hub repos in the Hugging Face cache, as of the last download heartbeat",
        )
        # Exported from the first evaluation on: a job without spec.evaluation shows no eval loss of 0.
        self._eval_loss = first_set(
            "sftjob_train_eval_loss",
            "Mean loss per target token on the held-out examples (spec.evaluation), last evaluation",
        )
        self._eval_step = first_set("sftjob_train_eval_step", "Optimizer step of the last evaluation")
        self._eval_duration = Histogram(
            "sftjob_train_eval_duration_seconds",
            "Time one evaluation took",
            names,
            buckets=SAVE_BUCKETS,
            registry=self.registry,
        )
        self.restarts_seen = gauge("sftjob_train_restarts_seen", "Attempt number of this pod (1 = first)")
        self.bad_rows = counter("sftjob_train_bad_rows", "Malformed dataset rows skipped")
        # A series per configured tracker (spec.tracking), from 0 (tracking.py).
        self._tracking_errors = Counter(
            "sftjob_train_tracking_errors",
            "Experiment tracker failures (start, log, finish); training goes on",
            [*names, "tracker"],
            registry=self.registry,
        )
        # A series per tracker from its start on: 1 started, 0 once it failed to start or was dropped (3
        # failed logs in a row). None before: an attempt setting up for hours has not started its trackers
        # yet, which is no failure (the SFTJobTrackerFailing alert fires on 0).
        self._tracking_active = Gauge(
            "sftjob_train_tracking_active",
            "1 while an experiment tracker is logged to; 0 once it failed to start or was dropped",
            [*names, "tracker"],
            registry=self.registry,
        )
        info = Gauge(
            "sftjob_train_info",
            "What is being trained",
            [*names, "model", "method", "precision"],
            registry=self.registry,
        )
        info.labels(**self._labels, model=model, method=method, precision=precision).set(1)

    def serve(self, port: int) -> int:
        """Start the HTTP endpoint (port 0 picks a free one); returns the bound port. It listens on both
        IPv6 and IPv4 (an IPv6-only cluster scrapes it too), on IPv4 alone where the kernel has no IPv6."""
        try:
            self._server, _thread = start_http_server(port, addr="::", registry=self.registry)
        except OSError:
            self._server, _thread = start_http_server(port, registry=self.registry)
        bound = int(self._server.server_port)
        log.info("metrics on :%d/metrics", bound)
        return bound

    def enter(self, phase: Phase) -> None:
        for each in Phase:
            self._phase.labels(**self._labels, phase=each).set(1 if each == phase else 0)

    def training_started(self) -> None:
        self.enter(Phase.TRAINING)
        self.attempt_start_time.set(time.time())

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def record_step(
        self,
        *,
        step: int,
        epoch: float,
        loss: float,
        learning_rate: float,
        grad_norm: float,
        tokens: int,
        samples: int,
        seconds: float,
        dataloader_wait: float,
    ) -> None:
        self.step.set(step)
        self.epoch.set(epoch)
        self.loss.set(loss)
        self.learning_rate.set(learning_rate)
        self.grad_norm.set(grad_norm)
        self.tokens.inc(tokens)
        self.samples.inc(samples)
        self.step_duration.observe(seconds)
        self.dataloader_wait.inc(dataloader_wait)

    def record_window(self, rates: WindowRates, device: torch.device, eta_seconds: float) -> None:
        self._eta_seconds.set(eta_seconds)
        self.tokens_per_second.set(rates.tokens_per_second)
        self.samples_per_second.set(rates.samples_per_second)
        self.mfu.set(rates.mfu)
        if device.type == "cuda":
            self.memory_allocated.set(torch.cuda.memory_allocated(device))
            self.memory_reserved.set(torch.cuda.memory_reserved(device))
            self.memory_peak.set(torch.cuda.max_memory_allocated(device))
            self.memory_total.set(torch.cuda.get_device_properties(device).total_memory)

    def record_eval(self, step: int, loss: float, seconds: float | None) -> None:
        """An evaluation that took ``seconds``; or (``seconds`` None) the one of the checkpoint a run
        resumed from."""
        self._eval_loss.set(loss)
        self._eval_step.set(step)
        if seconds is not None:
            self._eval_duration.labels(**self._labels).observe(seconds)

    def tracking_errors(self, tracker: str) -> Any:
        """The error counter of ``tracker`` (``tensorboard``, ``mlflow``, ``wandb``)."""
        return self._tracking_errors.labels(**self._labels, tracker=tracker)

    def tracking_active(self, tracker: str) -> Any:
        """The gauge of ``tracker``: 1 while it is logged to, 0 once it failed to start or was dropped."""
        return self._tracking_active.labels(**self._labels, tracker=tracker)

    def record_checkpoint(self, step: int, seconds: float | None, saved_at: float | None = None) -> None:
        """A save that took ``seconds``; or (``seconds`` None) the checkpoint a run resumed from."""
        if seconds is not None:
            self.checkpoint_save.observe(seconds)
        self.last_checkpoint_step.set(step)
        self.last_checkpoint_time.set(time.time() if saved_at is None else saved_at)


def start_metrics(config: TrainerConfig) -> TrainerMetrics | None:
    """Rank 0's metrics (torchrun's RANK: the process group is not up yet), served on
    ``report.metricsPort`` from now on; None on the other ranks."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    gpu, _ = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None, 1)
    metrics = TrainerMetrics(
        config.job.name,
        gpu,
        config.model.name or config.model.path or "",
        config.method,
        config.training.precision,
    )
    metrics.restarts_seen.set(config.job.attempt)
    metrics.checkpoint_interval.set(checkpoint_interval(config.checkpoints, None))
    if config.report.planned_tokens_per_second is not None:
        metrics.planned_tokens_per_second.set(config.report.planned_tokens_per_second)
    if config.report.metrics_port is not None:
        metrics.serve(config.report.metrics_port)
    else:
        log.info("metrics endpoint disabled (report.metricsPort is unset)")
    return metrics
