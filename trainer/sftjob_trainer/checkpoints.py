"""Checkpoints that are either complete or ignored: what one holds, saving it, and rotating old ones.

A checkpoint is written into ``.tmp-checkpoint-N-attempt-A``, fsynced, marked with the COMPLETE file
and only then renamed to ``checkpoint-N``, so a kill at any moment leaves either the previous state or
a whole new checkpoint. :func:`problem` says why one cannot be used (no marker, a file missing or shorter
than its index says); resuming from the newest that loads is resume.py's.

The folder belongs to one attempt at a time (the ``OWNER`` file, written as an attempt starts): a
restart can begin while the previous attempt's pods still finish their SIGTERM save, or run on, on a
node cut off from the cluster. Such a save goes to its own temporary folder and is never committed.

The trainable weights (adapters, or the full model with its persistent buffers) and the optimizer state
are saved with ``torch.distributed.checkpoint`` into ``tensors/``: every rank writes the shards it holds,
in parallel, a GPU tensor at a time, so no process ever gathers the whole model or optimizer into host
memory (a 70B full fine-tune would need 840 GB on rank 0), and a checkpoint loads into any number of
ranks. Replicated tensors (DDP, one process) are written once. Beside them: the scheduler, gradient
scaler, each rank's RNG states and the step, from which the data position follows (see batching.py),
and what training the checkpoint is of (:class:`TrainState`'s ``identity``).
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
)

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, OomPhase, TrainerError
from sftjob_trainer.distributed import DistContext, unwrap
from sftjob_trainer.durable import TMP_PREFIX, fsync_dir, save_file, write_text
from sftjob_trainer.failures import oom_among, storage_failure
from sftjob_trainer.ownership import check_owner
from sftjob_trainer.rng import capture_rng

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
TENSORS_DIR = "tensors"  # model and optimizer, torch.distributed.checkpoint's format
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
REQUIRED_FILES = (STATE_FILE, SCHEDULER_FILE)
BAD_PREFIX = ".bad-"  # a checkpoint set aside: newer than the one resumed from, so not usable
TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass
class TrainState:
    """Counters that survive a restart; ``fingerprint`` records what the data order depends on
    (data_order.py), ``course`` where the run ends and how far along it is (``batching.Course``),
    ``identity`` what training this is (identity.py: the base model, the method, the adapter's shape, the
    dataset), which a resume compares with the job's, and ``versions`` the transformers and peft that
    saved it (``identity.model_code``: not part of the identity), which a checkpoint of the same training
    that does not fit the model is explained by. The last three are empty in older checkpoints.
    ``model_commit`` is the hub commit of the base model the attempt that saved it trained on, which a
    resume trains on again (base_commit.py); None for ``model.path`` and in older checkpoints."""

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
    eval_set: dict[str, Any] = field(default_factory=dict)  # what the eval losses above were measured on
    fingerprint: dict[str, Any] = field(default_factory=dict)
    course: dict[str, Any] = field(default_factory=dict)
    identity: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    nonfinite_in_a_row: int = 0  # steps skipped for a non-finite loss or gradients, up to this one
    model_commit: str | None = None


@dataclass
class Trainables:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """``checkpoint-N`` folders, newest first; none before ``root`` exists. A folder that cannot be listed
    raises its OSError (``Path.glob`` would take a permission denied for an empty folder: a fresh start)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        suffix = name.removeprefix(CHECKPOINT_PREFIX)
        if name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit() and (root / name).is_dir():
            found.append((int(suffix), root / name))
    return sorted(found, reverse=True)


def step_of(path: Path) -> int:
    """N of ``checkpoint-N``."""
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def newest_complete_step(root: Path) -> int:
    """The step of the newest checkpoint that looks complete, without loading it: where a restart will
    most likely resume (0 for a fresh start)."""
    return next((step for step, path in checkpoint_dirs(root) if problem(path) is None), 0)


