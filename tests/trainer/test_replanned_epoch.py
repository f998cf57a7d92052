"""A resume with another data layout (an OOM re-plan halved the packed rows) goes on with the rest of the
epoch it interrupted, packed anew from the examples that epoch had not used: every example is trained once
an epoch, none twice and none left out but the remainder short of one step every epoch leaves out, and an
epochs run ends where that data ends. A resume with the same layout goes on exactly as before."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from sftjob.config import TrainingSettings
from sftjob.failures import ExitCode
from sftjob_trainer import data_order
from sftjob_trainer.batching import Course, Schedule, StepBatches, Unit, make_units
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.data import Example
from sftjob_trainer.loop import build_scheduler
from sftjob_trainer.train import run
from tests.trainer.runs import ONE_PACKED_EPOCH, MakeConfig, killed_at

pytestmark = pytest.mark.trainer

SEED, MICRO_BATCH, RANKS = 42, 4, 2  # two ranks of four rows: eight units a step


def _examples(count: int, longest: int) -> list[Example]:
    """``count`` examples of 100 to 1000 tokens (as the review's), cut to ``longest`` like the data stage."""
    rng = np.random.default_rng(0)
    examples = []
    for row in range(count):
        tokens = np.full(int(rng.integers(100, 1000)), 7, dtype=np.int32)[:longest]
        examples.append(Example(tokens, tokens.copy(), row=row))
    return examples


def _layout(units: list[Unit]) -> dict[str, Any]:
    return data_order.fingerprint(len(units), Schedule(len(units), MICRO_BATCH, 1, RANKS, SEED), SEED, True)


@dataclass
class Trained:
    """Which rows each epoch trained, and which units of the epoch's last layout it took."""

    rows: dict[int, list[int]] = field(default_factory=dict)
    units: dict[int, set[int]] = field(default_factory=dict)

    def steps(self, units: list[Unit], schedule: Schedule, first: int, last: int) -> None:
        """Steps ``first`` + 1 to ``last``, as every rank takes them."""
        for step in range(first, last):
            epoch = math.floor(schedule.epoch_of(step))
            for rank in range(RANKS):
                for picked in schedule.micro_batches(step, rank):
                    self.rows.setdefault(epoch, []).extend(row for i in picked for row in units[i].rows)
                    self.units.setdefault(epoch, set()).update(id(units[i]) for i in picked)

    def check_epoch(self, epoch: int, examples: int, pool: list[Unit]) -> None:
        """Every example of the epoch once, but those of the units of ``pool`` (the units the epoch ended
        in) it left out: fewer than one step takes."""
        times = Counter(self.rows[epoch])
        assert max(times.values()) == 1  # none twice
        left_out = [unit for unit in pool if id(unit) not in self.units[epoch]]
        assert len(left_out) < MICRO_BATCH * RANKS
        assert sorted(set(range(examples)) - set(times)) == sorted(r for u in left_out for r in u.rows)


def _replanned(epochs: int, fraction: float) -> tuple[Trained, list[Unit], list[Unit], Schedule, Course]:
    """A packed run of ``epochs`` over 2,000 examples in rows of 2,048 tokens, killed after ``fraction`` of
    its steps and resumed with rows of 1,024, through a checkpoint's record: what each epoch trained,
    the old units, the new (the rest's after them), the new schedule and the course it ends with."""
    examples = _examples(2000, 2048)
    old = make_units(examples, 2048)
    before = Schedule(len(old), MICRO_BATCH, 1, RANKS, SEED)
    planned_before = before.total_steps(epochs, None)
    stop = int(planned_before * fraction)
    trained = Trained()
    trained.steps(old, before, 0, stop)
    saved = json.loads(json.dumps(_layout(old) | {"used": data_order.used_rows(before, old, stop)}))

    halved = make_units([Example(e.input_ids[:1024], e.labels[:1024], e.row) for e in examples], 1024)
    order = data_order.data_order(saved, _layout(halved), stop)
    after = Schedule(len(halved), MICRO_BATCH, 1, RANKS, SEED)
    units, schedule = data_order.rest_of_epoch(order, stop, halved, after, 1024)
    planned = after.total_steps(epochs, None)
    course = Course.fresh(planned_before, f"epochs {epochs}").resumed(stop, planned, offset=schedule.offset)
    trained.steps(units, schedule, stop, course.total)
    assert schedule.epoch_of(course.total) == epochs  # the run ends where its data ends
    return trained, old, units, schedule, course


def test_halving_the_rows_halfway_through_a_one_epoch_run_trains_every_example_once() -> None:
    trained, _, units, schedule, course = _replanned(epochs=1, fraction=0.5)
    assert schedule.rest is not None and schedule.rest.epoch == 0
    assert course.total == schedule.rest.end  # the rest of the epoch is the rest of the run
    # The reviewer's script: 984 of 4,000 examples twice, 978 never (f(1-f) each way).
    trained.check_epoch(0, 2000, units[schedule.rest.first :])


@pytest.mark.parametrize("fraction", [0.25, 0.75], ids=["in the first epoch", "in the second epoch"])
def test_halving_the_rows_in_either_epoch_of_two_trains_every_example_once_an_epoch(fraction: float) -> None:
    trained, old, units, schedule, course = _replanned(epochs=2, fraction=fraction)
    rest = schedule.rest
    assert rest is not None and rest.epoch == int(2 * fraction)
    own = units[: rest.first]  # the new layout's own units: the epoch after the rest
    if rest.epoch == 0:
        trained.check_epoch(0, 2000, units[rest.first :])
        trained.check_epoch(1, 2000, own)
        assert course.total == rest.end + schedule.steps_per_epoch
    else:
        trained.check_epoch(0, 2000, old)  # all in the old layout
        trained.check_epoch(1, 2000, units[rest.first :])
        assert course.total == rest.end


def test_a_resume_with_the_same_layout_takes_the_same_units_every_step_as_before() -> None:
    units = make_units(_examples(300, 2048), 2048)
    schedule = Schedule(len(units), MICRO_BATCH, 1, RANKS, SEED, offset=3)
    saved = _layout(units) | {"used": data_order.used_rows(schedule, units, 40), "worldSize": 2}
    order = data_order.data_order(saved, _layout(units), 40)
    assert order == _layout(units) and data_order.same_data_order(saved, order)
    going, same = data_order.rest_of_epoch(order, 40, units, schedule, 2048)
    assert going is units and same is schedule


def test_a_restart_with_the_same_layout_within_the_rest_of_an_epoch_goes_on_in_the_same_order() -> None:
    examples = _examples(600, 2048)
    old = make_units(examples, 2048)
    before = Schedule(len(old), MICRO_BATCH, 1, RANKS, SEED)
    saved = _layout(old) | {"used": data_order.used_rows(before, old, 10)}
    halved = make_units([Example(e.input_ids[:1024], e.labels[:1024], e.row) for e in examples], 1024)
    after = Schedule(len(halved), MICRO_BATCH, 1, RANKS, SEED)
    order = data_order.data_order(saved, _layout(halved), 10)
    units, schedule = data_order.rest_of_epoch(order, 10, halved, after, 1024)
    assert schedule.rest is not None and schedule.rest.end > 15
    # The attempt saves at step 15, within the rest, and the next one resumes there with its layout.
    checkpoint = json.loads(json.dumps(order | {"used": data_order.used_rows(schedule, units, 15)}))
    again = data_order.data_order(checkpoint, _layout(halved), 15)
    units_again, schedule_again = data_order.rest_of_epoch(again, 15, halved, after, 1024)
    for step in range(15, schedule.rest.end + 2 * schedule.steps_per_epoch):
        for rank in range(RANKS):
            picked = schedule.micro_batches(step, rank)
            assert schedule_again.micro_batches(step, rank) == picked
            assert [units_again[i].rows for p in picked for i in p] == [
                units[i].rows for p in picked for i in p
            ]
    # One that resumes past the rest packs none, and goes on in the same order.
    late = schedule.rest.end + 3
    past = data_order.data_order(
        checkpoint | {"used": data_order.used_rows(schedule, units, late)}, _layout(halved), late
    )
    units_past, schedule_past = data_order.rest_of_epoch(past, late, halved, after, 1024)
    assert units_past is halved and schedule_past.rest is None
    assert schedule_past.micro_batches(late, 1) == schedule.micro_batches(late, 1)


def test_a_layout_change_at_the_start_of_an_epoch_trains_that_epoch_in_the_new_layouts_own_units() -> None:
    examples = _examples(300, 2048)
    old = make_units(examples, 2048)
    before = Schedule(len(old), MICRO_BATCH, 1, RANKS, SEED)
    at = 2 * before.steps_per_epoch  # epoch 2 starts
    saved = _layout(old) | {"used": data_order.used_rows(before, old, at)}
    halved = make_units([Example(e.input_ids[:1024], e.labels[:1024], e.row) for e in examples], 1024)
    order = data_order.data_order(saved, _layout(halved), at)
    after = Schedule(len(halved), MICRO_BATCH, 1, RANKS, SEED)
    units, schedule = data_order.rest_of_epoch(order, at, halved, after, 1024)
    assert units is halved and schedule.rest is None
    assert schedule.micro_batches(at, 1) == after.micro_batches(2 * after.steps_per_epoch, 1)


def test_a_checkpoint_records_the_rows_its_epoch_has_used_in_under_two_bits_a_row() -> None:
    units = make_units(
        [Example(np.ones(3, np.int32), np.ones(3, np.int32), row) for row in range(100_000)], None
    )
    schedule = Schedule(len(units), 10, 1, 1, SEED)
    used = data_order.used_rows(schedule, units, 6_000)  # 60% of the epoch
    assert used["epoch"] == 0 and len(used["rows"]) < 100_000 * 2 / 8
    order = data_order.data_order(_layout(units) | {"perStep": 5, "used": used}, _layout(units), 6_000)
    _, resting = data_order.rest_of_epoch(order, 6_000, units, schedule, None)
    assert resting.rest is not None and resting.rest.units == 40_000 and order["rest"]["end"] == 10_000


def _parts(total: int) -> Trainables:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=2e-4)
    return Trainables(
        torch.nn.Linear(1, 1), optimizer, build_scheduler(optimizer, TrainingSettings(), total), None
    )


