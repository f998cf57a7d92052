"""The planner's search space: the request, the choices fixed before the search, and the candidates.

:func:`fixed_choices` applies the user's overrides and the always-on settings (and finds overrides that
cannot work); :func:`evaluate` prices one candidate in memory and speed; :func:`search` returns the
fastest candidate that fits, with gradient checkpointing only when nothing fits without it or when the
memory it frees lets a configuration run ``CHECKPOINTING_MARGIN`` faster (a bigger micro-batch, no
sharding, no cross-node traffic per micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from sftjob.architectures import Architecture
from sftjob.config import Attention, LoraSettings, Method, Precision, Sharding, TrainingOverrides
from sftjob.gpus import GpuProfile
from sftjob.memory import MemoryInputs, estimate_memory
from sftjob.network import DEFAULT_TCP_GBPS
from sftjob.plan import MemoryEstimate
from sftjob.throughput import Prediction, ThroughputInputs, predict

DEFAULT_TOKENS_PER_STEP = 131_072  # default global batch: about 128k tokens per optimizer step
DEFAULT_GLOBAL_BATCH_BOUNDS = (8, 256)  # in rows (packed sequences)
MIN_PACKING_LENGTH = 512  # the OOM ladder does not shorten packed rows below this
MAX_GPUS_PER_NODE = 8
# Sharding wins over replicating (ddp) only when predicted this much faster: the throughput model ranks
# within a few percent (sftjob.throughput), and a replicated model makes no collective per layer.
SHARDING_MARGIN = 0.05
# Gradient checkpointing recomputes activations (~25% more compute): it is chosen over a configuration
# that fits without it only when predicted at least this much faster.
CHECKPOINTING_MARGIN = 0.05


class PlanRequest(BaseModel):
    """What the planner needs from an SFTJob, already resolved (architecture) and validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: Architecture
    method: Method = "lora"
    lora: LoraSettings = LoraSettings()
    max_seq_length: int = Field(default=2048, ge=16)
    gpus_per_node: int = Field(default=1, ge=1, le=MAX_GPUS_PER_NODE)
    nodes: int = Field(default=1, ge=1)
    overrides: TrainingOverrides = TrainingOverrides()
    safety_fraction: float = Field(default=0.9, gt=0, le=1)
    # Packed-row length the user fixed (at most max_seq_length: ``spec.to_plan_request``); None:
    # max_seq_length, and the OOM
    # ladder may shorten it.
    packing_length: int | None = Field(default=None, ge=16)
    # Between nodes (``spec.network``): GB/s one node moves to the others, and whether over RDMA.
    inter_node_gbs: float = Field(default=DEFAULT_TCP_GBPS / 8, gt=0)
    rdma: bool = False
    # spec.model.trustRemoteCode: the model's own code, which may not keep packed examples apart.
    remote_code: bool = False
    # spec.output.mergeAdapter: rank 0 loads the base once more, on the host, to merge the adapter into it.
    merge_adapter: bool = False

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Candidate:
    """One configuration under consideration, with its memory estimate and predicted speed."""

    micro: int
    accumulation: int
    checkpointing: bool
    sharding: Sharding
    sequence: int
    memory: MemoryEstimate
    speed: Prediction


@dataclass(frozen=True)
class Fixed:
    """Choices made before the search: the user's overrides and the always-on settings."""

    precision: Precision
    packing: bool
    sequence: int  # tokens per row
    liger: bool
    attention: Attention
    global_batch: int
    problem: str | None  # why no configuration can be valid (reported, never silently fixed)


def _default_global_batch(sequence: int, world: int, micro: int | None = None) -> int:
    """About ``DEFAULT_TOKENS_PER_STEP`` per step, rounded up to what every GPU's micro-batches split
    evenly (the user's ``microBatchSize``, when set, included)."""
    low, high = DEFAULT_GLOBAL_BATCH_BOUNDS
    rows = min(high, max(low, round(DEFAULT_TOKENS_PER_STEP / sequence)))
    unit = world * (micro or 1)
    return unit * math.ceil(rows / unit)


