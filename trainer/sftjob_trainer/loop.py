"""One optimizer step, and the optimizer, scheduler and scaler it needs, and the course a resume follows.

Kept apart from ``train.py`` so the throughput benchmark times exactly the code jobs run. The loss is
normalised by the number of target tokens in the whole global batch (all micro-batches, all ranks),
so gradient accumulation and data parallelism give the same gradient as one big batch would: a
transformers model divides by it (``num_items_in_batch``), for any other the trainer computes the loss
from the logits (:func:`micro_batch_loss`; remote_code.py). The loss reported (logged, evaluated) is that
cross-entropy alone; a mixture of experts whose config asks for its routers' load-balancing loss trains on
it too, at its configured weight once a step (:func:`router_balancing`).

A step whose loss or gradients are not finite leaves the weights, the optimizer and the schedule as they
were (in bf16/fp32 one inf gradient would otherwise turn every weight into NaN through the clipping
factor); it still counts as a step, its batch consumed, so a resume replays the same data in the same
order. ``MAX_NONFINITE_STEPS`` of them in a row end the run as diverged (:class:`NonFiniteSteps`). Under
fp16 an overflow the loss scaler can still cure by lowering its scale does not count; one at a scale under
``MIN_LOSS_SCALE`` does, so gradients that overflow whatever the scale end the run too.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from sftjob.config import TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.batching import Course
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.data import IGNORE_INDEX
from sftjob_trainer.distributed import DistContext, no_sync, unwrap
from sftjob_trainer.model import PrecisionPlan

log = logging.getLogger("sftjob_trainer")

MODEL_INPUTS = ("input_ids", "labels", "position_ids", "attention_mask")
# Steps in a row with a non-finite loss or gradient norm that end the run as diverged. One is a batch the
# weights cannot take (skipped, as HF's Trainer and accelerate skip fp16 overflow steps); since a skipped
# step never changes the weights, the same weights failing on this many different global batches in a row
# is the weights' doing, and a restart from the last checkpoint with the same data would get there again.
# Megatron fails at the first NaN; five ride out an isolated bad batch and cost a job a few of its steps.
MAX_NONFINITE_STEPS = 5
# fp16's loss scale below which an overflow is the gradients' own, not the scale's: DeepSpeed's
# min_loss_scale default. Below 1 the scaler shrinks the gradients instead of magnifying them, and its
# halving after every overflow would otherwise go on to 0, every update skipped, none counted.
MIN_LOSS_SCALE = 1.0

# Why a step left the weights as they were: "overflow", fp16's gradients overflowed at a loss scale the
# scaler could still lower (it halved it: expected now and then); "non-finite", the loss was inf/NaN, or
# the gradients were and no loss scale is left to cure them (none, or under ``MIN_LOSS_SCALE``).
Skip = Literal["overflow", "non-finite"]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean loss per target token over the global batch
    grad_norm: float  # before clipping; inf/NaN when a gradient was
    learning_rate: float
    tokens: int  # real tokens, all ranks
    samples: int
    attention_pairs: int
    skipped: Skip | None = None  # None: the optimizer and the schedule stepped


@dataclass
class NonFiniteSteps:
    """The steps in a row skipped for a non-finite loss or gradients; the run diverged at
    ``MAX_NONFINITE_STEPS`` of them. Every rank sees the same (global) loss and norm, so all end together.
    A checkpoint saves the count (``TrainState.nonfinite_in_a_row``) and a resume starts from it: a
    preemption in the middle of a streak does not allow it more steps."""

    in_a_row: int = 0

    def count(self, result: StepResult, step: int) -> None:
        """After step ``step`` (``result``); raises ``TrainerError(DIVERGED)`` on the last one allowed."""
        if result.skipped != "non-finite":
            self.in_a_row = 0
            return
        self.in_a_row += 1
        log.warning(
            "step %d skipped, the weights kept: loss %s, gradient norm %s (%d of %d in a row allowed)",
            step,
            result.loss,
            result.grad_norm,
            self.in_a_row,
            MAX_NONFINITE_STEPS,
        )
        if self.in_a_row < MAX_NONFINITE_STEPS:
            return
        raise TrainerError(
            ExitCode.DIVERGED,
            f"training diverged: the loss or the gradient norm was not finite for {self.in_a_row} steps in"
            f" a row, up to step {step} (loss {result.loss}, gradient norm {result.grad_norm}); they were"
            " skipped, so the weights and the last checkpoint are from before them. Lower"
            f" spec.training.learningRate (now {result.learning_rate:.3g}) or raise"
            " spec.training.warmupRatio, use bf16 rather than fp16, and check the data",
        )


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(
    model: nn.Module, training: TrainingSettings, device: torch.device
) -> torch.optim.Optimizer:
    params = trainable_parameters(model)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": training.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    lr = training.learning_rate
    if training.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        try:
            bnb = importlib.import_module("bitsandbytes")
        except ImportError as exc:
            raise TrainerError(
                ExitCode.CONFIG_ERROR, f"optimizer {training.optimizer} needs bitsandbytes"
            ) from exc
        cls = bnb.optim.PagedAdamW8bit if training.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(groups, lr=lr)
    fused = training.optimizer == "adamw_torch_fused" and device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, fused=fused or None)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    training: TrainingSettings,
    total_steps: int,
    course: Course | None = None,
) -> Any:
    """The learning-rate schedule of a run of ``total_steps``; for a replanned ``course`` (a resume changed
    the layout), the schedule the run was first planned with, followed at the course's pace."""
    from transformers import get_scheduler

    steps = course.schedule_steps if course is not None else total_steps
    warmup = math.ceil(training.warmup_ratio * steps)
    scheduler = get_scheduler(
        training.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=steps
    )
    if course is None or not course.replanned:
        return scheduler
    factors = [_at_pace(shape, course) for shape in scheduler.lr_lambdas]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def _at_pace(shape: Callable[[float], float], course: Course) -> Callable[[int], float]:
    """The learning-rate factor after a number of optimizer updates (LambdaLR's ``last_epoch``, which
    skipped steps do not advance), read from the planned schedule where the course puts the rate (a plain
    function: LambdaLR keeps no state of it in the checkpoint)."""

    def factor(updates: int) -> float:
        return shape(course.rate_position(updates))

    return factor


