"""The per-GPU peak-memory estimator behind every plan: model states + activations + buffers, term by term.

Model states follow the usual bytes-per-parameter accounting (shared/research/trainer-gpu.md §2.1):
full fine-tuning keeps fp32 weights, fp32 gradients and AdamW's fp32 m and v (16 B/param, divided by
the world size under FSDP, by the GPUs of one node under HSDP) plus bf16 copies that autocast makes of
the weights during the forward pass; LoRA keeps the base in bf16 (2 B/param) and trains fp32 adapters
(4 + 4 + 8 B per adapter param), both divided as full fine-tuning's states when sharded. What FSDP2
holds unsharded besides its shards is counted from torch's source (:func:`_gathered`). QLoRA stores the
decoder's linear weights in NF4 with double-quantised scales (~0.52 B/param).

Activations use a per-layer, per-token figure in the style of Korthikanti et al. (arXiv 2205.05198)
adapted to Llama-type blocks with SDPA/flash attention (no s x s matrix is stored):
``(a·h + 8·I)`` bytes, where ``8·I`` is the gated MLP (gate, up, act(gate), act(gate)·up in bf16) and
``a·h`` is attention + residual + norms: a = 29 with HF's RMSNorm (it keeps fp32 copies), 18 with
Liger's. Gradient checkpointing keeps only each layer's input (2·h bytes) plus one layer recomputed
during backward with its gradient temporaries. LoRA dropout adds its mask, 1 byte per adapter input
element (measured: 4.3 GiB for a 7B model at 4,096 tokens). The logits buffer costs 13 bytes per
vocabulary entry per token (bf16 logits, fp32 upcast, fp32 log-softmax and its gradient) and is
replaced by a small chunk buffer under Liger's fused linear cross-entropy. The constants are fitted
to the H200 anchors (shared/research/h200-anchors.md) and to planner configurations measured on an
H200 (benchmarks/planner/); tests/unit/test_memory.py holds the estimator to both within ±15%.

The result is what ``torch.cuda.max_memory_allocated()`` should show, plus an overhead term for what
it does not see: the CUDA context and cuBLAS/NCCL workspaces, and allocator slack.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftjob.architectures import Architecture
from sftjob.config import Attention, LoraSettings, Method, Optimizer, Precision, Sharding
from sftjob.plan import MemoryEstimate, MemoryTerm

GIB = 1024**3

FULL_STATE_BYTES = {"weights": 4, "gradients": 4}  # fp32 master weights and gradients
AUTOCAST_COPY_BYTES = 2  # bf16 weight copies autocast caches for the forward (saved for backward)
ADAPTER_STATE_BYTES = {"weights": 4, "gradients": 4}  # PEFT keeps adapters in fp32
OPTIMIZER_BYTES: dict[Optimizer, int] = {
    "adamw_torch_fused": 8,
    "adamw_torch": 8,
    "adamw_8bit": 2,
    "paged_adamw_8bit": 2,
}
BF16_BYTES = 2
REDUCE_BYTES = 4  # FSDP reduces gradients in fp32 (the trainer's MixedPrecisionPolicy)
NF4_BYTES_PER_PARAM = 0.516  # 4-bit NF4 + blocksize-64 absmax, double-quantised (QLoRA paper)

ACT_HIDDEN_COEF = 29  # bytes per hidden unit per token per layer: attention, residual, HF RMSNorm
ACT_HIDDEN_COEF_LIGER = 18  # the same with Liger's RMSNorm/RoPE kernels
ACT_MLP_COEF = 8  # bytes per MLP unit per token per layer (gate, up, act, act*up in bf16)
CHECKPOINT_BYTES_PER_HIDDEN = 2  # a checkpointed layer keeps its bf16 input
# QLoRA: peft's k-bit preparation leaves embeddings, norms and head in fp32, so the residual stream, the
# norms' inputs and the 4-bit projections' outputs (bitsandbytes returns its input's dtype) are fp32: about
# 4 bytes more per hidden and MLP unit per token and layer, and a checkpointed layer keeps an fp32 input.
# Measured through the trainer on an H200: Llama-2-7B QLoRA at 2 / 1 x 4096 tokens peaked at 71.3 / 38.1
# GiB, LoRA at 65.1 (benchmarks/results/trainer-throughput-quick-dense-mask.md).
QLORA_FP32_STREAM_BYTES = 4
LORA_DROPOUT_BYTES = 1  # per adapter input element: the dropout mask (measured on an H200, see below)
# Eager attention keeps, per head and (query, key) pair of a row, what its backward needs: the bf16
# soft-capped scores, the fp32 softmax and its bf16 copy (transformers' eager_attention_forward).
EAGER_SCORE_BYTES = 8
LOGIT_BYTES_PER_VOCAB = 13  # bf16 logits, fp32 upcast, fp32 log-softmax and gradient at the loss
FLCE_BYTES_PER_HIDDEN = 6  # Liger fused linear CE: a fp32 chunk about the size of the hidden states + grad

CUDA_CONTEXT_GIB = 0.75  # context, cuBLAS workspace: outside torch's allocator
NCCL_BUFFERS_GIB = 0.5  # communicator buffers when the world has more than one GPU
ALLOCATOR_SLACK = 0.03  # fraction of the allocated peak lost to fragmentation (expandable segments on)


@dataclass(frozen=True)
class MemoryInputs:
    """One candidate configuration for one GPU of the job."""

    architecture: Architecture
    method: Method
    lora: LoraSettings
    micro_batch_size: int
    sequence_length: int  # tokens per row: the packing length, or max_seq_length when padding
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    liger_kernels: bool = False
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw_torch_fused"
    sharding: Sharding = "none"
    world_size: int = 1
    attention: Attention = "sdpa"
    gpus_per_node: int = 1  # HSDP shards inside a node

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.sequence_length


def _gib(n: float) -> float:
    return n / GIB


def state_shards(sharding: Sharding, world_size: int, gpus_per_node: int) -> int:
    """How many GPUs split one copy of the model states: all of them under FSDP, one node's under HSDP
    (each node holds a whole copy, sharded over its GPUs), none under DDP."""
    if sharding == "fsdp":
        return world_size
    return gpus_per_node if sharding == "hsdp" else 1


def _states(m: MemoryInputs) -> list[MemoryTerm]:
    """Weights, gradients, optimizer states and adapters (the part that does not grow with the batch)."""
    a = m.architecture
    n = a.parameters
    opt = OPTIMIZER_BYTES[m.optimizer]
    shard = state_shards(m.sharding, m.world_size, m.gpus_per_node)
    split = f", sharded over {shard} GPUs ({m.sharding.upper()})" if shard > 1 else ""
    if m.method == "full":
        terms = [
            MemoryTerm(
                name="weights",
                gib=_gib(n * FULL_STATE_BYTES["weights"] / shard),
                note=f"{n / 1e9:.2f}B params x 4 B (fp32 master){split}",
            ),
            MemoryTerm(
                name="gradients", gib=_gib(n * FULL_STATE_BYTES["gradients"] / shard), note=f"fp32{split}"
            ),
            MemoryTerm(
                name="optimizer", gib=_gib(n * opt / shard), note=f"{m.optimizer}: {opt} B/param{split}"
            ),
        ]
        if shard > 1:
            return terms + _gathered(m, a.layer_parameters)
        if m.precision != "fp32":
            terms.append(
                MemoryTerm(
                    name="weight_copies",
                    gib=_gib(n * AUTOCAST_COPY_BYTES),
                    note="bf16 copies autocast makes in forward, kept for backward",
                )
            )
        return terms
    if m.method == "qlora":
        # peft's prepare_model_for_kbit_training casts every parameter it does not quantise to fp32.
        kept = n - a.linear_parameters
        weights = a.linear_parameters * NF4_BYTES_PER_PARAM + kept * FULL_STATE_BYTES["weights"]
        note = "decoder linears in NF4 (~0.52 B/param), embeddings/head/norms in fp32 (peft's k-bit prep)"
    else:  # the frozen base in the compute dtype (the trainer's precision plan)
        base = 4 if m.precision == "fp32" else BF16_BYTES
        weights = n * base / shard
        note = f"{n / 1e9:.2f}B frozen params x {base} B ({'fp32' if base == 4 else 'bf16'}){split}"
    adapters = a.lora_parameters(m.lora.r, m.lora.target_modules)
    terms = [
        MemoryTerm(name="weights", gib=_gib(weights), note=note),
        MemoryTerm(
            name="adapters",
            gib=_gib(adapters * ADAPTER_STATE_BYTES["weights"] / shard),
            note=f"{adapters / 1e6:.1f}M LoRA params (r={m.lora.r}) in fp32{split}",
        ),
        MemoryTerm(
            name="gradients",
            gib=_gib(adapters * ADAPTER_STATE_BYTES["gradients"] / shard),
            note=f"adapter gradients only{split}",
        ),
        MemoryTerm(
            name="optimizer", gib=_gib(adapters * opt / shard), note=f"{m.optimizer} on adapters only{split}"
        ),
    ]
    if shard > 1:
        terms += _gathered(m, adapters // a.layers)
    return terms


def _gathered(m: MemoryInputs, trainable_per_layer: int) -> list[MemoryTerm]:
    """What FSDP2 holds unsharded besides the shards (torch/distributed/fsdp/_fully_shard).

    The root group (embeddings, norm and an untied head) is all-gathered in the compute dtype for the
    whole step ("For the root, do not reshard after forward", ``_fsdp_state.py``); decoder layers are
    gathered one at a time while the next is prefetched. In backward the two gathered layers get
    unsharded gradients in the compute dtype, of their trainable parameters only, and ``foreach_reduce``
    copies one layer's into an fp32 reduce-scatter input (``_fsdp_collectives.py``; the reduce dtype).
    Full fine-tuning also gets the head's whole gradient first in backward, while the activations are
    still there; the embedding's, at the end, replaces them.
    """
    a = m.architecture
    p = 4 if m.precision == "fp32" else BF16_BYTES  # the compute dtype FSDP gathers and differentiates in
    root = a.embedding_parameters + a.lm_head_parameters + a.hidden_size
    head_grad = a.embedding_parameters * p if m.method == "full" else 0
    return [
        MemoryTerm(
            name="weight_copies",
            gib=_gib((root + 2 * a.layer_parameters) * p),
            note="FSDP keeps the root (embeddings, head) gathered all step, and gathers one layer at a time"
            " while prefetching the next",
        ),
        MemoryTerm(
            name="gradient_buffers",
            gib=_gib(head_grad + 2 * trainable_per_layer * p + trainable_per_layer * REDUCE_BYTES),
            note=("the head's gradient, " if head_grad else "")
            + f"unsharded gradients of 2 gathered layers ({trainable_per_layer / 1e6:.1f}M trainable"
            " params each) and an fp32 reduce-scatter input",
        ),
    ]


def layer_activation_bytes_per_token(m: MemoryInputs) -> float:
    """Bytes one decoder layer saves for backward per token without recomputation."""
    a = m.architecture
    coef = ACT_HIDDEN_COEF_LIGER if m.liger_kernels else ACT_HIDDEN_COEF
    per_token = coef * a.hidden_size + ACT_MLP_COEF * a.active_intermediate_size
    if m.method != "full" and m.lora.dropout > 0:
        per_token += LORA_DROPOUT_BYTES * a.lora_widths(m.lora.target_modules)[0]
    if m.method == "qlora":
        per_token += QLORA_FP32_STREAM_BYTES * (a.hidden_size + a.active_intermediate_size)
    if m.attention == "eager":  # the row's score matrix, per token: one row of it per head
        per_token += EAGER_SCORE_BYTES * a.heads * m.sequence_length
    return per_token * (2 if m.precision == "fp32" else 1)


def _dynamic(m: MemoryInputs) -> tuple[MemoryTerm, MemoryTerm]:
    """Activations and the logits/loss buffer for one micro-batch."""
    a = m.architecture
    layer = layer_activation_bytes_per_token(m) * m.tokens
    if m.liger_kernels:
        logits = FLCE_BYTES_PER_HIDDEN * a.hidden_size * m.tokens
        logits_note = "Liger fused linear cross-entropy: chunked, logits never materialised"
    else:
        logits = LOGIT_BYTES_PER_VOCAB * a.vocab_size * m.tokens
        logits_note = f"{m.tokens:,} tokens x vocab {a.vocab_size:,} x {LOGIT_BYTES_PER_VOCAB} B"
    if m.gradient_checkpointing:
        wide = m.method == "qlora" or m.precision == "fp32"  # the layer inputs are fp32
        kept = CHECKPOINT_BYTES_PER_HIDDEN * (2 if wide else 1) * a.hidden_size * m.tokens * a.layers
        # The recomputed layer and its backward temporaries (about as much again) appear after the
        # logits buffer is freed; count only what exceeds it.
        activations = kept + max(0.0, 2 * layer - logits)
        act_note = f"checkpointed: {a.layers} layer inputs + 1 layer recomputed, {m.tokens:,} tokens"
    else:
        activations = layer * a.layers
        act_note = f"{a.layers} layers x {m.tokens:,} tokens x {layer / m.tokens / 1024:.0f} KiB"
    return (
        MemoryTerm(name="activations", gib=_gib(activations), note=act_note),
        MemoryTerm(name="logits", gib=_gib(logits), note=logits_note),
    )


def estimate_memory(m: MemoryInputs, capacity_gib: float, safety_fraction: float = 0.9) -> MemoryEstimate:
    """Predicted peak memory per GPU for ``m`` against ``capacity_gib x safety_fraction``."""
    terms = _states(m)
    activations, logits = _dynamic(m)
    if m.method == "full" and m.gradient_accumulation_steps == 1:
        # Without accumulation the gradients appear during backward as activations are freed: they
        # add to the peak only where they outgrow the activations (then at the optimizer step).
        grads = next(t for t in terms if t.name == "gradients")
        live = max(0.0, grads.gib - activations.gib - logits.gib)
        terms = [
            t
            if t is not grads
            else t.model_copy(
                update={
                    "gib": live,
                    "note": grads.note + f"; {grads.gib:.1f} GiB, mostly allocated as activations free",
                }
            )
            for t in terms
        ]
    terms += [activations, logits]
    if m.sharding == "ddp":
        grads_gib = next(t.gib for t in terms if t.name == "gradients")
        full_grads = _gib(m.architecture.parameters * 4) if m.method == "full" else grads_gib
        terms.append(MemoryTerm(name="ddp_buckets", gib=full_grads, note="DDP all-reduce buckets"))
    allocated = sum(t.gib for t in terms)
    fixed = CUDA_CONTEXT_GIB + (NCCL_BUFFERS_GIB if m.world_size > 1 else 0.0)
    terms.append(
        MemoryTerm(
            name="overhead",
            gib=fixed + ALLOCATOR_SLACK * allocated,
            note=f"CUDA context/workspaces{' + NCCL' if m.world_size > 1 else ''}"
            f" + {ALLOCATOR_SLACK:.0%} allocator slack",
        )
    )
    terms = [t.model_copy(update={"gib": round(t.gib, 3)}) for t in terms]
    return MemoryEstimate(
        terms=terms,
        total_gib=round(sum(t.gib for t in terms), 2),
        budget_gib=round(capacity_gib * safety_fraction, 2),
    )
