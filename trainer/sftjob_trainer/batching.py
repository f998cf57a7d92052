"""From tokenized examples to the micro-batches of every optimizer step, deterministically.

Packing puts whole examples into rows of ``packing_length`` tokens (best-fit decreasing) with
``position_ids`` restarting at 0 for every example. With a varlen attention (``sftjob_varlen``, used for
packed SDPA runs, or FlashAttention-2) the rows of a micro-batch are flattened into one row and the
example boundaries go to the model once as cumulative lengths (``cu_seq_lens``), so no example attends
to another and no mask is built; with eager attention transformers turns the restarting positions into a
block-diagonal mask. Without packing a micro-batch is padded to its longest example. Which units an
optimizer step uses is a pure function of (seed, epoch, step), so a resumed run only needs the step
number to continue on exactly the same data. A resume with another layout (an OOM re-plan halved the
rows, the batch or world size changed) cannot go on in the old layout's order: the units differ. It
trains the rest of the interrupted epoch first, packed anew from the examples that epoch had not used
yet (:class:`Rest`, from the rows a checkpoint records), then the new layout's own epochs; its
:class:`Course` ends where that data ends, so every example is trained once an epoch whatever the layout.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.data import IGNORE_INDEX, Example

log = logging.getLogger(__name__)

UNUSED_UNITS_WARN_FRACTION = 0.1  # of the units an epoch leaves out (a remainder smaller than one step)


@dataclass(frozen=True, eq=False, slots=True)
class Unit:
    """What the sampler shuffles: one example, or one packed row of several.

    Tokens are int32 arrays, 8 bytes a token with the labels. Every rank holds the whole tokenized
    dataset: measured, 8-9 bytes a token resident (13 for unpacked examples of 100 tokens) and 17 at the
    peak, while packing holds the examples' arrays and the rows' together (and after, until
    :func:`trim_heap` gives the freed heap back); 200 M tokens take about 1.8 GB per process, 3.4 GB at
    the peak. The DataLoader workers a rank forks share the arrays, but reading a unit writes reference
    counts into the pages its small arrays share with their headers: a worker ends up copying about 3
    bytes a token of short unpacked examples (100 tokens), a tenth of that packed. ``rows`` names the
    examples for a resume with another layout (:class:`Rest`): about 50 bytes an example more packed, 80
    unpacked.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: tuple[int, ...]  # the examples inside, in order
    rows: tuple[int, ...] = ()  # their dataset rows (Example.row), in the same order

    @property
    def position_ids(self) -> np.ndarray:
        """Restarting at 0 for every example inside."""
        return np.concatenate([np.arange(n, dtype=np.int32) for n in self.lengths])


@dataclass(frozen=True)
class Layout:
    packing: bool
    flatten: bool  # varlen attention: one row per micro-batch, no padding, cu_seq_lens
    pad_id: int


def make_units(examples: list[Example], packing_length: int | None) -> list[Unit]:
    """Pack examples into rows (best-fit decreasing), or keep one example per unit.

    Examples are never split: ``load_examples`` already cut them to the row length, and a longer one here
    is a caller's error rather than an answer silently dropped.
    """
    if packing_length is None:
        return [_pack([e]) for e in examples]
    return [_pack(row) for row in _rows(examples, packing_length)]


def count_units(examples: list[Example], packing_length: int | None) -> int:
    """How many units :func:`make_units` makes of ``examples``, without joining their tokens."""
    return len(examples) if packing_length is None else len(_rows(examples, packing_length))


def _rows(examples: list[Example], packing_length: int) -> list[list[Example]]:
    """The examples of each packed row (best-fit decreasing)."""
    bins: list[list[Example]] = []
    free: list[tuple[int, int]] = []  # sorted (free tokens, bin index)
    for example in sorted(examples, key=lambda e: len(e.input_ids), reverse=True):
        size = len(example.input_ids)
        if size > packing_length:
            raise ValueError(f"an example of {size} tokens does not fit a packed row of {packing_length}")
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            room, index = free.pop(slot)
        else:
            room, index = packing_length, len(bins)
            bins.append([])
        bins[index].append(example)
        bisect.insort(free, (room - size, index))
    return bins