def _resumed_state(length: str, schedule_steps: int) -> tuple[TrainState, list[Unit], Schedule]:
    """A run of ``schedule_steps`` in 100 units a step, resumed at step 20 (its epoch half used) with twice
    the units: the state, units and schedule of its data order."""
    paired = [
        Unit(np.ones(6, np.int32), np.ones(6, np.int32), (3, 3), (2 * i, 2 * i + 1)) for i in range(4000)
    ]
    before = Schedule(len(paired), 100, 1, 1, SEED)  # 40 steps an epoch
    saved = data_order.fingerprint(4000, before, SEED, True) | {
        "used": data_order.used_rows(before, paired, 20)
    }
    units = make_units(
        [Example(np.ones(3, np.int32), np.ones(3, np.int32), row) for row in range(8000)], None
    )
    schedule = Schedule(len(units), 100, 1, 1, SEED)
    order = data_order.data_order(saved, data_order.fingerprint(len(units), schedule, SEED, True), 20)
    state = TrainState(step=20, fingerprint=order, course=asdict(Course.fresh(schedule_steps, length)))
    units, schedule = data_order.rest_of_epoch(order, 20, units, schedule, None)
    return state, units, schedule


def test_an_epochs_run_resumed_with_another_layout_ends_with_its_data_and_keeps_that_end_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state, _, schedule = _resumed_state("epochs 1", 40)
    with caplog.at_level(logging.WARNING):
        course, followed = data_order.follow(state, _parts(80), TrainingSettings(epochs=1), 80, schedule)
    assert followed is schedule and course.total == 20 + 40  # 4,000 examples left, 100 a step
    assert course.offset == schedule.offset and course.position(20) == 20
    assert "resuming at step 20 with a data layout that takes 80 steps" in caplog.text
    again = TrainState(step=30, fingerprint=state.fingerprint, course=state.course)  # a later restart
    assert data_order.follow(again, _parts(80), TrainingSettings(epochs=1), 80, schedule)[0] == course


