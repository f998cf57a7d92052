"""Checkpoints that are either complete or ignored, and resuming from the newest complete one.

A checkpoint is written into ``.tmp-checkpoint-N-attempt-A``, fsynced, marked with the COMPLETE file
and only then renamed to ``checkpoint-N``, so a kill at any moment leaves either the previous state or
a whole new checkpoint. On start every ``checkpoint-N`` is checked newest first; one without its
marker, with a file missing or shorter than its index says, or whose files do not load is skipped with
a warning and the next older one is tried. Those newer than the one resumed from are then set aside as
``.bad-checkpoint-N`` (kept for inspection, never resumed from or deleted): a save of this run must not
rank below them, nor rotation delete the run's own progress to keep them.

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
import shutil
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.distributed import DistContext, unwrap
from sftjob_trainer.durable import TMP_PREFIX, fsync_dir, save_file, write_text
from sftjob_trainer.failures import causes
from sftjob_trainer.ownership import check_owner
from sftjob_trainer.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
TENSORS_DIR = "tensors"  # model and optimizer, torch.distributed.checkpoint's format
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
REQUIRED_FILES = (STATE_FILE, SCHEDULER_FILE)
BAD_PREFIX = ".bad-"  # a checkpoint set aside: newer than the one resumed from, so not usable
_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass
class TrainState:
    """Counters that survive a restart; ``fingerprint`` records what the data order depends on, ``course``
    where the run ends and how far along it is (``batching.Course``; empty in older checkpoints)."""

    step: int = 0
    tokens: int = 0
    samples: int = 0
    loss: float | None = None
    eval_loss: float | None = None  # the last evaluation's (spec.evaluation), at step eval_step
    eval_step: int | None = None
    lowest_eval_loss: float | None = None  # of every evaluation so far (early stopping)
    evals_without_improvement: int = 0
    best_step: int | None = None  # the saved checkpoint with the lowest eval loss (finalModel Best)
    best_eval_loss: float | None = None
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
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            raise  # the storage failing, not the checkpoint: never a reason to skip it
        return f"its index {TENSORS_DIR}/.metadata is missing"
    except Exception as exc:  # a truncated pickle can raise nearly anything
        return f"its index {TENSORS_DIR}/.metadata does not load ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file() or file.stat().st_size < end:
            return f"{TENSORS_DIR}/{name} is missing or shorter than its index says"
    return None


# --- saving --------------------------------------------------------------------------------------


def save(
    root: Path,
    state: TrainState,
    parts: Trainables,
    ctx: DistContext,
    *,
    keep: int,
    job: JobRef,
    keep_best: bool = False,
) -> Path:
    """Collective: every rank calls it. Returns the final path of the new checkpoint. With ``keep_best``
    the rotation spares ``state.best_step``'s checkpoint besides the newest ``keep``."""
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
        save_file(capture_rng(), tmp / rng_file(ctx.rank))
        if ctx.is_main:
            save_file(parts.scheduler.state_dict(), tmp / SCHEDULER_FILE)
            if parts.scaler is not None:
                save_file(parts.scaler.state_dict(), tmp / SCALER_FILE)
            write_text(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
        ctx.barrier()
        check_owner(root, job, ctx, f"without committing its checkpoint of step {state.step}", discard=tmp)
        missing = ctx.broadcast(_missing(tmp, ctx.world_size) if ctx.is_main else None)
        if missing is not None:
            raise TrainerError(
                ExitCode.STORAGE_ERROR,
                f"checkpoints.dir is not shared by the job's nodes: rank 0 does not see {missing} of the"
                f" checkpoint of step {state.step} other ranks wrote into {tmp}; give a multi-node job a"
                " checkpoints.volume every node mounts (a ReadWriteMany claim or nfs, not hostPath)",
            )
        if ctx.is_main:
            fsync_dir(tmp / TENSORS_DIR)
            write_text(tmp / CHECKPOINT_COMPLETE_MARKER, f"step {state.step} saved {time.time():.0f}\n")
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            rotate(root, keep, state.step, spare=state.best_step if keep_best else None)
        ctx.barrier()
    except OSError as exc:
        raise TrainerError(ExitCode.STORAGE_ERROR, f"could not save checkpoint {final}: {exc}") from exc
    except CheckpointException as exc:
        raise TrainerError(
            ExitCode.STORAGE_ERROR, f"could not save checkpoint {final}: {_failures(exc)}"
        ) from exc
    return final


def _missing(tmp: Path, world_size: int) -> str | None:
    """What of every rank's part of the save in ``tmp`` rank 0 cannot see (a folder the nodes do not
    share: each node's copy holds its own ranks' files), or None when it is all there."""
    absent = [rng_file(rank) for rank in range(world_size) if not (tmp / rng_file(rank)).is_file()]
    tensors = _tensors_problem(tmp / TENSORS_DIR)
    return ", ".join([*([tensors] if tensors else []), *absent]) or None


def _tensors(parts: Trainables) -> dict[str, Any]:
    """The trainable weights and their optimizer state as this rank holds them (its shards under FSDP),
    keyed by parameter name: the tensors themselves, so that loading writes straight into them. Before
    the first step torch creates the optimizer state with a zero-learning-rate step, for loading to fill.

    Only trainable parameters: the state dict also holds what is not a parameter (bitsandbytes' 4-bit
    quantisation statistics of the frozen base, about 1 GiB for a 70B QLoRA model) and a tied head a
    second time. Should a trainable parameter's name not be found (a wrapper renaming it), everything
    is kept: a bigger checkpoint, never a missing weight.
    """
    return {
        "model": _weights(parts.model),
        "optimizer": get_optimizer_state_dict(parts.model, parts.optimizer, options=_TRAINABLE),
    }


def _weights(model: nn.Module) -> dict[str, Any]:
    state = get_model_state_dict(model, options=_TRAINABLE)
    trainable = {name for name, p in unwrap(model).named_parameters() if p.requires_grad}
    if trainable <= state.keys():
        state = {name: tensor for name, tensor in state.items() if name in trainable}
    return state


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


def rotate(root: Path, keep: int, committed: int, spare: int | None = None) -> None:
    """After committing the checkpoint of step ``committed``: keep it and the newest ``keep`` - 1 complete
    ones before it, and the one of step ``spare`` (the best so far); drop older ones and older broken
    leftovers.

    A checkpoint newer than the one just committed is none of this run's (load_latest set aside those it
    found): it is left alone, never counted as one of the newest. Unfinished saves (``.tmp-``) are left
    to the attempt that takes the folder over: one may be the save in progress of an attempt that took
    it over from this one meanwhile.
    """
    older = [(step, path) for step, path in checkpoint_dirs(root) if step < committed]
    complete = [path for _, path in older if problem(path) is None]
    doomed = [path for path in complete[keep - 1 :] if _step_of(path) != spare]
    doomed += [path for _, path in older if problem(path) is not None]
    for path in doomed:
        log.info("removing old checkpoint %s", path)
        shutil.rmtree(path, ignore_errors=True)


# --- resuming ------------------------------------------------------------------------------------


def load_latest(root: Path, parts: Trainables, ctx: DistContext) -> tuple[TrainState, Path] | None:
    """Restore the newest usable checkpoint into ``parts``; None when there is none (a fresh start).

    Collective. Rank 0 lists the checkpoints that look complete; all ranks then try them newest first,
    together: one that some rank cannot read is skipped by all. Loading writes into the model and
    optimizer in place, so once one has failed part-way only a later success restores a consistent
    state. When none of them loads, the run stops rather than train from weights half overwritten, or
    from the pretrained weights as if the checkpoints were not there. Once one has loaded (or on a fresh
    start) every checkpoint newer than it is set aside (:func:`_set_aside_newer`).
    """
    candidates: list[Path] | str = ctx.broadcast(_listing(root) if ctx.is_main else None)
    if isinstance(candidates, str):
        raise _storage_error(candidates)
    failed: dict[str, str] = {}  # checkpoint name: why it did not load (as rank 0 saw it)
    for path in candidates:
        storage = None
        try:
            small, why = _small_files(path, ctx.rank)
        except OSError as exc:
            small, why, storage = None, None, f"rank {ctx.rank} could not read {path}: {exc}"
        unreadable, failing = (int(n) for n in ctx.sum([float(small is None), float(storage is not None)]))
        if failing:  # all stop together, the checkpoint kept for the restart
            raise _storage_error(
                storage or f"{failing} other rank(s) could not read {path} (their log says why)"
            )
        if unreadable:  # all skip together
            if why is None:
                why = f"{unreadable} other rank(s) cannot read its files"
                log.warning("skipping checkpoint %s: %s", path, why)
            failed[path.name] = why
            continue
        assert small is not None
        try:
            tensors = _tensors(parts)
            with _single_process_is_meant():
                dcp.load(tensors, storage_reader=FileSystemReader(path / TENSORS_DIR), no_dist=not ctx.active)
        except CheckpointException as exc:
            if any(_is_storage_failure(error) for error, _ in exc.failures.values()):
                raise _storage_error(f"could not read {path}: {_failures(exc)}") from exc
            failed[path.name] = f"its tensors do not load ({_failures(exc)})"
            log.warning("skipping checkpoint %s: %s", path, failed[path.name])
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
        _set_aside_newer(root, _step_of(path), failed, ctx)
        return state, path
    if failed:
        raise TrainerError(
            ExitCode.STORAGE_ERROR,
            f"no checkpoint in {root} loads ({', '.join(failed)}: the log says why): move them away to"
            " start again from the pretrained weights",
        )
    _set_aside_newer(root, 0, failed, ctx)
    return None


def load_weights(path: Path, parts: Trainables, ctx: DistContext) -> None:
    """Collective: the trainable weights of the checkpoint at ``path`` into the model (the optimizer is
    left alone: this is for writing the output from an earlier checkpoint, not for training on)."""
    model = _weights(parts.model)
    try:
        with _single_process_is_meant():
            dcp.load(
                {"model": model}, storage_reader=FileSystemReader(path / TENSORS_DIR), no_dist=not ctx.active
            )
    except CheckpointException as exc:
        raise _storage_error(f"could not read the weights of {path}: {_failures(exc)}") from exc
    set_model_state_dict(parts.model, model, options=_TRAINABLE)


def _set_aside_newer(root: Path, resumed: int, failed: dict[str, str], ctx: DistContext) -> None:
    """Collective: rank 0 renames every checkpoint newer than step ``resumed`` (0: a fresh start) to
    ``.bad-checkpoint-N``, saying why (``failed`` holds the reasons of those that did not load); the others
    wait until it has. Kept for inspection: nothing resumes from, ranks or deletes such a folder."""
    error = None
    if ctx.is_main:
        try:
            for step, path in checkpoint_dirs(root):
                if step > resumed:
                    why = failed.get(path.name) or problem(path) or "newer than the checkpoint resumed from"
                    aside = _aside(path)
                    log.warning("setting checkpoint %s aside as %s: %s", path, aside.name, why)
                    os.rename(path, aside)
            fsync_dir(root)
        except OSError as exc:
            error = f"could not set aside the unusable checkpoints in {root}: {exc}"
    error = ctx.broadcast(error)
    if error is not None:
        raise TrainerError(ExitCode.STORAGE_ERROR, error)


def _step_of(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def _aside(path: Path) -> Path:
    """``.bad-checkpoint-N``, or ``.bad-checkpoint-N-2``... when an earlier one of that step is there."""
    aside = path.with_name(f"{BAD_PREFIX}{path.name}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{BAD_PREFIX}{path.name}-{n}")
    return aside


def _is_storage_failure(exc: BaseException) -> bool:
    """The storage failing (EIO, a stale NFS handle, a timeout), not the checkpoint: no reason to skip it.
    A missing file is the checkpoint's fault (a lost rank's file, a node's copy of an unshared folder)."""
    return any(
        isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError) for cause in causes(exc)
    )


def _storage_error(detail: str) -> TrainerError:
    return TrainerError(
        ExitCode.STORAGE_ERROR,
        f"storage error reading the checkpoints: {detail} (kept as they are: the restart tries again)",
    )


def _listing(root: Path) -> list[Path] | str:
    """The checkpoints that look complete (rank 0's view), or what kept rank 0 from reading them."""
    try:
        return _complete(root)
    except OSError as exc:
        return f"could not list {root}: {exc}"


def _complete(root: Path) -> list[Path]:
    complete = []
    for _step, path in checkpoint_dirs(root):
        issue = problem(path)
        if issue is None:
            complete.append(path)
        else:
            log.warning("skipping checkpoint %s: %s", path, issue)
    return complete


def _small_files(path: Path, rank: int) -> tuple[dict[str, Any] | None, str | None]:
    """Everything but the tensors, as this rank needs it; or None and why (with a warning) when a file
    does not load, or this rank cannot see the checkpoint (a node's copy of a folder not shared). Raises
    the OSError of a storage failure (:func:`_is_storage_failure`)."""
    names = [SCHEDULER_FILE, *(name for name in (SCALER_FILE, rng_file(rank)) if (path / name).is_file())]
    try:
        files: dict[str, Any] = {STATE_FILE: json.loads((path / STATE_FILE).read_text())}
        for name in names:
            files[name] = torch.load(path / name, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated pickle can raise nearly anything
        if _is_storage_failure(exc):
            raise  # the caller stops the run: a restart may read it
        why = f"its files do not load on rank {rank} ({type(exc).__name__}: {exc})"
        log.warning("skipping checkpoint %s: %s", path, why)
        return None, why
    return files, None
