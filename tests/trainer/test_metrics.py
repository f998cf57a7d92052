"""The rank-0 metrics endpoint serves every metric of the contract while a run is in progress."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest

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
