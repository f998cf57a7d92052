"""The planner: the fastest training configuration that fits one GPU type, and the OOM re-plan ladder.

``plan(request, gpu)`` is a pure function. It fixes what the user set (``spec.training``) and what is
always right on these cards (bf16, packing, Liger kernels where the model family is supported, fused
AdamW, SDPA), then searches micro-batch size (keeping the global batch exact), sharding and gradient
checkpointing (when nothing fits without it, or when it runs a configuration 5% faster:
:mod:`sftjob.candidates`); it keeps the candidates whose
estimated peak memory (:mod:`sftjob.memory`) is within the safety fraction of the card and returns the
one with the highest predicted throughput (:mod:`sftjob.throughput`). When nothing fits it says so
with the numbers and suggests what would, found by planning the alternatives. ``replan_after_oom``
walks one rung down the ladder after a CUDA OOM. docs/planner.md explains the rules for users.
"""

from __future__ import annotations

import math
from dataclasses import replace

from sftjob.candidates import (
    MIN_PACKING_LENGTH,
    Candidate,
    Fixed,
    PlanRequest,
    evaluate,
    fixed_choices,
    search,
)
from sftjob.config import DistributedSettings, Method, Optimizer, TrainingSettings
from sftjob.gpus import GPU_TYPES, GpuProfile, profile_for_type
from sftjob.plan import TIME_SLICED_REASON, Plan
from sftjob.resources import checkpoint_gib, pod_environment, pod_resources, workers_per_process

__all__ = ["PlanRequest", "plan", "plan_all", "replan_after_oom"]

OPTIMIZER: Optimizer = "adamw_torch_fused"
LEARNING_RATE: dict[Method, float] = {"full": 2e-5, "lora": 2e-4, "qlora": 2e-4}
CHEAPER_METHODS: dict[Method, tuple[Method, ...]] = {
    "full": ("lora", "qlora"),
    "lora": ("qlora",),
    "qlora": (),
}
# More GPUs of the job's card, fewest first: one node of 2, 4 or 8, then 2, 4 or 8 nodes of 8.
MORE_GPUS: tuple[tuple[int, int], ...] = ((2, 1), (4, 1), (8, 1), (8, 2), (8, 4), (8, 8))
NOTHING_TRIED_FITS = (
    f"no change the planner tried fits either (a cheaper method, up to {MORE_GPUS[-1][1]} nodes x"
    f" {MORE_GPUS[-1][0]} GPUs, a bigger card, rows down to {MIN_PACKING_LENGTH} tokens, a cheaper method"
    " with more GPUs, shorter rows with a cheaper method or on a bigger card)"
)


def _training(request: PlanRequest, fixed: Fixed, c: Candidate, cpus_per_gpu: int) -> TrainingSettings:
    o = request.overrides
    return TrainingSettings(
        epochs=o.epochs or 1.0,
        max_steps=o.max_steps,
        learning_rate=o.learning_rate or LEARNING_RATE[request.method],
        warmup_ratio=0.03 if o.warmup_ratio is None else o.warmup_ratio,
        weight_decay=o.weight_decay or 0.0,
        seed=42 if o.seed is None else o.seed,
        global_batch_size=fixed.global_batch,
        micro_batch_size=c.micro,
        gradient_accumulation_steps=c.accumulation,
        gradient_checkpointing=c.checkpointing,
        precision=fixed.precision,
        packing=fixed.packing,
        packing_length=c.sequence if fixed.packing else None,
        liger_kernels=fixed.liger,
        attention=fixed.attention,
        optimizer=OPTIMIZER,
        dataloader_workers=workers_per_process(cpus_per_gpu),
    )


def _assemble(
    request: PlanRequest,
    gpu: GpuProfile,
    fixed: Fixed,
    c: Candidate,
    fits: bool,
    reasons: list[str],
    verdict: str,
    suggestions: list[str],
    ladder: list[str],
) -> Plan:
    resources, cpus_per_gpu = pod_resources(
        request.architecture,
        request.method,
        request.gpus_per_node,
        fixed.precision,
        nodes=request.nodes,
        sharded=c.sharding in ("fsdp", "hsdp"),
        merged=request.merge_adapter,
    )
    return Plan(
        gpu=gpu.key,
        fits=fits,
        training=_training(request, fixed, c, cpus_per_gpu),
        distributed=DistributedSettings(
            nnodes=request.nodes, nproc_per_node=request.gpus_per_node, sharding=c.sharding
        ),
        env=pod_environment(request.gpus_per_node, request.nodes, cpus_per_gpu),
        resources=resources,
        checkpoint_gib=round(
            checkpoint_gib(request.architecture, request.method, request.lora, OPTIMIZER), 2
        ),
        memory=c.memory,
        predicted_tokens_per_second=round(c.speed.tokens_per_second, 1),
        predicted_mfu=round(c.speed.mfu, 4),
        reasons=reasons,
        suggestions=suggestions,
        ladder=ladder,
        verdict=verdict,
    )