def follow_course(parts: Trainables, training: TrainingSettings, course: Course) -> None:
    """Swap in the schedule of a course replanned on a resume, keeping the restored step and learning rates
    (the first steps after the resume continue from them)."""
    optimizer = parts.optimizer
    restored = parts.scheduler.state_dict()
    rates = [group["lr"] for group in optimizer.param_groups]
    parts.scheduler = build_scheduler(optimizer, training, course.total, course)
    parts.scheduler.load_state_dict(restored)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate


def continue_course(state: TrainState, parts: Trainables, training: TrainingSettings, planned: int) -> Course:
    """Where this attempt ends. A resume whose layout takes another number of steps for the whole run
    (``planned``; an OOM re-plan halved the rows) keeps the fraction of the run already done: it ends
    after the share still to do and follows the learning-rate schedule at the new pace. A run length
    the user changed (a job recreated over its kept checkpoints) starts a new schedule instead, laid out
    over ``planned`` steps, which the first step after the resume already follows. Either way a new
    learningRate or weightDecay replaces the checkpoint's (:func:`rebase`)."""
    before = Course.saved(state.course) if state.course else None
    course = next_course(state.course, state.step, training, planned, parts.scheduler.last_epoch)
    state.course = asdict(course)
    if before is None or before.length != course.length:
        if before is not None:
            log.warning(
                "resuming at step %d with another run length (%s, was %s): the learning-rate schedule"
                " is laid out over %d steps",
                state.step,
                course.length,
                before.length or "unknown",
                planned,
            )
        rebase(parts, training, relaid=before is not None)
        return course
    if course != before:
        log.warning(
            "resuming at step %d with a data layout that takes %d steps for the whole run instead of %d:"
            " %.1f%% of the run is done, so it ends at step %d, the learning rate continuing from there",
            state.step,
            planned,
            before.total + before.offset,
            100 * course.from_position / course.schedule_steps,
            course.total,
        )
    if course.replanned:
        follow_course(parts, training, course)
    rebase(parts, training)
    return course


