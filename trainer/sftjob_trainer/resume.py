"""Where an attempt's training starts from: the newest checkpoint that loads, else the pretrained weights.

On start every ``checkpoint-N`` is checked newest first (checkpoints.problem); one without its marker,
with a file missing or shorter than its index says, or whose files do not load is skipped with a
warning and the next older one is tried. Those newer than the one resumed from are then set aside as
``.bad-checkpoint-N`` (kept for inspection, never resumed from or deleted): a save of this run must not
rank below them, nor rotation delete the run's own progress to keep them. A storage failure while
reading (EIO, a stale handle) stops the run with the checkpoints kept as they are for the restart; so does
a permission denied (files a root process left 0600, nfs root_squash), but as a configuration error
naming the owner, which no restart changes.

A checkpoint records what training it is of (identity.py): a job created again under its name over
kept checkpoints with another base model, method, adapter shape or dataset is refused (CONFIG_ERROR,
naming what differs) before any tensor is read, rather than train on, or write as its output, the old
weights. So are checkpoints none of which fits the model (a tensor missing or of another shape: an older
trainer's checkpoints record no identity), instead of being skipped as broken.

The data order follows from the step (batching.py) as long as the layout it depends on is the same: a
checkpoint records that layout (:func:`fingerprint`) and the rows its epoch has used so far
(:func:`used_rows`). A resume with another layout goes on with the rest of that epoch, those rows left
out (:func:`data_order`, :func:`rest_of_epoch`), and an epochs run then ends where that data ends
(:func:`follow`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import time
import zlib
from collections.abc import Collection
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from sftjob.config import TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import heartbeat, ownership
from sftjob_trainer.batching import Course, Schedule, Unit, count_units, make_units, rest_examples
from sftjob_trainer.checkpoints import (
    BAD_PREFIX,
    SCALER_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    TENSORS_DIR,
    TRAINABLE,
    Trainables,
    TrainState,
    checkpoint_dirs,
    describe_failures,
    persistent_buffers,
    problem,
    rng_file,
    single_process_is_meant,
    step_of,
    trainable_tensors,
    trainable_weights,
)
from sftjob_trainer.distributed import DistContext, load_rank0_weights, loads_on_rank0
from sftjob_trainer.durable import fsync_dir
from sftjob_trainer.failures import causes, permission_advice, permission_denied, storage_failure
from sftjob_trainer.identity import afresh, identity, identity_differences
from sftjob_trainer.loop import continue_course, next_course
from sftjob_trainer.metrics import Phase, TrainerMetrics
from sftjob_trainer.model import pretrained_weights
from sftjob_trainer.observer import Observer
from sftjob_trainer.rng import restore_rng

log = logging.getLogger(__name__)

# The counters every checkpoint has had since the first trainer: without them there is nothing to resume.
_REQUIRED_STATE = ("step", "tokens", "samples")
_MISFITS_SHOWN = 3  # tensors named in the error of checkpoints that do not fit the model
# Fingerprint keys that are not the layout: the worldSize older checkpoints recorded, and where the data
# order stands (the rest of an epoch it goes on with, the rows the checkpoint's epoch has used).
_NOT_LAYOUT = ("worldSize", "rest", "used")


class Resumed(NamedTuple):
    """The checkpoint an attempt resumed from; ``without_buffers``: the model's buffers it does not hold
    (an older trainer saved none), which kept the values they had."""

    state: TrainState
    path: Path
    without_buffers: list[str]


class OtherShapes(ValueError):
    """A checkpoint lacks tensors the model has, or holds them in another shape (:class:`_Loading`): it is
    of another model, method or adapter."""


def fingerprint(units: int, schedule: Schedule, seed: int, packing: bool) -> dict[str, Any]:
    """What the data order depends on: which units a step takes follows from the units, the global batch
    and the seed (batching.Schedule), not from how many ranks share the batch."""
    return {"units": units, "perStep": schedule.per_step, "seed": seed, "packing": packing}


def same_data_order(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint's :func:`fingerprint` gives the data order ``now`` does: the same layout."""
    return _layout(saved) == now


def _layout(saved: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in saved.items() if key not in _NOT_LAYOUT}


