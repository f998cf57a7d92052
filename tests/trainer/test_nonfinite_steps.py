"""A step whose loss or gradients are not finite leaves the weights as they were; five in a row end the run
as diverged, a preemption in the middle of them included. fp16 overflows hold the schedule back, and count
too once the loss scale is spent; FSDP's bf16 inputs never round the loss divisor."""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sftjob.config import TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import tiny
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.distributed import DistContext, _fully_shard
from sftjob_trainer.loop import (
    MAX_NONFINITE_STEPS,
    MIN_LOSS_SCALE,
    NonFiniteSteps,
    StepResult,
    build_optimizer,
    build_scheduler,
    make_scaler,
    train_step,
)
from sftjob_trainer.model import precision_plan
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

CPU = DistContext(0, 1, 0, 1, torch.device("cpu"))
RARE_TOKEN = 3  # in the first example only


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    """Two steps of two micro-batches; only the first step sees ``RARE_TOKEN``."""
    rng = random.Random(0)
    examples = []
    for _ in range(4):
        ids = [rng.randrange(4, 300) for _ in range(20)]
        examples.append(Example(ids, [IGNORE_INDEX] * 5 + ids[5:]))
    examples[0].input_ids[3] = RARE_TOKEN
    rows = [collate([unit], Layout(False, False, 0)) for unit in make_units(examples, None)]
    return [rows[:2], rows[2:]]


def _trainables(precision: str = "fp32") -> tuple[Trainables, Any]:
    torch.manual_seed(0)
    model = tiny.tiny_llama(tiny.make_tokenizer())
    settings = TrainingSettings(
        global_batch_size=2, micro_batch_size=1, gradient_accumulation_steps=2, warmup_ratio=0.0
    )
    optimizer = build_optimizer(model, settings, CPU.device)
    plan = precision_plan("full", precision)  # type: ignore[arg-type]
    scaler = make_scaler(plan, CPU.device)
    return Trainables(model, optimizer, build_scheduler(optimizer, settings, 10), scaler), plan


def _embedding(model: Any) -> torch.Tensor:
    return model.get_input_embeddings().weight


def _poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        _embedding(model)[RARE_TOKEN, 0] = float("inf")


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_step_with_an_infinite_gradient_leaves_weights_optimizer_and_schedule_as_they_were() -> None:
    parts, plan = _trainables()
    _poison(parts.model)
    first, second = _batches()
    before = _weights(parts.model)

    result = train_step(parts, first, plan, 1.0, CPU)

    assert result.skipped == "non-finite"
    assert all(torch.equal(b, a) for b, a in zip(before, parts.model.parameters(), strict=True))
    assert parts.optimizer.state == {} and parts.scheduler.last_epoch == 0
    assert all(p.grad is None for p in parts.model.parameters())

    after = train_step(parts, second, plan, 1.0, CPU)  # a batch without the poisoned token

    assert after.skipped is None and torch.isfinite(torch.tensor([after.loss, after.grad_norm])).all()
    trained = [p for p in parts.model.parameters() if p.requires_grad]
    assert all(torch.isfinite(p).all() for p in trained[1:])  # all but the embedding with its inf
    assert parts.scheduler.last_epoch == 1


def test_an_fp16_overflow_lowers_the_loss_scale_and_holds_the_schedule_back() -> None:
    parts, plan = _trainables("fp16")
    assert parts.scaler is not None
    first, second = _batches()
    train_step(parts, second, plan, 1.0, CPU)
    scale = parts.scaler.get_scale()
    steps = parts.scheduler.last_epoch
    before = _weights(parts.model)
    # A gradient too large for the scale: the embedding's overflows.
    _embedding(parts.model).register_hook(lambda grad: grad * float("inf"))

    result = train_step(parts, first, plan, 1.0, CPU)

    assert result.skipped == "overflow" and not math.isfinite(result.grad_norm)
    assert parts.scaler.get_scale() < scale and parts.scheduler.last_epoch == steps
    assert all(torch.equal(b, a) for b, a in zip(before, parts.model.parameters(), strict=True))