def next_course(
    saved: dict[str, Any], step: int, training: TrainingSettings, planned: int, updates: int | None = None
) -> Course:
    """The course of an attempt that goes on from ``step``, after ``updates`` optimizer updates (the
    restored scheduler's count; ``step`` when unknown) and the course its checkpoint saved (``saved``, a
    ``Course`` as a dict; empty on a fresh start or from an older checkpoint) with a layout that takes
    ``planned`` steps for the whole run: that course resumed, or a fresh one over ``planned`` when there is
    none or the run length (``epochs`` or ``maxSteps``) is not the one it was laid out for."""
    t = training
    length = f"maxSteps {t.max_steps}" if t.max_steps is not None else f"epochs {t.epochs:g}"
    before = Course.saved(saved) if saved else None
    if before is None or before.length != length:
        return Course.fresh(planned, length)
    return before.resumed(step, planned, updates)


def rebase(parts: Trainables, training: TrainingSettings, relaid: bool = False) -> None:
    """A job recreated over its kept checkpoints with another learningRate or weightDecay: restoring the
    optimizer and the schedule brought back the old ones (torch keeps them in both states), so the new
    values are put back, the learning rate at the schedule's restored position. ``relaid``: the schedule
    was laid out anew (another run length), so the restored learning rate, the old schedule's, is
    replaced by the new schedule's at that position even when the rate and the decay are unchanged."""
    scheduler, groups = parts.scheduler, parts.optimizer.param_groups
    decays = [training.weight_decay, 0.0][: len(groups)]  # build_optimizer: matrices decay, the rest not
    rate = training.learning_rate
    if all(math.isclose(b, rate) for b in scheduler.base_lrs) and all(
        math.isclose(g["weight_decay"], d) for g, d in zip(groups, decays, strict=False)
    ):
        if not relaid:
            return
    else:
        log.warning(
            "resuming with learning rate %g and weight decay %g (the checkpoint had %g and %g)",
            rate,
            training.weight_decay,
            scheduler.base_lrs[0],
            groups[0]["weight_decay"],
        )
        scheduler.base_lrs = [rate] * len(groups)
        for group, decay in zip(groups, decays, strict=False):
            group["initial_lr"], group["weight_decay"] = rate, decay
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=False):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # get_last_lr(), as a step would have set it


def make_scaler(
    plan: PrecisionPlan, device: torch.device, sharded: bool = False
) -> torch.amp.GradScaler | None:
    """fp16's loss scaler. Sharded, each rank checks only its own gradient shards for inf/NaN: the
    ShardedGradScaler all-reduces what they found, so every rank skips (or takes) the same steps and
    keeps the same scale."""
    if not plan.grad_scaler:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def model_inputs(micro_batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """What ``model(**inputs)`` takes; flattened rows add transformers' FlashAttentionKwargs, which
    reach the attention function of every layer (one copy of the boundaries per micro-batch)."""
    inputs: dict[str, Any] = {
        k: micro_batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS if k in micro_batch
    }
    if "cu_seq_lens" in micro_batch:
        bounds = micro_batch["cu_seq_lens"].to(device, non_blocking=True)
        longest = int(micro_batch["max_length"])
        inputs |= {
            "cu_seq_lens_q": bounds,
            "cu_seq_lens_k": bounds,
            "max_length_q": longest,
            "max_length_k": longest,
        }
    return inputs


def router_balancing(model: nn.Module) -> float | None:
    """The weight (``router_aux_loss_coef``) at which a transformers mixture of experts adds its routers'
    load-balancing loss to the loss of every forward pass with labels, when its config asks for it
    (``output_router_logits``: Mixtral, Qwen2/3-MoE, OLMoE... checkpoints saved from runs that balanced);
    None when it adds none. A model whose weight has another name trains without it (0.0, warned once)."""
    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    config: Any = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "output_router_logits", False):
        return None
    # Where transformers' classes keep it: most on the model, JetMoE as aux_loss_coef, a multimodal
    # model (Qwen3-VL-MoE) in its text config.
    for owner, name in (
        (base, "router_aux_loss_coef"),
        (base, "aux_loss_coef"),
        (text, "router_aux_loss_coef"),
    ):
        weight = getattr(owner, name, None)
        if isinstance(weight, int | float):
            return float(weight)
    _weight_not_found(type(base).__name__)
    return 0.0