def _pack(examples: list[Example]) -> Unit:
    """One example's unit shares its arrays (the examples are dropped once packed); several are joined."""

    def joined(tokens: list[np.ndarray]) -> np.ndarray:
        if len(tokens) == 1:
            return np.asarray(tokens[0], dtype=np.int32)
        return np.concatenate(tokens, dtype=np.int32)

    lengths = tuple(len(e.input_ids) for e in examples)
    rows = tuple(e.row for e in examples)
    return Unit(joined([e.input_ids for e in examples]), joined([e.labels for e in examples]), lengths, rows)


def examples_of(units: Iterable[Unit]) -> Iterator[Example]:
    """The examples packed into ``units``, in order, their tokens views of the units' arrays."""
    for unit in units:
        start = 0
        for length, row in zip(unit.lengths, unit.rows, strict=True):
            yield Example(unit.input_ids[start : start + length], unit.labels[start : start + length], row)
            start += length


def rest_examples(units: Sequence[Unit], used: np.ndarray) -> list[Example]:
    """The examples of ``units`` whose rows are not in ``used``: the rest of an epoch another layout
    interrupted (:class:`Rest`). Packed anew, unpacked ones share their arrays with ``units``."""
    rows = np.fromiter((row for unit in units for row in unit.rows), dtype=np.int64)
    unused = np.isin(rows, used, invert=True).tolist()
    return [e for e, keep in zip(examples_of(units), unused, strict=True) if keep]


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``; nothing where the C library
    has none), once the examples are packed and dropped: their small arrays lie among the units', and
    freed, they would stay resident."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


@dataclass(frozen=True, eq=False)
class Rest:
    """The rest of epoch ``epoch``, which a resume with another layout interrupted at step ``start``: the
    examples the epoch had not used by then (those whose rows are not in ``used``), packed anew into
    ``units`` units, which follow the layout's own ones from index ``first``. Shuffled with the epoch's
    seed, they take the steps up to ``end``; the remainder short of one step is left out, as every
    epoch's is. The next epoch starts at step ``end``, in the layout's own units."""

    epoch: int
    start: int
    first: int
    units: int
    used: np.ndarray  # sorted rows
    end: int


@dataclass(frozen=True)
class Schedule:
    """Which units each rank uses for each micro-batch of each optimizer step.

    Step ``s`` takes the units at data position ``s + offset``: the offset is non-zero only after a resume
    that changed the layout (see :class:`Course`). Such a resume trains the ``rest`` of the epoch it
    interrupted first, as the last steps of that epoch's positions (:meth:`resting`).
    """

    units: int
    micro_batch_size: int
    accumulation: int
    world_size: int
    seed: int
    offset: int = 0
    rest: Rest | None = None

    @property
    def per_step(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.units // self.per_step

    def validate(self) -> None:
        """Fail when the data cannot fill one step; say how many units every epoch leaves out (each epoch
        drops the remainder of its shuffled order, a different random set every time)."""
        if self.steps_per_epoch == 0:
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"the dataset gives {self.units} training units (packed rows or examples) but one"
                f" optimizer step needs {self.per_step} (micro-batch x accumulation x GPUs):"
                " add data or lower the batch",
            )
        unused = self.units - self.steps_per_epoch * self.per_step
        message = (
            f"each epoch trains on {self.steps_per_epoch * self.per_step} of {self.units} units and leaves"
            f" out {unused} ({unused / self.units:.1%}), fewer than the {self.per_step} of one step"
        )
        if unused / self.units > UNUSED_UNITS_WARN_FRACTION:
            log.warning("%s: add data or lower the global batch", message)
        else:
            log.info(message)

    def total_steps(self, epochs: float, max_steps: int | None) -> int:
        return max_steps if max_steps is not None else max(1, math.ceil(epochs * self.steps_per_epoch))

    def epoch_of(self, step: int) -> float:
        return (step + self.offset) / self.steps_per_epoch

    def starting(self, epoch: int, step: int) -> Schedule:
        """This schedule with epoch ``epoch`` starting at step ``step`` (and no rest before it)."""
        return replace(self, offset=epoch * self.steps_per_epoch - step, rest=None)

    def resting(self, epoch: int, step: int, units: int, used: np.ndarray) -> Schedule:
        """This schedule going on at step ``step`` with the rest of epoch ``epoch`` (:class:`Rest`):
        ``units`` units that follow the layout's own ones. Its steps take the last positions of the epoch,
        so that the next one starts after them and the run's data ends where the layout's does."""
        end = step + units // self.per_step
        rest = Rest(epoch, step, self.units, units, used, end)
        return replace(self.starting(epoch + 1, end), rest=rest)

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        _, order, base = self._position(step)
        mb = self.micro_batch_size
        return [
            order[
                base + (m * self.world_size + rank) * mb : base + (m * self.world_size + rank + 1) * mb
            ].tolist()
            for m in range(self.accumulation)
        ]

    def used(self, step: int, units: Sequence[Unit]) -> tuple[int, np.ndarray]:
        """The epoch of the data after ``step`` steps and the rows its steps so far have taken (sorted):
        what a checkpoint of that step records for a resume with another layout (:class:`Rest`)."""
        epoch, order, base = self._position(step)
        taken = np.fromiter((row for i in order[:base].tolist() for row in units[i].rows), dtype=np.int64)
        rest = self.rest
        if rest is not None and step < rest.end:
            taken = np.concatenate([rest.used, taken])
        return epoch, np.unique(taken)

    def _position(self, step: int) -> tuple[int, torch.Tensor, int]:
        """The epoch ``step`` is in, its shuffled units and where in them the units of ``step`` start."""
        rest = self.rest
        if rest is not None and step < rest.end:
            generator = torch.Generator().manual_seed(self.seed + rest.epoch)
            order = rest.first + torch.randperm(rest.units, generator=generator)
            return rest.epoch, order, (step - rest.start) * self.per_step
        epoch, offset = divmod(step + self.offset, self.steps_per_epoch)
        order = torch.randperm(self.units, generator=torch.Generator().manual_seed(self.seed + epoch))
        return epoch, order, offset * self.per_step