def used_rows(schedule: Schedule, units: list[Unit], step: int) -> dict[str, Any]:
    """What a checkpoint of ``step`` records of where its data stands (``used`` in its fingerprint): the
    epoch and the rows its steps have taken so far, as a bitmap, compressed, in base64 (about 170 kB for
    a million rows)."""
    epoch, rows = schedule.used(step, units)
    bits = np.zeros(int(rows[-1]) + 1 if rows.size else 0, dtype=bool)
    bits[rows] = True
    return {"epoch": epoch, "rows": base64.b64encode(zlib.compress(np.packbits(bits).tobytes())).decode()}


def _rows(text: str) -> np.ndarray:
    """The sorted rows of :func:`used_rows`'s bitmap."""
    bits = np.unpackbits(np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8))
    return np.flatnonzero(bits).astype(np.int64)


def data_order(saved: dict[str, Any], layout: dict[str, Any], step: int) -> dict[str, Any]:
    """The fingerprint of an attempt with ``layout`` that resumes at ``step`` from a checkpoint whose
    fingerprint is ``saved``: the layout and the ``rest`` of an epoch the data goes on with (its epoch,
    the step it starts at, the rows that epoch had used: :func:`rest_of_epoch`). With the same layout, the
    checkpoint's rest if it has one; with another, the rest of the epoch the checkpoint was in, after
    the rows it records (:func:`used_rows`). A checkpoint of an older trainer records none: the new
    layout's order then goes on from the same fraction of the run (batching.Course), whatever examples
    the old one had used."""
    if same_data_order(saved, layout):
        return layout | ({"rest": saved["rest"]} if "rest" in saved else {})
    used = saved.get("used")
    if used is None:
        return layout
    return layout | {"rest": {"epoch": used["epoch"], "step": step, "rows": used["rows"]}}


def rest_of_epoch(
    order: dict[str, Any],
    step: int,
    units: list[Unit],
    schedule: Schedule,
    packing_length: int | None,
    pack: bool = True,
) -> tuple[list[Unit], Schedule]:
    """The units and the schedule of the data order ``order`` (:func:`data_order`) from ``step`` on: as they
    are without a rest; with one, ``units`` followed by the rest's, packed anew from the examples whose rows
    its epoch had not used, and a schedule that trains them first (batching.Schedule.resting). ``pack``
    False only counts them: the schedule is then for the epoch and the course the setup reports.
    Once known, the step the rest ends at is recorded in it: a resume past it packs nothing."""
    rest = order.get("rest")
    if rest is None:
        return units, schedule
    epoch, start, end = rest["epoch"], rest["step"], rest.get("end")
    if end is not None and step >= end:
        return units, schedule.starting(epoch + 1, end)
    used = _rows(rest["rows"])
    if not used.size:  # interrupted as it started: the epoch in the layout's own units
        return units, schedule.starting(epoch, start)
    examples = rest_examples(units, used)
    extra = make_units(examples, packing_length) if pack else []
    count = len(extra) if pack else count_units(examples, packing_length)
    resting = schedule.resting(epoch, start, count, used)
    assert resting.rest is not None
    rest["end"] = resting.rest.end
    if pack:
        log.info(
            "the rest of epoch %d: %d examples it has not used yet, in %d units, take steps %d to %d",
            epoch,
            len(examples),
            count,
            start + 1,
            resting.rest.end,
        )
    return [*units, *extra], resting


def follow(
    state: TrainState, parts: Trainables, training: TrainingSettings, planned: int, schedule: Schedule
) -> tuple[Course, Schedule]:
    """The course this attempt follows (loop.continue_course) and the schedule of its data, ``schedule``
    from :func:`rest_of_epoch`. Without a rest the data goes where the course says (its offset), as it
    always has; with one, the course of an epochs run ends where the data ends (:func:`_ending_with_data`),
    put in ``state`` for continue_course to keep and follow."""
    if "rest" not in state.fingerprint:
        course = continue_course(state, parts, training, planned)
        return course, replace(schedule, offset=course.offset)
    updates = parts.scheduler.last_epoch
    ending = _ending_with_data(state.course, state.step, training, planned, updates, schedule)
    before = Course.saved(state.course) if state.course else None
    if ending is not None and before is not None and ending != before:
        log.warning(
            "resuming at step %d with a data layout that takes %d steps for the whole run instead of %d:"
            " the rest of its data takes %d steps, so it ends at step %d, the learning rate continuing"
            " from where it stood",
            state.step,
            planned,
            before.total + before.offset,
            ending.total - state.step,
            ending.total,
        )
        state.course = asdict(ending)
    return continue_course(state, parts, training, planned), schedule