@functools.cache
def _weight_not_found(model_class: str) -> None:
    log.warning(
        "%s's config asks for its routers' load-balancing loss (output_router_logits), but the model names"
        " its weight neither router_aux_loss_coef nor aux_loss_coef: training on the cross-entropy alone",
        model_class,
    )


@functools.cache
def _no_balancing_loss(model_class: str) -> None:
    log.warning(
        "%s's config asks for its routers' load-balancing loss (output_router_logits), but its forward pass"
        " returns none: training on the cross-entropy alone",
        model_class,
    )


def micro_batch_loss(
    model: nn.Module, inputs: dict[str, Any], divisor: int | torch.Tensor, own_loss: bool, **extra: Any
) -> torch.Tensor:
    """The micro-batch's cross-entropy summed over its target tokens, divided by ``divisor``: the model's
    loss (``num_items_in_batch``), or with ``own_loss`` (remote_code.computes_own_loss) the trainer's, in
    float32 from the logits of a forward pass without labels, each position predicting the next label.
    A mixture of experts that would add its routers' load-balancing loss (:func:`router_balancing`) is
    asked not to: the result is the cross-entropy alone (:func:`micro_batch_objective` trains on both).

    The labels are shifted, not the logits: a slice of the logits of several rows is not contiguous, and
    flattening it would copy them all (vocabulary x tokens), beyond what the planner counts for the loss."""
    if not own_loss:
        if router_balancing(model) is not None:
            extra["output_router_logits"] = False
        return model(**inputs, use_cache=False, num_items_in_batch=divisor, **extra).loss
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits
    following = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # the last position predicts nothing
    terms = logits.flatten(0, 1).float()
    summed = F.cross_entropy(terms, following.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / divisor


def micro_batch_objective(
    model: nn.Module, inputs: dict[str, Any], divisor: int, own_loss: bool, passes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the backward pass differentiates, the cross-entropy :func:`micro_batch_loss` computes) for one
    of a step's ``passes`` forward passes (its micro-batches on every rank).

    A mixture of experts whose config asks for its routers' load-balancing loss (:func:`router_balancing`)
    adds it whole to every forward pass's loss, where the cross-entropy is a share of the global batch's
    sum: summed over the micro-batches and scaled by the ranks it would weigh accumulation x GPUs times its
    weight. Here it weighs its weight divided by ``passes``, so the step trains on the mean of its forward
    passes' balancing losses at the configured weight, as HF's Trainer means it to and Megatron does,
    whatever the accumulation and the number of GPUs. Kept rather than dropped: the checkpoint's config
    asks for it, and HF's Trainer and TRL would train on it. Each forward pass balances its own tokens (a
    mean, not a share of a sum), so smaller micro-batches balance somewhat more strictly. The cross-entropy
    is the model's loss less the balancing it added."""
    weight = None if own_loss else router_balancing(model)
    if not weight:
        loss = micro_batch_loss(model, inputs, divisor, own_loss)
        return loss, loss
    outputs = model(**inputs, use_cache=False, num_items_in_batch=divisor)
    if getattr(outputs, "aux_loss", None) is None:  # a weight in its config, no such loss (Llama 4)
        _no_balancing_loss(type(unwrap(model)).__name__)
        return outputs.loss, outputs.loss
    balancing = weight * outputs.aux_loss
    cross_entropy = outputs.loss - balancing
    return cross_entropy + balancing / passes, cross_entropy