@dataclass(frozen=True)
class Course:
    """Where a run ends and how far along it is, kept through a resume that changed the data layout.

    The learning-rate schedule is laid out over ``schedule_steps``, the steps the run was first planned
    with. A fresh run ends there. A resume whose layout takes ``planned`` steps for a whole run where the
    course expected another number (an OOM re-plan halved the rows: twice the steps per epoch) continues
    from the same fraction of the run: from ``from_step``, at ``from_position`` in the schedule, it ends
    at ``total`` after the share of ``planned`` steps still to do, and reads the last steps of the new
    layout's epochs (``offset``: the run's end meets the end of its planned data). When the resume knows
    where the new layout's data stands (the rest of the interrupted epoch, :meth:`Schedule.resting`), the
    run ends where that data ends instead. The learning rate goes on from where it stood (``rate_from``,
    after ``updates_from`` optimizer updates) at the new pace (:meth:`rate_position`). A resume with an
    unchanged layout (``planned`` is ``total + offset``) keeps the course as it is.
    ``length`` is the run length the user asked for (``epochs`` or ``maxSteps``): a job recreated with
    another one starts a new course instead.

    Steps and positions count training steps; the schedule counts updates (the scheduler's
    ``last_epoch``): a skipped step (loop.py: fp16 overflow, non-finite) is a step but no update, and
    holds the schedule back by one step of the current layout, as HF's Trainer does.
    """

    schedule_steps: int
    total: int
    from_step: int = 0
    from_position: float = 0.0
    offset: int = 0
    length: str = field(default="", compare=False)
    updates_from: int = 0
    rate_from: float = 0.0

    @classmethod
    def fresh(cls, planned: int, length: str = "") -> Course:
        return cls(planned, planned, length=length)

    @classmethod
    def saved(cls, fields: dict[str, Any]) -> Course:
        """The course a checkpoint saved (``dataclasses.asdict``); one saved before the learning rate's
        own start was kept resumed with no skipped step before it."""
        rate = {"updates_from": fields.get("from_step", 0), "rate_from": fields.get("from_position", 0.0)}
        return cls(**(rate | fields))

    @property
    def replanned(self) -> bool:
        """Whether the run no longer follows its schedule step for step (a resume changed the layout)."""
        return self != Course.fresh(self.schedule_steps)

    @property
    def pace(self) -> float:
        """Steps of the planned schedule per step of this layout."""
        return (self.schedule_steps - self.from_position) / max(1, self.total - self.from_step)

    def position(self, step: int) -> float:
        """How far along the run ``step`` is (in steps of the first plan)."""
        return self.from_position + (step - self.from_step) * self.pace

    def rate_position(self, updates: int) -> float:
        """Where the learning rate is in the planned schedule after ``updates`` optimizer updates."""
        return self.rate_from + (updates - self.updates_from) * self.pace

    def resumed(
        self, step: int, planned: int, updates: int | None = None, offset: int | None = None
    ) -> Course:
        """The course of a run restarted at ``step``, after ``updates`` optimizer updates (the restored
        scheduler's; ``step`` when none was skipped), with a layout that takes ``planned`` steps in all.
        ``offset``: where that layout's data stands, when the resume knows it (step ``step`` takes the
        data at position ``step + offset``): the run ends at ``planned - offset``, where that data ends;
        else after the share of ``planned`` steps still to do."""
        if planned == self.total + self.offset and offset in (None, self.offset):
            return self
        updates = step if updates is None else updates
        position = self.position(step)
        total = self._end(step, position, planned) if offset is None else max(step, planned - offset)
        return Course(
            self.schedule_steps,
            total,
            step,
            position,
            offset=planned - total,
            length=self.length,
            updates_from=updates,
            rate_from=self.rate_position(updates),
        )

    def _end(self, step: int, position: float, planned: int) -> int:
        left = max(0.0, (self.schedule_steps - position) * planned / self.schedule_steps)
        return step + math.ceil(left)


