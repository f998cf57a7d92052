"""Checkpoints that are either complete or ignored, and resuming from the newest complete one.

A checkpoint is written into ``.tmp-checkpoint-N-attempt-A``, fsynced, marked with the COMPLETE file
and only then renamed to ``checkpoint-N``, so a kill at any moment leaves either the previous state or
a whole new checkpoint. On start every ``checkpoint-N`` is checked newest first; one without its
marker, with a file missing or shorter than its index says, or whose files do not load is skipped with
a warning and the next older one is tried.

The folder belongs to one attempt at a time (the ``OWNER`` file, written as an attempt starts): a
restart can begin while the previous attempt's pods still finish their SIGTERM save, or run on, on a
node cut off from the cluster. Such a save goes to its own temporary folder and is never committed.

The trainable weights (adapters, or the full model) and the optimizer state are saved with
``torch.distributed.checkpoint`` into ``tensors/``: every rank writes the shards it holds, in parallel,
a GPU tensor at a time, so no process ever gathers the whole model or optimizer into host memory (a
70B full fine-tune would need 840 GB on rank 0), and a checkpoint loads into any number of ranks.
Replicated tensors (DDP, one process) are written once. Beside them: the scheduler, gradient scaler,
each rank's RNG states and the step, from which the data position follows (see batching.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_OWNER_FILE, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.distributed import DistContext, unwrap

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
TENSORS_DIR = "tensors"  # model and optimizer, torch.distributed.checkpoint's format
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
REQUIRED_FILES = (STATE_FILE, SCHEDULER_FILE)
TMP_PREFIX = ".tmp-"
_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass
class TrainState:
    """Counters that survive a restart; ``fingerprint`` records what the data order depends on, ``course``
    where the run ends and how far along it is (``batching.Course``; empty in older checkpoints)."""

    step: int = 0
    tokens: int = 0
    samples: int = 0
    loss: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    course: dict[str, Any] = field(default_factory=dict)


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
    return _tensors_problem(path / TENSORS_DIR)


def _tensors_problem(folder: Path) -> str | None:
    """Every file the index names exists and is as long as the index says (a truncated copy, a lost
    rank's file), checked without reading the tensors."""
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as exc:  # a missing or truncated pickle can raise nearly anything
        return f"its index {TENSORS_DIR}/.metadata does not load ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file() or file.stat().st_size < end:
            return f"{TENSORS_DIR}/{name} is missing or shorter than its index says"
    return None


# --- ownership -----------------------------------------------------------------------------------


def take_over(root: Path, job: JobRef, ctx: DistContext) -> None:
    """Collective: make this attempt of ``job`` the owner of the checkpoint folder, before anything is
    read from it. An attempt that finds a later attempt of the same job owning it was superseded and
    stops; a job recreated under the same name (a new uid, resuming a kept folder) takes over."""
    owner = ctx.broadcast(_owner(root) if ctx.is_main else None)
    if owner is not None and owner[0] == job.uid and owner[1] > job.attempt:
        raise _superseded(root, job, owner, "as it starts")
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{CHECKPOINT_OWNER_FILE}-{job.attempt}"
        _write_text(tmp, json.dumps({"job": job.uid, "attempt": job.attempt}) + "\n")
        os.replace(tmp, root / CHECKPOINT_OWNER_FILE)
        _fsync_dir(root)
        for leftover in root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*"):  # saves no attempt can commit now
            shutil.rmtree(leftover, ignore_errors=True)
    ctx.barrier()


def _owner(root: Path) -> tuple[str, int] | None:
    try:
        owner = json.loads((root / CHECKPOINT_OWNER_FILE).read_text())
        return str(owner["job"]), int(owner["attempt"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _superseded(root: Path, job: JobRef, owner: tuple[str, int], when: str) -> TrainerError:
    by = f"attempt {owner[1]}" if owner[0] == job.uid else f"job {owner[0] or '(local)'}"
    return TrainerError(
        ExitCode.PREEMPTED,
        f"attempt {job.attempt} was superseded by {by}, which owns {root}: stopping {when}",
    )


# --- saving --------------------------------------------------------------------------------------


def save(
    root: Path, state: TrainState, parts: Trainables, ctx: DistContext, *, keep: int, job: JobRef
) -> Path:
    """Collective: every rank calls it. Returns the final path of the new checkpoint."""
    name = f"{CHECKPOINT_PREFIX}{state.step}"
    tmp, final = root / f"{TMP_PREFIX}{name}-attempt-{job.attempt}", root / name
    try:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        ctx.barrier()
        with _single_process_is_meant():
            dcp.save(
                _tensors(parts), storage_writer=FileSystemWriter(tmp / TENSORS_DIR), no_dist=not ctx.active
            )
        _save_file(capture_rng(), tmp / rng_file(ctx.rank))
        if ctx.is_main:
            _save_file(parts.scheduler.state_dict(), tmp / SCHEDULER_FILE)
            if parts.scaler is not None:
                _save_file(parts.scaler.state_dict(), tmp / SCALER_FILE)
            _write_text(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
        ctx.barrier()
        owner = ctx.broadcast(_owner(root) if ctx.is_main else None)
        if owner is not None and owner != (job.uid, job.attempt):
            if ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _superseded(root, job, owner, f"without committing its checkpoint of step {state.step}")
        if ctx.is_main:
            _fsync_dir(tmp / TENSORS_DIR)
            _write_text(tmp / CHECKPOINT_COMPLETE_MARKER, f"step {state.step} saved {time.time():.0f}\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
            rotate(root, keep)
        ctx.barrier()
    except OSError as exc:
        raise TrainerError(ExitCode.STORAGE_ERROR, f"could not save checkpoint {final}: {exc}") from exc
    except CheckpointException as exc:
        raise TrainerError(
            ExitCode.STORAGE_ERROR, f"could not save checkpoint {final}: {_failures(exc)}"
        ) from exc
    return final


def _tensors(parts: Trainables) -> dict[str, Any]:
    """The trainable weights and their optimizer state as this rank holds them (its shards under FSDP),
    keyed by parameter name: the tensors themselves, so that loading writes straight into them. Before
    the first step torch creates the optimizer state with a zero-learning-rate step, for loading to fill.

    Only trainable parameters: the state dict also holds what is not a parameter (bitsandbytes' 4-bit
    quantisation statistics of the frozen base, about 1 GiB for a 70B QLoRA model) and a tied head a
    second time. Should a trainable parameter's name not be found (a wrapper renaming it), everything
    is kept: a bigger checkpoint, never a missing weight.
    """
    model = get_model_state_dict(parts.model, options=_TRAINABLE)
    trainable = {name for name, p in unwrap(parts.model).named_parameters() if p.requires_grad}
    if trainable <= model.keys():
        model = {name: tensor for name, tensor in model.items() if name in trainable}
    return {
        "model": model,
        "optimizer": get_optimizer_state_dict(parts.model, parts.optimizer, options=_TRAINABLE),
    }


@contextmanager
def _single_process_is_meant() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every call outside a process group, where one is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _failures(exc: CheckpointException) -> str:
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in exc.failures.items()
    )


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
    """Restore the newest usable checkpoint into ``parts``; None when there is none (a fresh start).

    Collective. Rank 0 lists the checkpoints that look complete; all ranks then try them newest first,
    together. Loading writes into the model and optimizer in place, so once one has failed part-way only
    a later success restores a consistent state: when none loads, the run stops rather than train from
    weights half overwritten.
    """
    candidates: list[Path] = ctx.broadcast(_complete(root) if ctx.is_main else None)
    failed: list[str] = []
    for path in candidates:
        small = _small_files(path, ctx.rank)
        if ctx.sum([float(small is None)])[0] > 0:
            continue  # some rank could not read its own files: all skip together
        assert small is not None
        try:
            tensors = _tensors(parts)
            with _single_process_is_meant():
                dcp.load(tensors, storage_reader=FileSystemReader(path / TENSORS_DIR), no_dist=not ctx.active)
        except CheckpointException as exc:
            log.warning("skipping checkpoint %s: its tensors do not load (%s)", path, _failures(exc))
            failed.append(path.name)
            continue
        set_model_state_dict(parts.model, tensors["model"], options=_TRAINABLE)
        set_optimizer_state_dict(parts.model, parts.optimizer, tensors["optimizer"], options=_TRAINABLE)
        parts.scheduler.load_state_dict(small[SCHEDULER_FILE])
        if parts.scaler is not None and SCALER_FILE in small:
            parts.scaler.load_state_dict(small[SCALER_FILE])
        if rng_file(ctx.rank) in small:
            restore_rng(small[rng_file(ctx.rank)])
        else:
            log.warning("checkpoint %s has no RNG state for rank %d: keeping this run's seed", path, ctx.rank)
        state = TrainState(**small[STATE_FILE])
        log.info("resumed from %s (step %d)", path, state.step)
        return state, path
    if failed:
        raise TrainerError(
            ExitCode.STORAGE_ERROR,
            f"no checkpoint in {root} loads ({', '.join(failed)} failed part-way): move them away to"
            " start again from the pretrained weights",
        )
    return None


def _complete(root: Path) -> list[Path]:
    complete = []
    for _step, path in checkpoint_dirs(root):
        issue = problem(path)
        if issue is None:
            complete.append(path)
        else:
            log.warning("skipping checkpoint %s: %s", path, issue)
    return complete


def _small_files(path: Path, rank: int) -> dict[str, Any] | None:
    """Everything but the tensors, as this rank needs it; None (with a warning) when a file does not load."""
    names = [SCHEDULER_FILE, *(name for name in (SCALER_FILE, rng_file(rank)) if (path / name).is_file())]
    try:
        files: dict[str, Any] = {STATE_FILE: json.loads((path / STATE_FILE).read_text())}
        for name in names:
            files[name] = torch.load(path / name, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated pickle can raise nearly anything
        log.warning("skipping checkpoint %s: its files do not load (%s: %s)", path, type(exc).__name__, exc)
        return None
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