def _ending_with_data(
    saved: dict[str, Any],
    step: int,
    training: TrainingSettings,
    planned: int,
    updates: int | None,
    schedule: Schedule,
) -> Course | None:
    """The course ``saved`` resumed at ``step`` to end where the data of ``schedule`` ends (its offset:
    batching.Course.resumed); None where the run's end does not follow the data: a ``maxSteps`` run, a
    checkpoint without a course, another run length (which starts a new course: loop.next_course)."""
    if training.max_steps is not None or not saved:
        return None
    before = Course.saved(saved)
    if next_course(saved, step, training, planned, updates).length != before.length:
        return None
    return before.resumed(step, planned, updates, offset=schedule.offset)


def expected_course(
    root: Path,
    training: TrainingSettings,
    planned: int,
    units: list[Unit],
    schedule: Schedule,
    packing_length: int | None,
) -> tuple[Course, Schedule] | None:
    """Rank 0, before the model loads: the course this attempt will follow when it resumes from the newest
    checkpoint that looks complete (:func:`~sftjob_trainer.checkpoints.newest_complete_step`, the step the
    setup's progress reports show), read from its state without loading it, and the schedule of its data
    (:func:`follow`); a fresh one without such a checkpoint. None when that state does not read (the
    resume skips such a checkpoint, or stops): the setup's reports then leave the total and the epoch out
    until the resume knows them."""
    try:
        for _step, path in checkpoint_dirs(root):
            if problem(path) is None:
                saved = json.loads((path / STATE_FILE).read_text())
                course, step = saved.get("course") or {}, int(saved["step"])
                layout = fingerprint(len(units), schedule, training.seed, training.packing)
                order = data_order(saved.get("fingerprint") or {}, layout, step)
                if "rest" not in order:
                    expected = next_course(course, step, training, planned)
                    return expected, replace(schedule, offset=expected.offset)
                _, going = rest_of_epoch(order, step, units, schedule, packing_length, pack=False)
                ending = _ending_with_data(course, step, training, planned, None, going)
                return ending or next_course(course, step, training, planned), going
        return next_course({}, 0, training, planned), schedule
    except (OSError, ValueError, TypeError, KeyError, AttributeError, zlib.error) as exc:
        log.info("the course of the newest checkpoint in %s is not known before it loads: %s", root, exc)
        return None