def train_step(
    parts: Trainables,
    micro_batches: list[dict[str, torch.Tensor]],
    plan: PrecisionPlan,
    max_grad_norm: float,
    ctx: DistContext,
    *,
    own_loss: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch, clip, step the optimizer and the schedule (unless the loss or
    the gradients are not finite: :func:`_update`). ``own_loss``: :func:`micro_batch_loss`."""
    model, optimizer, scaler = parts.model, parts.optimizer, parts.scaler
    local = [
        sum(float(mb[k]) for mb in micro_batches)
        for k in ("num_targets", "num_tokens", "num_samples", "attention_pairs")
    ]
    targets, tokens, samples, pairs = ctx.sum(local)
    # A Python number, not a tensor: FSDP2's MixedPrecisionPolicy casts floating-point tensor inputs of
    # forward to the compute dtype, and bf16 rounds counts above 256 (1001 to 1000).
    divisor = int(max(targets, 1.0))
    loss_sum = torch.zeros((), device=ctx.device)
    passes = len(micro_batches) * ctx.world_size
    for i, mb in enumerate(micro_batches):
        inputs = model_inputs(mb, ctx.device)
        with no_sync(model, i == len(micro_batches) - 1):
            with torch.autocast(ctx.device.type, dtype=plan.compute_dtype, enabled=plan.autocast):
                objective, loss = micro_batch_objective(model, inputs, divisor, own_loss, passes)
            # DDP/FSDP average gradients over ranks; the objective is already a share of the global sum.
            scaled = objective * ctx.world_size
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_sum += loss.detach()
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), max_grad_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    (loss_total,) = ctx.sum([float(loss_sum)])
    learning_rate = float(optimizer.param_groups[0]["lr"])
    skipped = _update(parts, loss_total, grad_norm)
    optimizer.zero_grad(set_to_none=True)
    _finish(ctx.device)
    return StepResult(loss_total, grad_norm, learning_rate, int(tokens), int(samples), int(pairs), skipped)


def _finish(device: torch.device) -> None:
    """Wait for the step's work on the GPU: ``optimizer.step()`` only queues its kernels, and a step that
    returned before they ran would leave its update out of the step's time (the step-time histogram,
    tokens/s, MFU), the next collective or step waiting for it instead. On the CPU it is done already."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _update(parts: Trainables, loss: float, grad_norm: float) -> Skip | None:
    """Step the optimizer and the schedule with the clipped gradients, or say why not (neither steps then).

    ``loss`` and ``grad_norm`` are global (every rank decides alike); with fp16's scaler ``grad_norm`` is
    of the unscaled gradients. Without a scaler a non-finite norm means inf/NaN gradients, which clipping
    would spread to every weight (its factor is NaN). With one it is an overflow, which the scaler answers
    by halving its scale (the schedule waits too, as in HF's Trainer): "overflow" while that leaves a scale
    of at least ``MIN_LOSS_SCALE``, else the gradients are at fault. A non-finite loss is no overflow: the
    scale cannot cure a forward pass that overflows.
    """
    optimizer, scaler = parts.optimizer, parts.scaler
    finite_loss, finite_grads = math.isfinite(loss), math.isfinite(grad_norm)
    if scaler is None:
        if finite_loss and finite_grads:
            optimizer.step()
    else:
        scale = scaler.get_scale()
        if finite_loss and finite_grads:
            scaler.step(optimizer)
        scaler.update()  # halves the scale after inf/NaN gradients
    if not finite_loss:
        return "non-finite"
    if not finite_grads:
        lowered = scaler is not None and MIN_LOSS_SCALE <= scaler.get_scale() < scale
        return "overflow" if lowered else "non-finite"
    parts.scheduler.step()
    return None
