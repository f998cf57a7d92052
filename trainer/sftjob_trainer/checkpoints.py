"""Checkpoints that are either complete or ignored, and resuming from the newest complete one.

A checkpoint is written into ``.tmp-checkpoint-N``, fsynced, marked with the COMPLETE file and only
then renamed to ``checkpoint-N``, so a kill at any moment leaves either the previous state or a whole
new checkpoint. On start every ``checkpoint-N`` is checked newest first; one without its marker, with a
file missing, or whose files do not load is skipped with a warning and the next older one is tried.
A checkpoint holds the trainable weights (adapters, or the full model), optimizer, scheduler, gradient
scaler, each rank's RNG states and the step, from which the data position follows (see batching.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.distributed import DistContext

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
REQUIRED_FILES = (STATE_FILE, MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE)
TMP_PREFIX = ".tmp-"
_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
_SCATTER = StateDictOptions(full_state_dict=True, strict=False)


@dataclass
class TrainState:
    """Counters that survive a restart; ``fingerprint`` records what the data order depends on."""

    step: int = 0
    tokens: int = 0
    samples: int = 0
    loss: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trainables:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint-N`` folders, newest first."""
    found = []
    for path in root.glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = path.name[len(CHECKPOINT_PREFIX) :]
        if suffix.isdigit() and path.is_dir():
            found.append((int(suffix), path))
    return sorted(found, reverse=True)


def newest_complete_step(root: Path) -> int:
    """The step of the newest checkpoint that looks complete, without loading it: where a restart will
    most likely resume (0 for a fresh start)."""
    return next((step for step, path in checkpoint_dirs(root) if problem(path) is None), 0)


def problem(path: Path) -> str | None:
    """Why this checkpoint cannot be used, or None when it looks complete."""
    if not (path / CHECKPOINT_COMPLETE_MARKER).is_file():
        return f"no {CHECKPOINT_COMPLETE_MARKER} marker (interrupted while saving?)"
    for name in REQUIRED_FILES:
        if not (path / name).is_file() or (path / name).stat().st_size == 0:
            return f"{name} is missing or empty"
    return None


# --- saving --------------------------------------------------------------------------------------


def save(root: Path, state: TrainState, parts: Trainables, ctx: DistContext, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final path of the new checkpoint."""
    name = f"{CHECKPOINT_PREFIX}{state.step}"
    tmp, final = root / f"{TMP_PREFIX}{name}", root / name
    model_state = get_model_state_dict(parts.model, options=_GATHER)
    optimizer_state = get_optimizer_state_dict(parts.model, parts.optimizer, options=_GATHER)
    try:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        ctx.barrier()
        _save_file(capture_rng(), tmp / rng_file(ctx.rank))
        if ctx.is_main:
            _save_file(model_state, tmp / MODEL_FILE)
            _save_file(optimizer_state, tmp / OPTIMIZER_FILE)
            _save_file(parts.scheduler.state_dict(), tmp / SCHEDULER_FILE)
            if parts.scaler is not None:
                _save_file(parts.scaler.state_dict(), tmp / SCALER_FILE)
            _write_text(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
        ctx.barrier()
        if ctx.is_main:
            _write_text(tmp / CHECKPOINT_COMPLETE_MARKER, f"step {state.step} saved {time.time():.0f}\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            rotate(root, keep)
        ctx.barrier()
    except OSError as exc:
        raise TrainerError(ExitCode.STORAGE_ERROR, f"could not save checkpoint {final}: {exc}") from exc
    return final


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop older ones and older broken leftovers."""
    complete = [(step, path) for step, path in checkpoint_dirs(root) if problem(path) is None]
    newest = complete[0][0] if complete else None
    doomed = [path for _, path in complete[keep:]]
    doomed += [
        path
        for step, path in checkpoint_dirs(root)
        if newest is not None and step < newest and problem(path) is not None
    ]
    doomed += [p for p in root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*") if p.is_dir()]
    for path in doomed:
        log.info("removing old checkpoint %s", path)
        shutil.rmtree(path, ignore_errors=True)


# --- resuming ------------------------------------------------------------------------------------


def load_latest(root: Path, parts: Trainables, ctx: DistContext) -> tuple[TrainState, Path] | None:
    """Restore the newest usable checkpoint into ``parts``; None when there is none (a fresh start)."""
    chosen: tuple[Path, dict[str, Any]] | None = None
    if ctx.is_main:
        chosen = _first_loadable(root)
    path = ctx.broadcast(chosen[0] if chosen else None)
    if path is None:
        return None
    files = chosen[1] if chosen is not None else _load_files(path)
    set_model_state_dict(parts.model, files[MODEL_FILE], options=_SCATTER)
    set_optimizer_state_dict(parts.model, parts.optimizer, files[OPTIMIZER_FILE], options=_SCATTER)
    parts.scheduler.load_state_dict(files[SCHEDULER_FILE])
    if parts.scaler is not None and SCALER_FILE in files:
        parts.scaler.load_state_dict(files[SCALER_FILE])
    rng = path / rng_file(ctx.rank)
    if rng.is_file():
        restore_rng(torch.load(rng, weights_only=True))
    else:
        log.warning("checkpoint %s has no RNG state for rank %d: keeping this run's seed", path, ctx.rank)
    state = TrainState(**files[STATE_FILE])
    log.info("resumed from %s (step %d)", path, state.step)
    return state, path


def _first_loadable(root: Path) -> tuple[Path, dict[str, Any]] | None:
    for _step, path in checkpoint_dirs(root):
        issue = problem(path)
        if issue is None:
            try:
                return path, _load_files(path)
            except Exception as exc:  # a truncated pickle can raise nearly anything
                issue = f"its files do not load ({type(exc).__name__}: {exc})"
        log.warning("skipping checkpoint %s: %s", path, issue)
    return None


def _load_files(path: Path) -> dict[str, Any]:
    """Every rank reads the whole checkpoint, memory-mapped: the tensors live in the node's page cache,
    one copy shared by its processes and reclaimable, and go to the GPU a tensor at a time. Read into
    private memory instead, a node would need one full copy per GPU (4 x 85 GiB for a 7B full run)."""
    files: dict[str, Any] = {STATE_FILE: json.loads((path / STATE_FILE).read_text())}
    names = [*REQUIRED_FILES[1:], *([SCALER_FILE] if (path / SCALER_FILE).is_file() else [])]
    for name in names:
        files[name] = torch.load(path / name, map_location="cpu", weights_only=True, mmap=True)
    return files


def capture_rng() -> dict[str, Any]:
    numpy_state: Any = np.random.get_state()
    kind, keys, pos, has_gauss, gauss = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
