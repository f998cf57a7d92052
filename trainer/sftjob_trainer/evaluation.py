"""The loss on examples the run does not train on (``spec.evaluation``): which ones, and how it is measured.

The held-out examples are another split of the dataset, or a fraction of the training rows: each row gets
a random key from ``training.seed`` and its row number, and the rows with the smallest keys are held out,
the same ones on every rank and in every attempt (also after an OOM re-plan cut the examples shorter), so
a resumed run never trains on what it evaluated before. At most ``max_samples`` of them are kept. They are
packed like the training rows and cut to the same length.

Every rank evaluates its share in micro-batches of the training's size, as many forward passes on every
rank (a sharded model gathers its weights in each one; a rank with nothing left runs a batch without
targets), in eval mode (no dropout, no recomputation) and without gradients. The loss is the sum over
every target token of every rank divided by their number, as training's is (computed as training computes
it: ``loop.micro_batch_loss``), whatever the micro-batch size: the cross-entropy alone, without the router
load-balancing loss a mixture of experts' config may have it add (``loop.router_balancing``), which would
count once per micro-batch. Liger's fused loss is asked for explicitly (it skips the logits only in
training mode by default): evaluation then needs no more memory than a training step did.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sftjob.config import DatasetSource, EvaluationSettings, TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.batching import Layout, Unit, collate, make_units
from sftjob_trainer.data import IGNORE_INDEX, Example, load_examples
from sftjob_trainer.dataset_folders import files_of
from sftjob_trainer.distributed import DistContext, unwrap
from sftjob_trainer.liger import liger_kernels_in
from sftjob_trainer.loop import micro_batch_loss, model_inputs
from sftjob_trainer.model import PrecisionPlan

log = logging.getLogger("sftjob_trainer")


def held_out(
    config: TrainerConfig,
    examples: list[Example],
    rows: int,
    fmt: str,
    tokenizer: Any,
    row_length: int | None,
) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples as ``config.evaluation`` asks (every example trains without it);
    ``rows``: the dataset rows the examples came from."""
    settings, seed = config.evaluation, config.training.seed
    if settings is None:
        return examples, []
    if settings.split is None:
        examples, held = hold_out(examples, rows, settings, seed)
        where = f"held out of {len(examples) + len(held)} training examples"
    else:
        held = load_split(config.dataset, settings, fmt, tokenizer, row_length, seed)
        where = f"from split {settings.split}"
    log.info("evaluation: %d examples %s", len(held), where)
    return examples, held


def hold_out(
    examples: list[Example], rows: int, settings: EvaluationSettings, seed: int
) -> tuple[list[Example], list[Example]]:
    """(training, held-out) examples: the rows whose seeded key falls below ``settings.fraction``, at most
    ``max_samples`` of them (the smallest keys), and the row with the smallest key in any case. A row's
    key depends on the seed and its number alone, so the rows held out stay the same whatever else changes
    (an OOM re-plan cutting the examples shorter drops others): no row evaluated in one attempt trains in
    another. A held-out row without an example (malformed, or left without a target) is not replaced by
    another, which an earlier attempt may have trained on: with none left, nothing is evaluated."""
    assert settings.fraction is not None
    keys = _row_keys(rows, seed)
    cap = _smallest(keys, settings.max_samples)
    chosen = {int(np.argmin(keys))} if rows else set()
    chosen |= {e.row for e in examples if keys[e.row] < settings.fraction and keys[e.row] <= cap}
    train = [e for e in examples if e.row not in chosen]
    if not train:
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"evaluation.fraction {settings.fraction} of {len(examples)} examples leaves none to train on:"
            " add data or evaluate on another split (evaluation.split)",
        )
    held = [e for e in examples if e.row in chosen]
    if not held:
        log.warning(
            "evaluation.fraction %s holds out no usable example: the rows it holds out (those whose key is"
            " below it, and row %d of the dataset, from 1 in reading order, whose key is the smallest) are"
            " malformed or have no target token left once cut; the run evaluates nothing rather than hold"
            " out a row it may have trained on. Raise evaluation.fraction or evaluate on another split"
            " (evaluation.split)",
            settings.fraction,
            int(np.argmin(keys)) + 1,
        )
    return train, held


def load_split(
    source: DatasetSource,
    settings: EvaluationSettings,
    fmt: str,
    tokenizer: Any,
    row_length: int | None,
    seed: int,
) -> list[Example]:
    """The held-out examples of ``settings.split``, read in the training data's format; at most
    ``max_samples`` of them (those of the rows with the smallest seeded keys). Files that the training
    split reads too are refused (a single file, or a folder whose file names name no split, reads the same
    rows for every split)."""
    assert settings.split is not None
    if source.path is not None:
        path = Path(source.path)
        held = files_of(path, settings.split, "evaluation.split")
        shared = set(files_of(path, source.split)) & set(held)
        if shared:
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"evaluation.split {settings.split!r} reads {len(shared)} file(s) that the training split"
                f" {source.split!r} reads too (e.g. {sorted(shared)[0]}): name the splits in the dataset"
                " folder's file names (train.jsonl, validation.jsonl) or use evaluation.fraction",
            )
    held_source = source.model_copy(update={"split": settings.split, "format": fmt})
    examples, stats, _ = load_examples(held_source, tokenizer, row_length)
    keys = _row_keys(stats.rows, seed)
    bound = _smallest(keys, settings.max_samples)
    return [e for e in examples if keys[e.row] <= bound]