def test_gradients_that_overflow_at_every_loss_scale_end_the_run_as_diverged_weights_untouched() -> None:
    parts, plan = _trainables("fp16")
    assert parts.scaler is not None
    first, _ = _batches()
    before = _weights(parts.model)
    # The loss stays finite; the embedding's gradient is infinite whatever the scale.
    _embedding(parts.model).register_hook(lambda grad: grad * float("inf"))
    watch, kinds = NonFiniteSteps(), []
    # The scale halves from 2**16 on every overflow: 16 overflows take it to MIN_LOSS_SCALE (1).
    allowed = int(math.log2(parts.scaler.get_scale() / MIN_LOSS_SCALE)) + MAX_NONFINITE_STEPS

    with pytest.raises(TrainerError) as raised:
        for step in range(1, 10 * allowed):
            result = train_step(parts, first, plan, 1.0, CPU)
            kinds.append(result.skipped)
            watch.count(result, step)

    assert raised.value.code == ExitCode.DIVERGED and len(kinds) == allowed
    assert kinds == ["overflow"] * (allowed - MAX_NONFINITE_STEPS) + ["non-finite"] * MAX_NONFINITE_STEPS
    assert parts.scaler.get_scale() < MIN_LOSS_SCALE and parts.scheduler.last_epoch == 0
    assert parts.optimizer.state == {}
    assert all(torch.equal(b, a) for b, a in zip(before, parts.model.parameters(), strict=True))


def _result(loss: float, skipped: Any = None) -> StepResult:
    return StepResult(loss, loss, 2e-4, 100, 4, 1000, skipped)


def test_five_non_finite_steps_in_a_row_end_the_run_as_diverged_with_advice() -> None:
    watch = NonFiniteSteps()
    for step in range(1, MAX_NONFINITE_STEPS):
        watch.count(_result(float("nan"), "non-finite"), step)

    with pytest.raises(TrainerError) as raised:
        watch.count(_result(float("nan"), "non-finite"), MAX_NONFINITE_STEPS)

    assert raised.value.code == ExitCode.DIVERGED
    assert f"not finite for {MAX_NONFINITE_STEPS} steps in a row, up to step {MAX_NONFINITE_STEPS}" in str(
        raised.value
    )
    assert "spec.training.learningRate (now 0.0002)" in str(raised.value)


def test_a_finite_step_or_an_fp16_overflow_between_non_finite_ones_starts_the_count_again() -> None:
    watch = NonFiniteSteps()
    for step in range(1, 4 * MAX_NONFINITE_STEPS):
        skipped = "non-finite" if step % MAX_NONFINITE_STEPS else ("overflow" if step % 2 else None)
        watch.count(_result(float("inf") if skipped else 1.0, skipped), step)
    assert watch.in_a_row == MAX_NONFINITE_STEPS - 1


def test_non_finite_steps_in_a_row_before_a_preemption_count_towards_divergence_after_the_resume(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, termination_log: Path
) -> None:
    from sftjob_trainer import train

    real, taken = train.train_step, itertools.count(1)
    sigterm_at, bad = 8, set(range(5, 5 + MAX_NONFINITE_STEPS))  # steps 5 to 9 are not finite

    def scripted(*args: Any, **kwargs: Any) -> StepResult:
        result, step = real(*args, **kwargs), next(taken)
        if step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # the pod is deleted during step 8, the 4th in a row
        return replace(result, loss=float("nan"), skipped="non-finite") if step in bad else result

    monkeypatch.setattr(train, "train_step", scripted)
    config = trainer_config("messages", checkpoints={"everySteps": 100})
    assert run(str(config)) == ExitCode.PREEMPTED
    taken = itertools.count(sigterm_at + 1)  # the resumed attempt's first step is step 9
    # Before, the count started again at 0: step 9 was the first of five more allowed.
    assert run(str(config)) == ExitCode.DIVERGED
    assert f"not finite for {MAX_NONFINITE_STEPS} steps in a row, up to step 9" in termination_log.read_text()


def test_an_fsdp_bf16_forward_divides_the_loss_by_the_exact_number_of_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.loss.loss_utils as loss_utils

    divisors: list[Any] = []
    cross_entropy = loss_utils.fixed_cross_entropy

    def spy(source: Any, target: Any, num_items_in_batch: Any = None, *args: Any, **kwargs: Any) -> Any:
        divisors.append(num_items_in_batch)
        return cross_entropy(source, target, num_items_in_batch, *args, **kwargs)

    monkeypatch.setattr(loss_utils, "fixed_cross_entropy", spy)
    parts, plan = _trainables("bf16")
    micro_batch = _batches()[0][0]
    micro_batch["num_targets"] = torch.tensor(1001)  # as if the other ranks' batches held the rest
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parts.model = _fully_shard(parts.model, torch.bfloat16, None)
        train_step(parts, [micro_batch], plan, 1.0, CPU)
    finally:
        dist.destroy_process_group()

    assert divisors == [1001]