def test_a_max_steps_run_resumed_with_another_layout_ends_at_its_steps_after_the_rest_of_the_epoch() -> None:
    state, _, schedule = _resumed_state("maxSteps 100", 100)
    course, followed = data_order.follow(state, _parts(100), TrainingSettings(maxSteps=100), 100, schedule)
    assert course == Course.fresh(100) and followed is schedule
    assert schedule.rest is not None and schedule.rest.end == 60
    # Then the new layout's second epoch, at its start.
    assert schedule.micro_batches(60, 0) == Schedule(8000, 100, 1, 1, SEED).micro_batches(80, 0)


def test_a_packed_run_resumed_with_halved_rows_trains_no_example_twice(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: dict[int, list[int]] = {}  # the rows each step trains, the latest attempt's
    real = StepBatches.__getitem__

    def recorded(batches: StepBatches, index: int) -> Any:
        picks = batches.schedule.micro_batches(batches.first_step + index, batches.rank)
        taken[batches.first_step + index + 1] = [
            row for pick in picks for i in pick for row in batches.units[i].rows
        ]
        return real(batches, index)

    monkeypatch.setattr(StepBatches, "__getitem__", recorded)
    config = trainer_config("messages", **ONE_PACKED_EPOCH)
    assert run(str(config)) == ExitCode.OK
    settings = killed_at(config, 6)
    first = {step: rows for step, rows in taken.items() if step <= 6}
    settings["training"]["packingLength"] = 64
    config.write_text(json.dumps(settings))
    taken.clear()
    assert run(str(config)) == ExitCode.OK
    trained = Counter(row for rows in [*first.values(), *taken.values()] for row in rows)
    assert max(trained.values()) == 1  # before, the rows the first six steps trained came round again
    # Rows of 64 tokens hold one example each here: the rest leaves out fewer than the 8 units of a step.
    assert 256 - 8 < len(trained) <= 256