def _row_keys(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(rows)


def _smallest(keys: np.ndarray, count: int) -> float:
    """The ``count``-th smallest key (every key when there are no more)."""
    return float(np.partition(keys, count - 1)[count - 1]) if count < len(keys) else 1.0


@dataclass(frozen=True)
class EvalSet:
    """The held-out units and how one rank batches them; ``fingerprint`` (:func:`fingerprint`) says which
    examples, as tokenized and cut, their losses are measured on."""

    units: list[Unit]
    micro_batch_size: int
    layout: Layout
    fingerprint: dict[str, Any] = field(default_factory=dict)

    @property
    def examples(self) -> int:
        return sum(len(u.lengths) for u in self.units)

    def batches(self, rank: int, world_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's micro-batches: every rank yields the same number of them (the ranks' forward
        passes must pair up), a rank short of units a batch without targets."""
        mine = self.units[rank::world_size]
        count = math.ceil(math.ceil(len(self.units) / world_size) / self.micro_batch_size)
        blank = Unit(
            self.units[0].input_ids, np.full_like(self.units[0].labels, IGNORE_INDEX), self.units[0].lengths
        )
        for i in range(count):
            picked = mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size]
            yield collate(picked or [blank], self.layout)


def eval_set(
    examples: list[Example], packing_length: int | None, micro_batch_size: int, layout: Layout
) -> EvalSet:
    return EvalSet(make_units(examples, packing_length), micro_batch_size, layout, fingerprint(examples))


def fingerprint(examples: list[Example]) -> dict[str, Any]:
    """What an evaluation loss is measured on: the number of held-out examples, of their target tokens, and
    a digest of their tokens and labels in row order. The same on every rank; another one in a resumed
    state (an OOM re-plan cut the examples shorter, a job recreated with another evaluation) means its
    losses compare with none of this attempt's (``selection.measured_on``). The packing is left out: an
    example's loss does not depend on the row it shares."""
    digest = hashlib.sha256()
    targets = 0
    for example in examples:
        labels = np.asarray(example.labels, dtype="<i4")
        digest.update(np.int64(len(labels)).tobytes())
        digest.update(np.asarray(example.input_ids, dtype="<i4").tobytes())
        digest.update(labels.tobytes())
        targets += int((labels[1:] != IGNORE_INDEX).sum())
    return {"examples": len(examples), "targets": targets, "digest": digest.hexdigest()[:16]}


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradients for the duration; the model's own mode after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def evaluate(
    model: nn.Module,
    held_out: EvalSet,
    plan: PrecisionPlan,
    ctx: DistContext,
    *,
    own_loss: bool = False,
    stop: Callable[[], bool] = lambda: False,
    tick: Callable[[], None] = lambda: None,
) -> tuple[float | None, float]:
    """Collective: the mean loss per target token over every rank's share of ``held_out``, and the
    seconds it took. Before each batch the ranks agree whether any was asked to ``stop`` (a SIGTERM: its
    grace period is for the checkpoint): then the loss is None. ``tick`` runs after each batch (rank 0's
    progress reports, so a long evaluation never looks stalled). ``own_loss``: ``loop.micro_batch_loss``."""
    started = time.monotonic()
    extra = {"skip_logits": True} if not own_loss and fused_loss_in(model) else {}
    one = torch.ones((), device=ctx.device)
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
    targets = 0.0
    with evaluating(model):
        for batch in held_out.batches(ctx.rank, ctx.world_size):
            if ctx.sum([float(stop())])[0] > 0:
                return None, time.monotonic() - started
            inputs = model_inputs(batch, ctx.device)
            with torch.autocast(ctx.device.type, dtype=plan.compute_dtype, enabled=plan.autocast):
                # Divided by 1: the sum over the batch's target tokens.
                loss = micro_batch_loss(model, inputs, one, own_loss, **extra)
            loss_sum += loss.detach().double()
            targets += float(batch["num_targets"])
            tick()
    total, count = ctx.sum([float(loss_sum), targets])
    return total / max(count, 1.0), time.monotonic() - started


def fused_loss_in(model: nn.Module) -> bool:
    """Whether the model (inside DDP and PEFT's wrappers) computes its loss with Liger's fused linear
    cross-entropy, which then has to be asked to skip the logits in eval mode too."""
    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return "fused linear cross-entropy" in liger_kernels_in(base)