def fixed_choices(request: PlanRequest, gpu: GpuProfile) -> tuple[Fixed, list[str]]:
    o, reasons, problem = request.overrides, [], None
    if o.precision is not None:
        precision: Precision = o.precision
        reasons.append(f"precision {precision}: set by spec.training.precision")
    else:
        precision = "bf16"
        reasons.append("precision bf16: full tensor-core rate, no loss scaling")
    # Unset, packing is on but for remote code, whose attention may let packed examples see each other
    # (the trainer refuses packing for such code; a packingLength asks for packing).
    packing = o.packing if o.packing is not None else not request.remote_code or bool(request.packing_length)
    sequence = request.packing_length or request.max_seq_length
    if packing:
        reasons.append(
            f"packing on: rows of {sequence} tokens, no padding"
            + (" (packing length set by the spec)" if request.packing_length else "")
        )
    elif o.packing is None:
        reasons.append(
            "packing off: the model runs its own code (spec.model.trustRemoteCode), whose attention may let"
            " packed examples see each other; set spec.training.packing: true if it uses transformers'"
            " attention functions"
        )
    else:
        reasons.append("packing off (spec.training.packing): batches are padded, ~48% of tokens wasted")
    # Remote code's loss the trainer computes from the logits (never the fused loss), and Liger would replace
    # the model's own forward and modules with transformers' family's.
    liger = request.architecture.liger_supported and not request.remote_code
    if liger:
        reasons.append(
            "Liger kernels on: fused RMSNorm/RoPE/SwiGLU and linear cross-entropy (no logits buffer)"
        )
    elif request.remote_code:
        reasons.append(
            "Liger kernels off: the model runs its own code (spec.model.trustRemoteCode), whose loss the"
            " trainer computes from the logits"
        )
    else:
        reasons.append("Liger kernels off: the model family is unknown or not supported by Liger")
    eager = request.architecture.eager_attention_reason(sequence if packing else None)
    attention: Attention = "eager" if eager else "sdpa"
    if eager:
        reasons.append(f"attention eager: {eager}; its score matrix is counted in the activations")
    world = request.world_size
    if o.global_batch_size is not None:
        global_batch = o.global_batch_size
        if global_batch % world:
            problem = (
                f"spec.training.globalBatchSize {global_batch} is not divisible by the {world} GPUs;"
                f" use a multiple of {world}"
            )
    else:
        global_batch = _default_global_batch(sequence, world, o.micro_batch_size)
        reasons.append(f"global batch {global_batch} rows (~{global_batch * sequence:,} tokens per step)")
    if o.micro_batch_size is not None and not problem and (global_batch // world) % o.micro_batch_size:
        problem = (
            f"spec.training.microBatchSize {o.micro_batch_size} does not divide the per-GPU batch"
            f" {global_batch // world} (global {global_batch} / {world} GPUs)"
        )
    return Fixed(precision, packing, sequence, liger, attention, global_batch, problem), reasons


def evaluate(
    request: PlanRequest,
    gpu: GpuProfile,
    fixed: Fixed,
    micro: int,
    checkpointing: bool,
    sharding: Sharding,
    sequence: int,
) -> Candidate:
    accumulation = max(1, fixed.global_batch // (request.world_size * micro))
    memory = estimate_memory(
        MemoryInputs(
            request.architecture,
            request.method,
            request.lora,
            micro,
            sequence,
            accumulation,
            checkpointing,
            fixed.liger,
            fixed.precision,
            "adamw_torch_fused",
            sharding,
            request.world_size,
            fixed.attention,
            request.gpus_per_node,
        ),
        gpu.memory_gib,
        request.safety_fraction,
    )
    speed = predict(
        ThroughputInputs(
            request.architecture,
            request.method,
            gpu,
            micro,
            sequence,
            accumulation,
            checkpointing,
            fixed.liger,
            fixed.precision,
            fixed.packing,
            sharding,
            request.gpus_per_node,
            request.nodes,
            None if request.method == "full" else request.lora,
            request.inter_node_gbs,
        )
    )
    return Candidate(micro, accumulation, checkpointing, sharding, sequence, memory, speed)


def shardings(request: PlanRequest) -> list[Sharding]:
    """The ways to spread the job over its GPUs: replicate the model (ddp), or shard it over every GPU
    (fsdp) or, on several nodes of several GPUs, over each node's GPUs (hsdp). Full fine-tuning shards
    its model states; LoRA its frozen base (a 70B base is 140 GB in bf16) with the adapters. QLoRA runs
    on one GPU."""
    if request.world_size == 1:
        return ["none"]
    if request.method == "qlora":
        return ["ddp"]
    hybrid: list[Sharding] = ["hsdp"] if request.nodes > 1 and request.gpus_per_node > 1 else []
    return ["ddp", "fsdp", *hybrid]


def search(request: PlanRequest, gpu: GpuProfile, fixed: Fixed) -> tuple[Candidate, bool]:
    """The fastest fitting candidate, or (the smallest candidate, False) when none fits."""
    local = max(1, fixed.global_batch // request.world_size)
    o = request.overrides
    micros = (
        [o.micro_batch_size] if o.micro_batch_size else [m for m in range(1, local + 1) if local % m == 0]
    )
    ckpt_options = [o.gradient_checkpointing] if o.gradient_checkpointing is not None else [False, True]
    smallest: Candidate | None = None
    best: dict[bool, Candidate] = {}  # the fastest fitting candidate with and without checkpointing
    for checkpointing in ckpt_options:
        candidates = [
            evaluate(request, gpu, fixed, m, checkpointing, s, fixed.sequence)
            for s in shardings(request)
            for m in micros
        ]
        if fitting := [c for c in candidates if c.memory.fits]:
            best[checkpointing] = _fastest(fitting)
        # Report the most frugal setting a user would try: the smallest micro-batch, then least memory.
        least = min(candidates, key=lambda c: (c.micro, c.memory.total_gib))
        if smallest is None or least.memory.total_gib < smallest.memory.total_gib:
            smallest = least
    if best and not fixed.problem:
        plain, recomputed = best.get(False), best.get(True)
        if recomputed is not None and (
            plain is None
            or recomputed.speed.tokens_per_second > (1 + CHECKPOINTING_MARGIN) * plain.speed.tokens_per_second
        ):
            return recomputed, True
        assert plain is not None
        return plain, True
    assert smallest is not None
    return smallest, False


def _fastest(fitting: list[Candidate]) -> Candidate:
    """The fastest candidate, but the fastest replicated one (ddp) unless sharding beats it by
    ``SHARDING_MARGIN``."""
    best = max(fitting, key=lambda c: c.speed.tokens_per_second)
    replicated = [c for c in fitting if c.sharding == "ddp"]
    if best.sharding in ("fsdp", "hsdp") and replicated:
        ddp = max(replicated, key=lambda c: c.speed.tokens_per_second)
        if best.speed.tokens_per_second < (1 + SHARDING_MARGIN) * ddp.speed.tokens_per_second:
            return ddp
    return best