def _describe(request: PlanRequest, gpu: GpuProfile, c: Candidate) -> list[str]:
    lines = [
        f"micro-batch {c.micro} x accumulation {c.accumulation} x {request.world_size} GPU(s);"
        f" ~{c.speed.tokens_per_second:,.0f} tokens/s, MFU ~{c.speed.mfu:.0%} of {gpu.peak_tflops:g}"
        " dense TFLOPS per GPU"
    ]
    states = "model states" if request.method == "full" else "frozen base and adapters"
    if c.sharding == "fsdp":
        lines.append(f"sharding fsdp: {states} split over {request.world_size} GPUs ({gpu.interconnect})")
    elif c.sharding == "hsdp":
        lines.append(
            f"sharding hsdp: {states} split over each node's {request.gpus_per_node} GPUs"
            f" ({gpu.interconnect}) and replicated on the {request.nodes} nodes; only one gradient"
            " all-reduce per optimizer step crosses between nodes"
        )
    elif c.sharding == "ddp":
        lines.append(f"sharding ddp: every GPU holds the model; gradients all-reduced ({gpu.interconnect})")
    if request.nodes > 1:
        link = (
            "RDMA (spec.network.rdma)"
            if request.rdma
            else "TCP sockets: without spec.network.rdma NCCL cannot use InfiniBand or RoCE"
        )
        lines.append(f"between nodes: ~{request.inter_node_gbs:g} GB/s per node over {link}")
    if request.overrides.gradient_checkpointing is not None:
        lines.append(
            f"gradient checkpointing {'on' if c.checkpointing else 'off'}:"
            " set by spec.training.gradientCheckpointing"
        )
    elif c.checkpointing:
        lines.append(
            "gradient checkpointing on: nothing fits without it, or the memory it frees runs a faster"
            " configuration (it recomputes activations, ~25% more compute)"
        )
    top = sorted(c.memory.terms, key=lambda t: -t.gib)[:3]
    lines.append(
        f"memory ~{c.memory.total_gib:.1f} of {c.memory.budget_gib:.1f} GiB usable per GPU"
        f" (largest: {', '.join(f'{t.name} {t.gib:.1f}' for t in top)})"
    )
    return lines


def _no_fit_verdict(request: PlanRequest, gpu: GpuProfile, c: Candidate, fixed: Fixed) -> str:
    if fixed.problem:
        return fixed.problem
    setup = f"micro-batch {c.micro}{' with gradient checkpointing' if c.checkpointing else ''}"
    return (
        f"{request.method} of {request.architecture.parameters / 1e9:.1f}B on {request.world_size} x"
        f" {gpu.key} needs ~{c.memory.total_gib:.1f} GiB per GPU even at {setup}; the card allows"
        f" {c.memory.budget_gib:.1f} GiB ({gpu.memory_gib:g} x {request.safety_fraction:g})"
    )


def _split_batch(request: PlanRequest) -> tuple[PlanRequest, str]:
    """``request`` with the user's globalBatchSize rounded up to the nearest multiple its GPUs (times the
    user's microBatchSize, when set) split evenly, and the words that say so; as it is when it splits."""
    o = request.overrides
    unit = request.world_size * (o.micro_batch_size or 1)
    if o.global_batch_size is None or o.global_batch_size % unit == 0:
        return request, ""
    rounded = unit * math.ceil(o.global_batch_size / unit)
    overrides = o.model_copy(update={"global_batch_size": rounded})
    return request.model_copy(update={"overrides": overrides}), f" at globalBatchSize {rounded}"


