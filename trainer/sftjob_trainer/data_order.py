"""Where the data order stands across a resume, so that a resume with another layout neither repeats nor
skips an epoch's examples.

The data order follows from the step (batching.py) as long as the layout it depends on is the same: a
checkpoint records that layout (:func:`fingerprint`) and the rows its epoch has used so far
(:func:`used_rows`). A resume with another layout (an OOM re-plan halved the packed rows) goes on with the
rest of that epoch, those rows left out (:func:`data_order`, :func:`rest_of_epoch`), and an epochs run then
ends where that data ends (:func:`follow`). Kept apart from resume.py, which finds and loads the
checkpoint: what its data order is follows from the state it saved, not from how its tensors load.
"""

from __future__ import annotations

import base64
import logging
import zlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from sftjob.config import TrainingSettings
from sftjob_trainer.batching import Course, Schedule, Unit, count_units, make_units, rest_examples
from sftjob_trainer.checkpoints import Trainables, TrainState, newest_saved_state
from sftjob_trainer.loop import continue_course, next_course

log = logging.getLogger(__name__)

# Fingerprint keys that are not the layout: the worldSize older checkpoints recorded, and where the data
# order stands (the rest of an epoch it goes on with, the rows the checkpoint's epoch has used).
_NOT_LAYOUT = ("worldSize", "rest", "used")


def fingerprint(units: int, schedule: Schedule, seed: int, packing: bool) -> dict[str, Any]:
    """What the data order depends on: which units a step takes follows from the units, the global batch
    and the seed (batching.Schedule), not from how many ranks share the batch."""
    return {"units": units, "perStep": schedule.per_step, "seed": seed, "packing": packing}


def same_data_order(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a checkpoint's :func:`fingerprint` gives the data order ``now`` does: the same layout."""
    return layout_of(saved) == now


def layout_of(saved: dict[str, Any]) -> dict[str, Any]:
    """The layout a checkpoint's :func:`fingerprint` records, without where its data order stands."""
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
        saved = newest_saved_state(root)
        if saved is None:
            return next_course({}, 0, training, planned), schedule
        course, step = saved.get("course") or {}, int(saved["step"])
        layout = fingerprint(len(units), schedule, training.seed, training.packing)
        order = data_order(saved.get("fingerprint") or {}, layout, step)
        if "rest" not in order:
            expected = next_course(course, step, training, planned)
            return expected, replace(schedule, offset=expected.offset)
        _, going = rest_of_epoch(order, step, units, schedule, packing_length, pack=False)
        ending = _ending_with_data(course, step, training, planned, None, going)
        return ending or next_course(course, step, training, planned), going
    except (OSError, ValueError, TypeError, KeyError, AttributeError, zlib.error) as exc:
        log.info("the course of the newest checkpoint in %s is not known before it loads: %s", root, exc)
        return None