def restore(
    config: TrainerConfig,
    ctx: DistContext,
    parts: Trainables,
    attention: str,
    layout: dict[str, Any],
    metrics: TrainerMetrics | None,
    observer: Observer | None,
) -> tuple[TrainState, Path | None]:
    """Collective: this attempt takes the checkpoint folder over and starts from the newest checkpoint that
    loads (returned with it), or from the pretrained weights with a fresh state (and None). ``layout`` is
    this attempt's :func:`fingerprint`, recorded in the state with where the data order stands
    (:func:`data_order`).

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
    trains = identity(config)
    with heartbeat.busy(observer, "restoring the newest checkpoint", heartbeat.io_seconds(parts.model)):
        resumed = load_latest(root, parts, ctx, trains)
    if rank0_weights and full and (resumed is None or resumed.without_buffers):
        load_pretrained(config, ctx, parts.model, attention, metrics, observer)
        if resumed is not None:
            why = load_weights(resumed.path, parts, ctx)
            if why is not None:
                raise _storage_error(f"could not read the weights of {resumed.path} again: {why}")
    if resumed is None:
        return TrainState(fingerprint=layout, identity=trains), None
    state, path, _ = resumed
    order = data_order(state.fingerprint, layout, state.step)
    if not same_data_order(state.fingerprint, layout):
        log.warning(
            "resuming with a different data layout (%s, was %s): %s",
            layout,
            _layout(state.fingerprint),
            f"the rest of epoch {order['rest']['epoch']} goes on with the examples it has not used yet,"
            " packed anew, then the new layout's epochs"
            if "rest" in order
            else f"the data order after step {state.step} differs from the interrupted run (its checkpoint,"
            " an older trainer's, does not record which examples its epoch has used)",
        )
    state.fingerprint, state.identity = order, trains
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
    model (:class:`OtherShapes`), else STORAGE_ERROR. A checkpoint whose identity (identity.py) differs from
    ``trains`` stops the run too (CONFIG_ERROR), before its tensors are read. Once one has loaded (or on
    a fresh start) every checkpoint newer than it is set aside (:func:`_set_aside_newer`).
    """
    candidates: list[Path] | tuple[ExitCode, str] = ctx.broadcast(_listing(root) if ctx.is_main else None)
    if isinstance(candidates, tuple):
        raise TrainerError(*candidates)
    failed: dict[str, str] = {}  # checkpoint name: why it did not load (as rank 0 saw it)
    misfits: list[str] = []  # the OtherShapes of those that do not fit the model
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
        differences = ctx.broadcast(
            identity_differences(small[STATE_FILE].identity, trains or {}) if ctx.is_main else None
        )
        if differences:
            raise TrainerError(
                ExitCode.CONFIG_ERROR,
                f"checkpoint {path.name} in {root} is of other training than this job's spec:"
                f" {'; '.join(differences)}. Resuming it would go on from the old weights: create the job"
                f" with the spec it was trained with to resume it; {afresh(root)}",
            )
        tensors = trainable_tensors(parts)
        planner = _Loading(persistent_buffers(parts.model, tensors["model"]))
        try:
            _load(tensors, path, ctx, planner)
        except CheckpointException as exc:  # raised on every rank alike, with every rank's failures
            stop = _tensors_failure(exc, path)
            if stop is not None:
                raise stop from exc
            failed[path.name] = f"its tensors do not load ({describe_failures(exc)})"
            log.warning("skipping checkpoint %s: %s", path, failed[path.name])
            if all(isinstance(error, OtherShapes) for error, _ in exc.failures.values()):
                misfits.append(str(next(iter(exc.failures.values()))[0]))
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
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"no checkpoint in {root} fits this model ({', '.join(failed)}; {misfits[0]}): they were"
            " trained with other settings than the spec asks for now (another base model, method,"
            " lora.r or lora.targetModules). Create the job with the settings they were trained with to"
            f" resume them; {afresh(root)}",
        )
    if failed:
        raise TrainerError(
            ExitCode.STORAGE_ERROR,
            f"no checkpoint in {root} loads ({', '.join(failed)}: the log says why): move them away to"
            " start again from the pretrained weights",
        )
    _set_aside_newer(root, 0, failed, ctx)
    return None


def load_weights(path: Path, parts: Trainables, ctx: DistContext) -> str | None:
    """Collective: the trainable weights of the checkpoint at ``path`` into the model (the optimizer is
    left alone: this is for writing the output from an earlier checkpoint, not for training on); None
    once they are in, else why they do not load (the checkpoint at fault), the model left as it was.

    Every tensor is read first without being written anywhere, then loaded: a checkpoint whose files
    fail part-way would otherwise leave the model half overwritten, and a full fine-tune's last weights
    are in no checkpoint. The storage failing, or permission denied, raises its TrainerError."""
    weights = {"model": trainable_weights(parts.model)}
    buffers = persistent_buffers(parts.model, weights["model"])
    try:
        _load(weights, path, ctx, _Reading(buffers))
        _load(weights, path, ctx, _Loading(buffers))
    except CheckpointException as exc:
        stop = _tensors_failure(exc, path)
        if stop is not None:
            raise stop from exc
        return describe_failures(exc)
    set_model_state_dict(parts.model, weights["model"], options=TRAINABLE)
    return None


def _load(tensors: dict[str, Any], path: Path, ctx: DistContext, planner: DefaultLoadPlanner) -> None:
    """Collective: the checkpoint at ``path`` into ``tensors``, as ``planner`` plans it."""
    with single_process_is_meant():
        dcp.load(
            tensors,
            storage_reader=FileSystemReader(path / TENSORS_DIR),
            planner=planner,
            no_dist=not ctx.active,
        )