def _suggest(request: PlanRequest, gpu: GpuProfile, rows_tried: int | None = None) -> list[str]:
    """What would fit instead, each found by planning it (without suggestions of its own): one change
    at a time first (the planner's own micro-batch and checkpointing, a cheaper method, more GPUs, a
    bigger card, shorter rows), then two: a cheaper method no single change fits with more GPUs or else
    with shorter rows, and, when no single change keeping the job's method fits, shorter rows on a
    bigger card. More GPUs that do not split the user's globalBatchSize are planned with it rounded up
    (and say so). After an OOM ladder ran out, ``rows_tried`` is the row length that still ran out of
    memory where the estimate said it would fit: settings left to the planner, cheaper methods and
    bigger cards are planned with rows no longer than those (and say so), shorter rows are shorter
    still, and more GPUs of the job's method count only when they shard the model (a replica per GPU
    needs as much memory on two as on one; sharding frees memory at any row length, so they are planned
    as the job is)."""
    out: list[str] = []
    combined: list[str] = []  # two changes at once: after every single change

    def fits(r: PlanRequest, g: GpuProfile) -> Plan | None:
        p = _plan(r, g, suggest=False)
        return p if p.fits else None

    def show(p: Plan) -> str:
        speed = f"~{p.predicted_tokens_per_second:,.0f} tokens/s"
        return f"~{p.memory.total_gib:.1f}/{p.memory.budget_gib:.1f} GiB, {speed}"

    def more_gpus(r: PlanRequest, sharded_only: bool) -> str | None:
        """The fewest more GPUs of this card that fit ``r``, in words."""
        for gpus, nodes in MORE_GPUS:
            if gpus * nodes <= r.world_size:
                continue
            more, batch = _split_batch(r.model_copy(update={"gpus_per_node": gpus, "nodes": nodes}))
            if (p := fits(more, gpu)) and (not sharded_only or p.distributed.sharding in ("fsdp", "hsdp")):
                return f"{nodes} node(s) x {gpus} {gpu.key} with {p.distributed.sharding}{batch} ({show(p)})"
        return None

    rows = request.packing_length or request.max_seq_length  # tokens per row as the user set them
    # Shorter rows: a packingLength the user set is the one to lower (below maxSeqLength, as admission
    # wants it); otherwise maxSeqLength.
    field = "packing_length" if request.packing_length else "max_seq_length"
    name = "packingLength" if request.packing_length else "maxSeqLength"

    def shorter(r: PlanRequest, cards: tuple[GpuProfile, ...]) -> tuple[str, GpuProfile, Plan] | None:
        """The longest rows, halving from the job's (or those that ran out of memory), that fit ``r`` on
        one of ``cards`` (the first that does), in words."""
        length = min(rows, rows_tried or rows) // 2
        while length >= MIN_PACKING_LENGTH:
            for card in cards:
                if p := fits(r.model_copy(update={field: length}), card):
                    return f"{name} {length}", card, p
            length //= 2
        return None

    base, at = request, ""
    if rows_tried is not None and rows_tried < rows:  # the ladder shortened rows the user left to it
        base = request.model_copy(update={"max_seq_length": rows_tried, "packing_length": None})
        at = f" at maxSeqLength {rows_tried}"
    o = base.overrides
    if o.micro_batch_size is not None or o.gradient_checkpointing is not None:
        freed = base.model_copy(
            update={
                "overrides": o.model_copy(update={"micro_batch_size": None, "gradient_checkpointing": None})
            }
        )
        if p := fits(freed, gpu):
            out.append(f"leave microBatchSize/gradientCheckpointing to the planner{at}: {p.summary()}")
    # Cards at least a GiB bigger (an L40S is not a bigger A40).
    bigger = [b for b in map(profile_for_type, GPU_TYPES) if b.memory_gib > gpu.memory_gib + 1]
    cards = (gpu, *bigger)
    for method in CHEAPER_METHODS[request.method]:
        update: dict[str, object] = {"method": method}
        if method == "qlora":  # one GPU only (admission refuses more)
            update |= {"gpus_per_node": 1, "nodes": 1}
        cheaper = base.model_copy(update=update)
        if found := next(((card, p) for card in cards if (p := fits(cheaper, card))), None):
            card, p = found
            out.append(f"method {method}{at} fits on {p.distributed.world_size} x {card.key} ({show(p)})")
        elif method != "qlora" and (layout := more_gpus(cheaper, sharded_only=False)):
            combined.append(f"method {method}{at} fits on {layout}")
        elif shortened := shorter(request.model_copy(update=update), cards):
            rows_at, card, p = shortened
            combined.append(
                f"method {method} at {rows_at} fits on {p.distributed.world_size} x {card.key} ({show(p)})"
            )
    kept = len(out)  # the suggestions that keep the job's method start here
    if request.method != "qlora" and (layout := more_gpus(request, sharded_only=rows_tried is not None)):
        out.append(f"{request.method} fits on {layout}")
    for card in bigger:
        if p := fits(base, card):
            out.append(f"fits on {request.world_size} x {card.key}{at} ({show(p)})")
    if shortened := shorter(request, (gpu,)):
        out.append(f"{shortened[0]} fits ({show(shortened[2])})")
    elif len(out) == kept and (shortened := shorter(request, tuple(bigger))):
        rows_at, card, p = shortened
        combined.append(f"{rows_at} fits on {request.world_size} x {card.key} ({show(p)})")
    return out + combined


