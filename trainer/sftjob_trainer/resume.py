"""Where an attempt's training starts from: the newest checkpoint that loads, else the pretrained weights.

On start every ``checkpoint-N`` is checked newest first (checkpoints.problem); one without its marker,
with a file missing or shorter than its index says, or whose files do not load is skipped with a
warning and the next older one is tried. Those newer than the one resumed from are then set aside as
``.bad-checkpoint-N`` (kept for inspection, never resumed from or deleted): a save of this run must not
rank below them, nor rotation delete the run's own progress to keep them. A storage failure while
reading (EIO, a stale handle) stops the run with the checkpoints kept as they are for the restart; so does
a permission denied (files a root process left 0600, nfs root_squash), but as a configuration error
naming the owner, which no restart changes (checkpoint_loading.py tells these apart).

A checkpoint records what training it is of (identity.py): a job created again under its name over
kept checkpoints with another base model, method, adapter shape or dataset is refused (CONFIG_ERROR,
naming what differs) before any tensor is read, rather than train on, or write as its output, the old
weights; a model or dataset only moved (from the hub to a volume) or pinned to a revision is resumed,
with a warning. So are checkpoints none of which fits the model (a tensor missing or of another shape:
an older trainer's checkpoints record no identity, and a trainer image of another transformers or PEFT
version may name or shape the parameters otherwise), instead of being skipped as broken.

Where the data order of the checkpoint resumed from stands is data_order.py's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import base_commit, heartbeat, ownership
from sftjob_trainer.checkpoint_loading import (
    Loading,
    OtherShapes,
    load_tensors,
    load_weights,
    read_failure,
    storage_error,
    tensors_failure,
)
from sftjob_trainer.checkpoints import (
    BAD_PREFIX,
    SCALER_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    TRAINABLE,
    Trainables,
    TrainState,
    checkpoint_dirs,
    describe_failures,
    persistent_buffers,
    problem,
    rng_file,
    step_of,
    trainable_tensors,
)
from sftjob_trainer.data_order import data_order, layout_of, same_data_order
from sftjob_trainer.distributed import DistContext, load_rank0_weights, loads_on_rank0
from sftjob_trainer.durable import fsync_dir
from sftjob_trainer.failures import permission_advice, storage_failure
from sftjob_trainer.identity import Comparison, afresh, code_changes, compare, identity, model_code
from sftjob_trainer.metrics import Phase, TrainerMetrics
from sftjob_trainer.model import pretrained_weights
from sftjob_trainer.observer import Observer
from sftjob_trainer.rng import restore_rng

log = logging.getLogger(__name__)

# The counters every checkpoint has had since the first trainer: without them there is nothing to resume.
_REQUIRED_STATE = ("step", "tokens", "samples")


class Resumed(NamedTuple):
    """The checkpoint an attempt resumed from; ``without_buffers``: the model's buffers it does not hold
    (an older trainer saved none), which kept the values they had."""

    state: TrainState
    path: Path
    without_buffers: list[str]


def restore(
    config: TrainerConfig,
    ctx: DistContext,
    parts: Trainables,
    attention: str,
    layout: dict[str, Any],
    metrics: TrainerMetrics | None,
    observer: Observer | None,
    *,
    spec: TrainerConfig | None = None,
) -> tuple[TrainState, Path | None]:
    """Collective: this attempt takes the checkpoint folder over and starts from the newest checkpoint that
    loads (returned with it), or from the pretrained weights with a fresh state (and None). ``layout`` is
    this attempt's ``data_order.fingerprint``, recorded in the state with where the data order stands
    (``data_order.data_order``). ``config`` loads the model (at the commit base_commit.pin chose, which
    the state records); ``spec``, the job's config before that, names the training (identity.py):
    ``config`` when not given.

    Under FSDP rank 0 alone reads the pretrained weights and broadcasts them into the shards: before the
    checkpoint for adapters (theirs holds no base; it overwrites the fresh adapters), after it for full
    fine-tuning, and only on a fresh start: its checkpoint holds every weight and persistent buffer. One
    of an older trainer holds no buffers: the pretrained weights are loaded then, and the checkpoint's
    weights again over them, so that buffers that come from the pretrained weights (a router's bias) are
    not left as the model was built.
    """
    root = Path(config.checkpoints.dir)
    ownership.take_over(root, config.job, ctx)
    rank0_weights, full = loads_on_rank0(config, ctx), config.method == "full"
    if rank0_weights and not full:
        load_pretrained(config, ctx, parts.model, attention, metrics, observer)
    trains, commit = identity(spec or config), base_commit.loaded(config)
    with heartbeat.busy(observer, "restoring the newest checkpoint", heartbeat.io_seconds(parts.model)):
        resumed = load_latest(root, parts, ctx, trains)
    if rank0_weights and full and (resumed is None or resumed.without_buffers):
        load_pretrained(config, ctx, parts.model, attention, metrics, observer)
        if resumed is not None:
            why = load_weights(resumed.path, parts, ctx)
            if why is not None:
                raise storage_error(f"could not read the weights of {resumed.path} again: {why}")
    if resumed is None:
        fresh = TrainState(fingerprint=layout, identity=trains, versions=model_code(), model_commit=commit)
        return fresh, None
    state, path, _ = resumed
    order = data_order(state.fingerprint, layout, state.step)
    if not same_data_order(state.fingerprint, layout):
        log.warning(
            "resuming with a different data layout (%s, was %s): %s",
            layout,
            layout_of(state.fingerprint),
            f"the rest of epoch {order['rest']['epoch']} goes on with the examples it has not used yet,"
            " packed anew, then the new layout's epochs"
            if "rest" in order
            else f"the data order after step {state.step} differs from the interrupted run (its checkpoint,"
            " an older trainer's, does not record which examples its epoch has used)",
        )
    state.fingerprint, state.identity, state.versions = order, trains, model_code()
    state.model_commit = commit
    return state, path


def load_pretrained(
    config: TrainerConfig,
    ctx: DistContext,
    model: torch.nn.Module,
    attention: str,
    metrics: TrainerMetrics | None,
    observer: Observer | None,
) -> None:
    """Collective: rank 0's pretrained weights (``model.pretrained_weights``) into every rank's shards."""
    loading = time.monotonic()
    with heartbeat.downloads(config, Phase.RESTORING, metrics, observer, weights=True):
        weights = pretrained_weights(config, attention) if ctx.is_main else {}
    ctx.wait_for_rank0()  # its download may outlast NCCL's timeout: the others wait on the CPU
    load_rank0_weights(model, weights)
    log.info("pretrained weights loaded on rank 0 and sharded in %.1fs", time.monotonic() - loading)


def load_latest(
    root: Path, parts: Trainables, ctx: DistContext, trains: dict[str, Any] | None = None
) -> Resumed | None:
    """Restore the newest usable checkpoint into ``parts``; None when there is none (a fresh start).

    Collective. Rank 0 lists the checkpoints that look complete; all ranks then try them newest first,
    together: one that some rank cannot read is skipped by all. Loading writes into the model and
    optimizer in place, so once one has failed part-way only a later success restores a consistent
    state. When none of them loads, the run stops rather than train from weights half overwritten, or
    from the pretrained weights as if the checkpoints were not there: CONFIG_ERROR when none fits the
    model (:class:`OtherShapes`: :func:`_no_fit` says why), else STORAGE_ERROR. A checkpoint whose
    identity (identity.py) shows other training than ``trains`` stops the run too (CONFIG_ERROR), before
    its tensors are read; one whose model or dataset only moved, or whose revision was pinned, is tried
    with a warning. Once one has loaded (or on a fresh start) every checkpoint newer than it is set aside
    (:func:`_set_aside_newer`).
    """
    candidates: list[Path] | tuple[ExitCode, str] = ctx.broadcast(_listing(root) if ctx.is_main else None)
    if isinstance(candidates, tuple):
        raise TrainerError(*candidates)
    failed: dict[str, str] = {}  # checkpoint name: why it did not load (as rank 0 saw it)
    misfits: list[str] = []  # the OtherShapes of those that do not fit the model
    newest: tuple[TrainState, Comparison] | None = None  # the newest misfit's state and identity check
    for path in candidates:
        failure = None
        try:
            small, why = _small_files(path, ctx.rank)
        except TrainerError as exc:
            small, why, failure = None, None, exc
        unreadable = _stop_together(path, small is None, failure, ctx)
        if unreadable:  # all skip together
            if why is None:
                why = f"{unreadable} other rank(s) cannot read its files"
                log.warning("skipping checkpoint %s: %s", path, why)
            failed[path.name] = why
            continue
        assert small is not None
        check: Comparison = ctx.broadcast(
            compare(small[STATE_FILE].identity, trains or {}) if ctx.is_main else None
        )
        if check.other:
            raise TrainerError(
                ExitCode.CONFIG_ERROR,
                f"checkpoint {path.name} in {root} is of other training than this job's spec:"
                f" {'; '.join(check.other)}. Resuming it would go on from the old weights: create the job"
                f" with the spec it was trained with to resume it; {afresh(root)}",
            )
        if check.moved and ctx.is_main:
            log.warning(
                "checkpoint %s was trained from a model or dataset the spec now reads from elsewhere, or"
                " at a revision pinned or unpinned (%s): resuming it as the same training, its tensors"
                " checked against the model's shapes as they load",
                path,
                "; ".join(check.moved),
            )
        tensors = trainable_tensors(parts)
        planner = Loading(persistent_buffers(parts.model, tensors["model"]))
        try:
            load_tensors(tensors, path, ctx, planner)
        except CheckpointException as exc:  # raised on every rank alike, with every rank's failures
            stop = tensors_failure(exc, path)
            if stop is not None:
                raise stop from exc
            failed[path.name] = f"its tensors do not load ({describe_failures(exc)})"
            log.warning("skipping checkpoint %s: %s", path, failed[path.name])
            if all(isinstance(error, OtherShapes) for error, _ in exc.failures.values()):
                misfits.append(str(next(iter(exc.failures.values()))[0]))
                newest = newest or (small[STATE_FILE], check)
            continue
        set_model_state_dict(parts.model, tensors["model"], options=TRAINABLE)
        set_optimizer_state_dict(parts.model, parts.optimizer, tensors["optimizer"], options=TRAINABLE)
        parts.scheduler.load_state_dict(small[SCHEDULER_FILE])
        if parts.scaler is not None and SCALER_FILE in small:
            parts.scaler.load_state_dict(small[SCALER_FILE])
        if rng_file(ctx.rank) in small:
            restore_rng(small[rng_file(ctx.rank)])
        else:
            log.warning("checkpoint %s has no RNG state for rank %d: keeping this run's seed", path, ctx.rank)
        state = small[STATE_FILE]
        log.info("resumed from %s (step %d)", path, state.step)
        if planner.absent:
            log.warning(
                "checkpoint %s holds none of the model's buffers (an older trainer's): %s keep their values",
                path,
                ", ".join(planner.absent),
            )
        _set_aside_newer(root, step_of(path), failed, ctx)
        return Resumed(state, path, planner.absent)
    if failed and len(misfits) == len(failed):
        assert newest is not None
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"no checkpoint in {root} fits this model ({', '.join(failed)}; {misfits[0]}):"
            f" {_no_fit(*newest)}; {afresh(root)}",
        )
    if failed:
        raise TrainerError(
            ExitCode.STORAGE_ERROR,
            f"no checkpoint in {root} loads ({', '.join(failed)}: the log says why): move them away to"
            " start again from the pretrained weights",
        )
    _set_aside_newer(root, 0, failed, ctx)
    return None


def _no_fit(newest: TrainState, check: Comparison) -> str:
    """Why no checkpoint fits the model, by what the newest of them records: the model read from elsewhere
    when the spec moved it; other settings than the spec's when it records no identity (an older
    trainer's); when its training is this job's, this trainer image's model code (naming the library
    versions that differ, when it records them), or the model changed where the spec reads it."""
    if check.moved:
        return (
            f"the model they were trained from is not the one the spec reads now ({'; '.join(check.moved)})."
            " Create the job with the source they were trained with to resume them"
        )
    if not check.same:
        return (
            "they were trained with other settings than the spec asks for now (another base model, method,"
            " lora.r or lora.targetModules). Create the job with the settings they were trained with to"
            " resume them"
        )
    changes = code_changes(newest.versions, model_code())
    if changes:
        return (
            "they record the same training as this job's spec but do not fit this trainer image's model"
            f" code: they were saved with {', '.join(changes)}, whose code names or shapes the parameters"
            " otherwise. Resume them with an image of the versions that saved them (spec.image)"
        )
    if not newest.versions:
        return (
            "they record the same training as this job's spec but do not fit this trainer image's model"
            " code (another transformers or peft version than the image that saved them names or shapes"
            " the parameters otherwise). Resume them with the image that saved them (spec.image)"
        )
    return (
        "they record the same training as this job's spec and were saved with this image's transformers"
        " and peft: the model changed where the spec reads it (a new commit of a hub model without"
        " model.revision, other files at model.path, its remote code). Give the job the model they were"
        " trained from to resume them"
    )


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
            stop = storage_failure(exc, f"could not set aside the unusable checkpoints in {root}", root)
            error = stop.code, stop.reason
    error = ctx.broadcast(error)
    if error is not None:
        raise TrainerError(*error)


def _aside(path: Path) -> Path:
    """``.bad-checkpoint-N``, or ``.bad-checkpoint-N-2``... when an earlier one of that step is there."""
    aside = path.with_name(f"{BAD_PREFIX}{path.name}")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{BAD_PREFIX}{path.name}-{n}")
    return aside


def _stop_together(path: Path, missing: bool, failure: TrainerError | None, ctx: DistContext) -> int:
    """Collective, once every rank has read the small files of ``path`` (``missing`` here, ``failure`` when
    that stops the run): how many ranks cannot read them, for all to skip the checkpoint together; unless
    a rank's failure stops the run, then on every rank with the same code: CONFIG_ERROR when some rank was
    denied permission (no restart changes that), else STORAGE_ERROR, the checkpoint kept for the restart."""
    denied_here = failure is not None and failure.code == ExitCode.CONFIG_ERROR
    counts = ctx.sum([float(missing), float(denied_here), float(failure is not None)])
    unreadable, denied, failing = (int(n) for n in counts)
    if denied_here and failure is not None:
        raise failure
    if denied:
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"{denied} other rank(s) may not read checkpoint {path} (their log names the file):"
            f" {permission_advice(None, path)}",
        )
    if failing:
        raise failure or storage_error(f"{failing} other rank(s) could not read {path} (their log says why)")
    return unreadable


def _listing(root: Path) -> list[Path] | tuple[ExitCode, str]:
    """The checkpoints that look complete (rank 0's view), or the code and reason to stop on when rank 0
    cannot read them (a pair: a TrainerError does not survive the broadcast's pickling)."""
    try:
        return _complete(root)
    except OSError as exc:
        stop = read_failure(exc, f"could not list the checkpoints in {root}", root) or storage_error(
            f"could not list {root}: {exc}"
        )
        return stop.code, stop.reason


def _complete(root: Path) -> list[Path]:
    complete = []
    for _step, path in checkpoint_dirs(root):
        issue = problem(path)
        if issue is None:
            complete.append(path)
        else:
            log.warning("skipping checkpoint %s: %s", path, issue)
    return complete


def saved_state(saved: Any, path: Path) -> TrainState:
    """The TrainState a checkpoint saved. Keys this trainer does not know (a newer one wrote them, and the
    job's image was rolled back) are logged and left out; a state without the step, token and sample
    counters raises ValueError: the checkpoint is skipped as one whose files do not load."""
    missing = [key for key in _REQUIRED_STATE if not isinstance(saved, dict) or key not in saved]
    if missing:
        raise ValueError(f"{STATE_FILE} has no {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(TrainState)}
    unknown = sorted(set(saved) - known)
    if unknown:
        log.warning(
            "checkpoint %s: ignoring %s in %s (a newer trainer's)", path, ", ".join(unknown), STATE_FILE
        )
    return TrainState(**{key: value for key, value in saved.items() if key in known})


def _small_files(path: Path, rank: int) -> tuple[dict[str, Any] | None, str | None]:
    """Everything but the tensors, as this rank needs it; or None and why (with a warning) when a file
    does not load, or this rank cannot see the checkpoint (a node's copy of a folder not shared). Raises
    the TrainerError to stop on when permission is denied or the storage fails (:func:`_read_failure`)."""
    try:
        optional = (name for name in (SCALER_FILE, rng_file(rank)) if (path / name).is_file())
        names = [SCHEDULER_FILE, *optional]
        files: dict[str, Any] = {STATE_FILE: saved_state(json.loads((path / STATE_FILE).read_text()), path)}
        for name in names:
            files[name] = torch.load(path / name, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated pickle can raise nearly anything
        stop = read_failure(exc, f"rank {rank} could not read checkpoint {path}", path)
        if stop is not None:
            raise stop from exc  # the caller stops the run: a restart may read it, or the owner fix it
        why = f"its files do not load on rank {rank} ({type(exc).__name__}: {exc})"
        log.warning("skipping checkpoint %s: %s", path, why)
        return None, why
    return files, None