def collate(units: list[Unit], layout: Layout) -> dict[str, torch.Tensor]:
    """Model inputs for one micro-batch plus counters: real tokens, samples, loss terms, attention pairs.

    Flattened rows also carry ``cu_seq_lens`` (int32 cumulative example lengths) and ``max_length``.
    """
    if layout.packing and layout.flatten:
        batch = {
            "input_ids": _long([np.concatenate([u.input_ids for u in units])]),
            "labels": _long([np.concatenate([u.labels for u in units])]),
            "position_ids": _long([np.concatenate([u.position_ids for u in units])]),
        }
        bounds = [n for u in units for n in u.lengths]
        batch["cu_seq_lens"] = torch.tensor([0, *itertools.accumulate(bounds)], dtype=torch.int32)
        batch["max_length"] = torch.tensor(max(bounds))
    else:
        width = max(len(u.input_ids) for u in units)

        def padded(rows: Iterable[np.ndarray], fill: Callable[[int], np.ndarray]) -> torch.Tensor:
            return _long([np.concatenate([row, fill(width - len(row))]) for row in rows])

        batch = {
            "input_ids": padded((u.input_ids for u in units), lambda p: np.full(p, layout.pad_id)),
            "labels": padded((u.labels for u in units), lambda p: np.full(p, IGNORE_INDEX)),
        }
        if layout.packing:  # padding forms its own "sequence" so it attends to nothing real
            batch["position_ids"] = padded((u.position_ids for u in units), np.arange)
        else:
            ones = (np.ones(len(u.input_ids)) for u in units)
            batch["attention_mask"] = padded(ones, np.zeros)
    lengths = [n for u in units for n in u.lengths]
    batch["num_tokens"] = torch.tensor(sum(lengths))
    batch["num_samples"] = torch.tensor(len(lengths))
    batch["num_targets"] = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    # Query-key pairs causal attention computes (for the attention FLOPs in MFU).
    batch["attention_pairs"] = torch.tensor(sum(n * (n + 1) // 2 for n in lengths))
    return batch


def _long(rows: list[np.ndarray]) -> torch.Tensor:
    """Equal-length rows as the int64 tensor embeddings and the loss take."""
    return torch.from_numpy(np.stack(rows).astype(np.int64))


class StepBatches(Dataset[list[dict[str, torch.Tensor]]]):
    """Item ``i`` is the list of micro-batches this rank runs for optimizer step ``first_step + i``."""

    def __init__(
        self,
        units: list[Unit],
        schedule: Schedule,
        layout: Layout,
        rank: int,
        first_step: int,
        last_step: int,
    ) -> None:
        self.units, self.schedule, self.layout, self.rank = units, schedule, layout, rank
        self.first_step, self.last_step = first_step, last_step

    def __len__(self) -> int:
        return max(0, self.last_step - self.first_step)

    def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:
        picks = self.schedule.micro_batches(self.first_step + index, self.rank)
        return [collate([self.units[i] for i in pick], self.layout) for pick in picks]
