"""Fixtures for the trainer tests: a tiny random model made once, and configs pointing at it.

Everything runs on the CPU with a tokenizer trained on the fly (no downloads, HF_HUB_OFFLINE=1).
``trainer_config`` writes a config file for a short deterministic run; tests override what they need.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before transformers (and huggingface_hub, which reads it once, when imported) is: no test reaches the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sftjob_trainer import trackers, tracking  # noqa: E402
from sftjob_trainer.tiny import make_tiny_model, make_tokenizer, write_dataset  # noqa: E402
from tests.trainer.runs import MakeConfig  # noqa: E402

# Tiny matmuls gain nothing from threads on a shared 2-core machine; one thread in this process and in
# the trainer processes the tests start also keeps their floating-point results identical.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Gemma 2: attention logits soft-capped, every other layer in an 8-token sliding window."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-gemma2") / "model"
    tokenizer = make_tokenizer()
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=1.0,  # with the larger initial weights, it changes the logits
        initializer_range=0.2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def termination_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "termination-log"
    monkeypatch.setenv("SFTJOB_TERMINATION_LOG", str(path))
    return path


@pytest.fixture
def trainer_config(tmp_path: Path, tiny_model: Path, termination_log: Path) -> MakeConfig:
    """``trainer_config(fmt="messages", **overrides)`` -> path of a config for a 12-step CPU run."""

    def make(fmt: str = "messages", rows: int = 128, name: str = "run", **overrides: Any) -> Path:
        run = tmp_path / name
        data = write_dataset(run / f"data-{fmt}.jsonl", fmt, rows=rows)
        config = {
            "job": {"name": "tiny"},
            "model": {"path": str(tiny_model)},
            "dataset": {"path": str(data), "maxSeqLength": 64},
            "method": "lora",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.1},
            "training": {
                "maxSteps": 12,
                "learningRate": 3e-3,
                "warmupRatio": 0.0,
                "globalBatchSize": 8,
                "microBatchSize": 4,
                "gradientAccumulationSteps": 2,
                "precision": "fp32",
                "packing": True,
                "packingLength": 128,
                "dataloaderWorkers": 0,
                "loggingEverySteps": 1,
            },
            "checkpoints": {
                "dir": str(run / "checkpoints"),
                "everySteps": 4,
                "everyMinutes": None,
                "keep": 2,
            },
            "outputDir": str(run / "output"),
            "gpu": {"required": False},
            "report": {"metricsPort": None},
        }
        path = run / "config.json"
        path.write_text(json.dumps(_merge(config, overrides)))
        return path

    return make


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
    for name in tracker_env_defaults():  # restored after the test, whatever the trainer set
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


def tracker_env_defaults() -> list[str]:
    """The environment variables the trainer sets before importing MLflow or W&B, unless already set."""
    return [
        *trackers.MLFLOW_HTTP_DEFAULTS,
        *(name for d in trackers.TELEMETRY_DEFAULTS.values() for name in d),
    ]


def _wandb_teardown() -> None:
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@pytest.fixture
def signal_handlers_restored() -> Iterator[None]:
    """For code that installs SIGINT/SIGTERM handlers of its own: the test process gets its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)
