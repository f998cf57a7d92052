"""What training a checkpoint is of, so that a resume never goes on from another training's weights.

A job created again under its name over kept checkpoints may ask for other training: another base model,
method, adapter shape or dataset. Every checkpoint records :func:`identity` (``TrainState.identity``) and
resume.py refuses one whose identity differs from the job's (:func:`identity_differences`) before any
tensor is read. Kept apart from resume.py, which finds, loads and sets aside checkpoints: what names a
training is the spec's business, not the loading's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sftjob.config import TrainerConfig


def identity(config: TrainerConfig) -> dict[str, Any]:
    """What training a checkpoint is of, by the spec fields that name it: the base model, the method, the
    adapter's shape (LoRA and QLoRA) and the dataset. Not what may change over kept checkpoints by design:
    the run length, learningRate and weightDecay, the layout (a re-plan's micro-batch, checkpointing and
    row length), the number and type of GPUs."""
    model, data = config.model, config.dataset
    found: dict[str, Any] = {
        "model.name": model.name,
        "model.path": model.path,
        "model.revision": model.revision,
        "method": config.method,
        "dataset.name": data.name,
        "dataset.path": data.path,
        "dataset.revision": data.revision,
        "dataset.split": data.split,
        "dataset.format": data.format,
    }
    if config.method != "full":
        lora, targets = config.lora, config.lora.target_modules
        found |= {
            "lora.r": lora.r,
            "lora.alpha": lora.alpha,
            "lora.targetModules": targets if isinstance(targets, str) else sorted(targets),
        }
    return found


def identity_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's :func:`identity` and this attempt's, as ``field was X, now Y``.
    Fields only one of them records (an older or a newer trainer's) are not compared: a checkpoint that
    records none resumes as before."""
    return [
        f"{key} was {_shown(saved[key])}, now {_shown(value)}"
        for key, value in now.items()
        if key in saved and saved[key] != value
    ]


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, list) else str(value)


def afresh(root: Path) -> str:
    """How to start afresh over checkpoints a job may not resume (those of other training), for its error."""
    return (
        "to start afresh, create the job under another name, with a checkpoint claim or checkpoints.volume"
        f" of its own, or delete or move the checkpoints out of its checkpoint volume ({root} in the pod)"
    )