def _card_reasons(gpu: GpuProfile) -> list[str]:
    return [TIME_SLICED_REASON] if gpu.time_sliced else []


def _plan(request: PlanRequest, gpu: GpuProfile, suggest: bool) -> Plan:
    fixed, choices = fixed_choices(request, gpu)
    reasons = [
        f"model: {request.architecture.name or 'custom'}"
        f" ({request.architecture.parameters / 1e9:.2f}B parameters), {request.method}",
        *_card_reasons(gpu),
        *choices,
    ]
    best, fits = search(request, gpu, fixed)
    reasons += _describe(request, gpu, best)
    if fits:
        traded = " with gradient checkpointing" if best.checkpointing else ""
        verdict = f"fits{traded}: ~{best.memory.total_gib:.1f} of {best.memory.budget_gib:.1f} GiB per GPU"
        return _assemble(request, gpu, fixed, best, True, reasons, verdict, [], [])
    verdict = _no_fit_verdict(request, gpu, best, fixed)
    suggestions: list[str] = []
    if suggest and not fixed.problem:
        suggestions = _suggest(request, gpu)
        verdict += "" if suggestions else f"; {NOTHING_TRIED_FITS}"
    reasons.append(f"does not fit: {verdict}")
    return _assemble(request, gpu, fixed, best, False, reasons, verdict, suggestions, [])


def plan(request: PlanRequest, gpu: GpuProfile) -> Plan:
    """The fastest configuration of ``request`` that fits ``gpu`` (or why none does). Pure."""
    return _plan(request, gpu, suggest=True)


def plan_all(request: PlanRequest, gpu_types: tuple[str, ...] | list[str] = GPU_TYPES) -> list[Plan]:
    """One plan per GPU type, for side-by-side comparison."""
    return [plan(request, profile_for_type(t)) for t in gpu_types]


def replan_after_oom(request: PlanRequest, gpu: GpuProfile, previous: Plan) -> Plan:
    """The next rung of the OOM ladder, keeping the global batch exact. Pure.

    Rungs, each skipped when the user fixed that setting: halve the micro-batch (doubling
    accumulation); turn on gradient checkpointing; halve the packed-row length (not below 512).
    When no rung is left the plan comes back with ``fits=False`` and suggestions. A plan made for a
    time-sliced card keeps saying so, though ``gpu`` comes from the table by the plan's key.
    """
    if TIME_SLICED_REASON in previous.reasons:
        gpu = replace(gpu, time_sliced=True)
    fixed, choices = fixed_choices(request, gpu)
    reasons = [*_card_reasons(gpu), *choices]
    t, o = previous.training, request.overrides
    local = t.global_batch_size // request.world_size
    micro, checkpointing = t.micro_batch_size, t.gradient_checkpointing
    sequence = t.packing_length or request.max_seq_length
    was = (
        f"micro-batch {micro} x accumulation {t.gradient_accumulation_steps}"
        f"{', checkpointing' if checkpointing else ''}, rows of {sequence}"
    )
    if micro > 1 and o.micro_batch_size is None:
        micro = max(d for d in range(1, micro // 2 + 1) if local % d == 0)
        step = f"micro-batch {t.micro_batch_size} -> {micro} (accumulation x{t.micro_batch_size // micro})"
    elif not checkpointing and o.gradient_checkpointing is None:
        checkpointing = True
        step = "gradient checkpointing on"
    elif t.packing and request.packing_length is None and sequence // 2 >= MIN_PACKING_LENGTH:
        sequence //= 2
        step = f"packed rows {sequence * 2} -> {sequence} tokens (longer samples are truncated to a row)"
    else:
        step = ""
    fixed = replace(fixed, sequence=sequence)
    c = evaluate(request, gpu, fixed, micro, checkpointing, previous.distributed.sharding, sequence)
    if not step:
        verdict = (
            f"CUDA OOM at {was}: nothing left to trade on {gpu.key}"
            " (micro-batch, checkpointing and row length are at their limits or fixed by the spec)"
        )
        suggestions = _suggest(request, gpu, rows_tried=sequence)
        verdict += "" if suggestions else f"; {NOTHING_TRIED_FITS}"
        return _assemble(
            request,
            gpu,
            fixed,
            c,
            False,
            [*reasons, verdict],
            verdict,
            suggestions,
            [*previous.ladder, f"exhausted after OOM at {was}"],
        )
    estimate = f"~{c.memory.total_gib:.1f} GiB estimated"
    line = f"OOM at {was}: {step}; global batch {t.global_batch_size} kept; {estimate}"
    reasons += _describe(request, gpu, c)
    return _assemble(
        request, gpu, fixed, c, True, reasons, f"re-planned after OOM: {step}", [], [*previous.ladder, line]
    )