class _Loading(DefaultLoadPlanner):
    """torch.distributed.checkpoint's planner, which first checks that the checkpoint holds every tensor
    asked for, in its shape: :class:`OtherShapes` otherwise, raised before anything is written. Buffers it
    does not hold (of ``optional``, the model's persistent ones: an older trainer saved none) are left out
    of the load and of ``tensors["model"]``, and listed in ``absent``."""

    def __init__(self, optional: Collection[str] = ()) -> None:
        super().__init__()
        self.optional = set(optional)
        self.absent: list[str] = []

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is not None:
            model, saved = state_dict["model"], metadata.state_dict_metadata
            self.absent = sorted(n for n in self.optional if n in model and f"model.{n}" not in saved)
            for name in self.absent:
                del model[name]
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        misfits = [m for key, value in self.state_dict.items() if (m := _misfit(key, value, saved.get(key)))]
        if misfits:
            more = len(misfits) - _MISFITS_SHOWN
            raise OtherShapes(
                f"{len(misfits)} tensor(s) do not fit the model: {'; '.join(misfits[:_MISFITS_SHOWN])}"
                + (f"; {more} more" if more > 0 else "")
            )
        return super().create_local_plan()


def _misfit(key: str, value: Any, held: Any) -> str | None:
    """How the checkpoint's ``held`` (its index's entry, None when it has none) does not fit ``value``."""
    if held is None:
        return f"{key} is not in it"
    fits = not isinstance(held, TensorStorageMetadata) or not isinstance(value, torch.Tensor)
    if fits or held.size == value.size():
        return None
    return f"{key} is {list(held.size)} in it, {list(value.size())} here"


class _Reading(_Loading):
    """:class:`_Loading` that reads every tensor into a scratch one of its size and writes none: whether
    the checkpoint's files load, the model left as it is (one tensor at a time in memory)."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.empty(tuple(read_item.lengths))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        pass


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
        raise failure or _storage_error(f"{failing} other rank(s) could not read {path} (their log says why)")
    return unreadable


def _read_failure(exc: BaseException, doing: str, folder: Path) -> TrainerError | None:
    """The error to stop on when ``doing`` failed with ``exc``: CONFIG_ERROR naming the owner when permission
    was denied anywhere in its causes, STORAGE_ERROR when the storage failed (:func:`_is_storage_failure`);
    None when the checkpoint itself is at fault."""
    denied = permission_denied(exc)
    if denied is not None:
        return storage_failure(denied, doing, folder)
    return _storage_error(f"{doing}: {exc}") if _is_storage_failure(exc) else None


def _tensors_failure(exc: CheckpointException, path: Path) -> TrainerError | None:
    """What to stop on when the tensors of ``path`` did not load on some rank (``exc`` holds every rank's
    failure): a permission denied on any of them first, then a storage failure; None to skip it."""
    errors = [error for error, _ in exc.failures.values()]
    denied = next((d for d in map(permission_denied, errors) if d is not None), None)
    if denied is not None:
        return storage_failure(denied, f"could not read checkpoint {path}", path)
    if any(_is_storage_failure(error) for error in errors):
        return _storage_error(f"could not read {path}: {describe_failures(exc)}")
    return None


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


def _listing(root: Path) -> list[Path] | tuple[ExitCode, str]:
    """The checkpoints that look complete (rank 0's view), or the code and reason to stop on when rank 0
    cannot read them (a pair: a TrainerError does not survive the broadcast's pickling)."""
    try:
        return _complete(root)
    except OSError as exc:
        stop = _read_failure(exc, f"could not list the checkpoints in {root}", root) or _storage_error(
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
        stop = _read_failure(exc, f"rank {rank} could not read checkpoint {path}", path)
        if stop is not None:
            raise stop from exc  # the caller stops the run: a restart may read it, or the owner fix it
        why = f"its files do not load on rank {rank} ({type(exc).__name__}: {exc})"
        log.warning("skipping checkpoint %s: %s", path, why)
        return None, why
    return files, None
