"""What training a checkpoint is of, so that a resume never goes on from another training's weights.

A job created again under its name over kept checkpoints may ask for other training: another base model,
method, adapter shape or dataset. Every checkpoint records :func:`identity` (``TrainState.identity``) and
resume.py refuses one whose identity shows other training (:func:`compare`) before any tensor is read.
What the product itself advises after a failure is not such evidence: a model or dataset moved from the
hub to a volume (a NetworkError's advice), a revision pinned where none was (a DataError's), unset
spelled ``main``. Those resume with a warning, and the shape check of the load that follows catches a
model of another architecture. Kept apart from resume.py, which finds, loads and sets aside
checkpoints: what names a training is the spec's business, not the loading's.

Beside the identity a checkpoint records the versions of the libraries whose code names and shapes the
parameters (:func:`model_code`, ``TrainState.versions``): not part of it, since an image of newer
versions may resume the same training, but what a checkpoint of the same training that no longer fits
the model points at (:func:`code_changes`).
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NamedTuple

from sftjob.config import TrainerConfig

# The revision the hub reads when the spec sets none (model.py, sources.py): unset and "main" are one.
_DEFAULT_REVISION = "main"
# Where a model or dataset comes from: a change of these alone may be the same weights or rows moved.
_SOURCE_FIELDS = ("model.name", "model.path", "dataset.name", "dataset.path")
_REVISIONS = ("model.revision", "dataset.revision")
# The libraries whose code names and shapes a checkpoint's parameters: transformers' modeling code, PEFT's
# adapter layers.
_MODEL_CODE = ("transformers", "peft")


class Comparison(NamedTuple):
    """How a checkpoint's :func:`identity` compares with the job's, each change as ``field was X, now Y``:
    ``other``, evidence of other training (the resume is refused); ``moved``, a source moved between the
    hub and a volume or a revision pinned or unpinned, which may be the same training (a warning).
    ``same``: the two record fields in common and none of them differs."""

    other: list[str]
    moved: list[str]
    same: bool


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


def compare(saved: dict[str, Any], now: dict[str, Any]) -> Comparison:
    """A checkpoint's :func:`identity` (``saved``) against this attempt's. Fields only one of them records
    (an older or a newer trainer's) are not compared: a checkpoint that records none resumes as before.

    Other training shows as another hub name or another path of the model or dataset, two different
    revisions both set, or any other field changed. A name or path set on one side only is the source
    moved (the job recreated with the model on a volume, say), and a revision set on one side only is
    one pinned (or unpinned): not evidence enough to refuse. Unset and ``main`` are the same revision."""
    other: list[str] = []
    moved: list[str] = []
    common = [key for key in now if key in saved]
    for key in common:
        was, value = saved[key], now[key]
        if key in _REVISIONS:
            was, value = _pinned(was), _pinned(value)
        if was == value:
            continue
        change = f"{key} was {_shown(saved[key])}, now {_shown(now[key])}"
        loose = key in _SOURCE_FIELDS or key in _REVISIONS
        (moved if loose and (was is None or value is None) else other).append(change)
    return Comparison(other, moved, bool(common) and not other and not moved)


def _pinned(revision: Any) -> Any:
    """A revision as the hub reads it: None for the default branch, however it is spelled."""
    return None if revision == _DEFAULT_REVISION else revision


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value) if isinstance(value, list) else str(value)


def model_code() -> dict[str, str]:
    """The installed versions of the libraries whose code names and shapes the parameters a checkpoint
    holds (those not installed left out), recorded in ``TrainState.versions``."""
    found = {}
    for name in _MODEL_CODE:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def code_changes(saved: dict[str, str], now: dict[str, str]) -> list[str]:
    """The libraries of :func:`model_code` whose version differs between a checkpoint's (``saved``) and
    this image's, as ``name X (this image has Y)``; only those both record."""
    return [
        f"{name} {saved[name]} (this image has {value})"
        for name, value in now.items()
        if name in saved and saved[name] != value
    ]


def afresh(root: Path) -> str:
    """How to start afresh over checkpoints a job may not resume (those of other training), for its error."""
    return (
        "to start afresh, create the job under another name, with a checkpoint claim or checkpoints.volume"
        f" of its own, or delete or move the checkpoints out of its checkpoint volume ({root} in the pod)"
    )