def newest_saved_state(root: Path) -> dict[str, Any] | None:
    """The ``trainer_state.json`` of the newest checkpoint that looks complete, as saved (its tensors not
    read): what the attempt will most likely resume from, known before the model loads; None for a fresh
    start. Raises OSError or ValueError when it does not read."""
    for _step, path in checkpoint_dirs(root):
        if problem(path) is None:
            saved: dict[str, Any] = json.loads((path / STATE_FILE).read_text())
            return saved
    return None


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
        with single_process_is_meant():
            dcp.save(
                trainable_tensors(parts),
                storage_writer=FileSystemWriter(tmp / TENSORS_DIR),
                no_dist=not ctx.active,
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
        raise storage_failure(exc, f"could not save checkpoint {final}", root) from exc
    except CheckpointException as exc:
        raise save_failure(exc, f"could not save checkpoint {final}", root) from exc
    return final


def save_failure(exc: CheckpointException, doing: str, folder: Path) -> TrainerError:
    """The error to end with when a save failed on some rank (``exc`` holds every rank's failure): a CUDA
    OOM first (the phase named, for the operator not to lower the micro-batch for it), then the storage
    failing (a permission denied is the user's to fix), else STORAGE_ERROR with every rank's words."""
    errors = [error for error, _ in exc.failures.values()]
    oom = oom_among(errors, f"{OomPhase.SAVING} a checkpoint")
    if oom is not None:
        return oom
    error = next((error for error in errors if isinstance(error, OSError)), None)
    if error is not None:
        return storage_failure(error, doing, folder)
    return TrainerError(ExitCode.STORAGE_ERROR, f"{doing}: {describe_failures(exc)}")


def _missing(tmp: Path, world_size: int) -> str | None:
    """What of every rank's part of the save in ``tmp`` rank 0 cannot see (a folder the nodes do not
    share: each node's copy holds its own ranks' files), or None when it is all there."""
    absent = [rng_file(rank) for rank in range(world_size) if not (tmp / rng_file(rank)).is_file()]
    tensors = _tensors_problem(tmp / TENSORS_DIR)
    return ", ".join([*([tensors] if tensors else []), *absent]) or None


def trainable_tensors(parts: Trainables) -> dict[str, Any]:
    """The trainable weights and their optimizer state as this rank holds them (its shards under FSDP),
    keyed by parameter name: the tensors themselves, so that loading writes straight into them. Before
    the first step torch creates the optimizer state with a zero-learning-rate step, for loading to fill.
    """
    return {
        "model": trainable_weights(parts.model),
        "optimizer": get_optimizer_state_dict(parts.model, parts.optimizer, options=TRAINABLE),
    }


def trainable_weights(model: nn.Module) -> dict[str, Any]:
    """The trainable parameters, and for a whole model its persistent buffers (:func:`persistent_buffers`).

    Not the rest of the state dict: an adapter's frozen base, what is not a parameter there (bitsandbytes'
    4-bit quantisation statistics, about 1 GiB for a 70B QLoRA model), a tied head a second time. Should a
    trainable parameter's name not be found (a wrapper renaming it), everything is kept: a bigger
    checkpoint, never a missing weight."""
    state = get_model_state_dict(model, options=TRAINABLE)
    trainable = {name for name, p in unwrap(model).named_parameters() if p.requires_grad}
    if trainable <= state.keys():
        kept = trainable | persistent_buffers(model, state)
        state = {name: tensor for name, tensor in state.items() if name in kept}
    return state


def persistent_buffers(model: nn.Module, state: dict[str, Any]) -> set[str]:
    """The buffers of ``model`` in its state dict (``state``) that a checkpoint holds: those of a model
    without a frozen parameter (full fine-tuning), whose checkpoint replaces the pretrained weights. Some
    come from them, not from the config: a router's ``e_score_correction_bias`` (GLM-4.5 MoE,
    DeepSeek-V3), Gemma 4's ``layer_scalar``; under FSDP a resumed model has only their build-time values
    otherwise. None for adapters: their base, buffers included, is loaded from the pretrained weights on
    every start."""
    module = unwrap(model)
    if any(not p.requires_grad for p in module.parameters()):
        return set()
    return {name for name, _ in module.named_buffers()} & state.keys()


@contextmanager
def single_process_is_meant() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every call outside a process group, where one is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def describe_failures(exc: CheckpointException) -> str:
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in exc.failures.items()
    )


def rotate(root: Path, keep: int, committed: int, spare: int | None = None) -> None:
    """After committing the checkpoint of step ``committed``: keep it and the newest ``keep`` - 1 complete
    ones before it, and the one of step ``spare`` (the best so far); drop older ones and older broken
    leftovers.

    A checkpoint newer than the one just committed is none of this run's (resume.load_latest set aside
    those it found): it is left alone, never counted as one of the newest. Unfinished saves (``.tmp-``)
    are left to the attempt that takes the folder over: one may be the save in progress of an attempt
    that took it over from this one meanwhile.
    """
    older = [(step, path) for step, path in checkpoint_dirs(root) if step < committed]
    complete = [path for _, path in older if problem(path) is None]
    doomed = [path for path in complete[keep - 1 :] if step_of(path) != spare]
    doomed += [path for _, path in older if problem(path) is not None]
    for path in doomed:
        log.info("removing old checkpoint %s", path)
        shutil.rmtree(path, ignore_errors=True)
