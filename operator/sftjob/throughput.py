"""The throughput model the planner ranks candidate configurations with, and the MFU convention.

A micro-batch step on one GPU costs matmul time (model FLOPs at a tensor-core efficiency that rises with
the tokens in the micro-batch) plus memory-bound time (norms, activations, RoPE, SwiGLU, the logits
buffer: bytes over the card's bandwidth) plus kernel-launch latency; the optimizer step and the exposed
part of gradient/parameter communication are added per optimizer step. Communication crosses the slower
of the GPUs' own link and the link between nodes, except under HSDP, whose per-micro-batch traffic stays
inside the node while one gradient all-reduce per step leaves it. Constants are fitted to the H200
anchors (shared/research/h200-anchors.md, 10 runs of 1.1B full and 7B LoRA); the fit is within ±4% there
and tests/unit/test_planner.py holds it to ±10%. On other cards the same model scales by dense TFLOPS,
bandwidth and interconnect: a first-order prediction to rank choices, not a promise.

MFU convention (also exported by the trainer as ``sftjob_train_mfu_ratio``): real (non-padding)
tokens/s x model FLOPs per token / (dense bf16 peak x GPUs), with model FLOPs per token
6·N (full) or 4·N (LoRA/QLoRA: frozen weights get no weight gradients), N = the weights every token
multiplies through (decoder layers + output projection), plus causal attention 12·L·d·c with d the
query width (heads x head dim) and c the average attended context: per layer and (query, key) pair,
QK^T and the weighted sum of V cost 2·d multiply-adds each forward (4·d FLOPs), the backward twice
that (8·d). Recomputation (gradient checkpointing) is not counted as model FLOPs. The trainer's MFU
uses the same functions with the exact pair count of every batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sftjob.architectures import Architecture
from sftjob.config import LoraSettings, Method, Precision, Sharding
from sftjob.gpus import GpuProfile
from sftjob.memory import state_shards
from sftjob.network import DEFAULT_TCP_GBPS

MATMUL_EFFICIENCY = 0.6  # best fraction of the dense peak a large bf16 GEMM-bound step reaches
HALF_EFFICIENCY_TOKENS = 256  # tokens per micro-batch at which GEMMs reach half of that
ELEMENTWISE_BYTES = 300  # bytes moved per token per layer per (hidden + MLP) unit, HF kernels
ELEMENTWISE_BYTES_LIGER = 160  # the same with Liger's fused RMSNorm/RoPE/SwiGLU
LOGIT_TRAFFIC_BYTES = 40  # bytes moved per token per vocabulary entry by the unfused loss
LORA_TRAFFIC_BYTES = 24  # bytes moved per token per adapter in/out unit (thin GEMMs, scaling, add)
LORA_DROPOUT_TRAFFIC_BYTES = 24  # per adapter input element: one dropout per targeted module
LAUNCH_SECONDS_PER_LAYER = 0.0005  # kernel launches + Python per layer per micro-batch (fwd + bwd)
ADAMW_BYTES_PER_PARAM = 28  # fused AdamW reads p, g, m, v and writes p, m, v (fp32)
NF4_DEQUANT_BYTES = 16  # effective bytes per 4-bit weight per pass: dequantise + GEMM on the copy
COMM_OVERLAP = 0.7  # fraction of compute time that can hide communication
GATHER_COPY_BYTES = 4  # FSDP2 copies each all-gathered bf16 weight into its parameter (read + write)
PACKED_MEAN_CONTEXT = 512  # tokens: assumed mean sample length inside packed rows (attention span)
PADDING_EFFICIENCY = 0.52  # real-token fraction of padded batches (the anchors measured 48% padding)


def weight_flops_per_token(matmul_parameters: int, method: Method) -> float:
    """6·N for full fine-tuning, 4·N for LoRA/QLoRA (frozen weights get no weight gradients)."""
    return (6 if method == "full" else 4) * matmul_parameters


def attention_flops_per_pair(architecture: Architecture) -> float:
    """Forward and backward attention FLOPs per causal (query, key) pair: 12·L·d."""
    return 12 * architecture.layers * architecture.q_dim


def model_flops_per_token(architecture: Architecture, method: Method, context: int) -> float:
    """Model FLOPs per trained token (the MFU numerator's convention, see the module docstring).

    A packed sample of n tokens has n(n+1)/2 causal pairs, about n/2 per token; samples are assumed
    ``PACKED_MEAN_CONTEXT`` tokens long (or the whole context when that is shorter).
    """
    attended = min(context, PACKED_MEAN_CONTEXT) / 2
    return (
        weight_flops_per_token(architecture.matmul_parameters, method)
        + attention_flops_per_pair(architecture) * attended
    )


@dataclass(frozen=True)
class ThroughputInputs:
    architecture: Architecture
    method: Method
    gpu: GpuProfile
    micro_batch_size: int
    sequence_length: int
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    liger_kernels: bool = False
    precision: Precision = "bf16"
    packing: bool = True
    sharding: Sharding = "none"
    gpus_per_node: int = 1
    nodes: int = 1
    lora: LoraSettings | None = None  # the adapters, for LoRA and QLoRA
    inter_node_gbs: float = DEFAULT_TCP_GBPS / 8  # GB/s one node moves to the others (sftjob.network)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def lora_parameters(self) -> int:
        if self.lora is None or self.method == "full":
            return 0
        return self.architecture.lora_parameters(self.lora.r, self.lora.target_modules)


@dataclass(frozen=True)
class Prediction:
    tokens_per_second: float  # real tokens/s for the whole job
    mfu: float
    step_seconds: float  # one optimizer step


def _peak_flops(t: ThroughputInputs) -> float:
    g = t.gpu
    if t.precision == "fp32":
        return g.tf32_tflops * 1e12
    return (g.fp16_tflops if t.precision == "fp16" else g.bf16_tflops) * 1e12


def _micro_step_seconds(t: ThroughputInputs) -> float:
    a = t.architecture
    tokens = t.micro_batch_size * t.sequence_length
    flops = tokens * model_flops_per_token(a, t.method, t.sequence_length)
    flops += tokens * 6 * t.lora_parameters
    if t.gradient_checkpointing:
        flops += tokens * 2 * a.matmul_parameters  # one more forward
    efficiency = MATMUL_EFFICIENCY * tokens / (tokens + HALF_EFFICIENCY_TOKENS)
    compute = flops / (_peak_flops(t) * efficiency)
    per_unit = ELEMENTWISE_BYTES_LIGER if t.liger_kernels else ELEMENTWISE_BYTES
    moved: float = tokens * a.layers * per_unit * (a.hidden_size + a.active_intermediate_size)
    if t.gradient_checkpointing:
        moved *= 4 / 3
    if not t.liger_kernels:
        moved += tokens * a.vocab_size * LOGIT_TRAFFIC_BYTES
    if t.lora is not None and t.method != "full":
        inputs, outputs = a.lora_widths(t.lora.target_modules)
        moved += tokens * a.layers * LORA_TRAFFIC_BYTES * (inputs + outputs)
        if t.lora.dropout > 0:
            moved += tokens * a.layers * LORA_DROPOUT_TRAFFIC_BYTES * inputs
    if t.method == "qlora":
        moved += a.linear_parameters * NF4_DEQUANT_BYTES * (3 if t.gradient_checkpointing else 2)
    memory = moved / (t.gpu.bandwidth_gbs * 1e9)
    launch = a.layers * LAUNCH_SECONDS_PER_LAYER * (4 / 3 if t.gradient_checkpointing else 1)
    return compute + memory + launch


def _link_gbs(t: ThroughputInputs) -> float:
    intra = t.gpu.link_gbs
    return min(intra, t.inter_node_gbs) if t.nodes > 1 else intra


def _comm_seconds(t: ThroughputInputs) -> tuple[float, float]:
    """(per micro-batch, per optimizer step) communication time before overlap."""
    w = t.world_size
    if w == 1:
        return 0.0, 0.0
    ring = 2 * (w - 1) / w
    link = _link_gbs(t) * 1e9
    a = t.architecture
    grads = a.parameters * 4 if t.method == "full" else t.lora_parameters * 4  # fp32, trainable only
    # Sharded: every micro-batch all-gathers the bf16 weights in forward and again in backward (the
    # layers reshard after forward), and reduce-scatters the fp32 gradients of the trainable ones.
    sharded = a.parameters * (2 + 2) + grads
    if t.sharding == "fsdp":
        return (w - 1) / w * sharded / link, 0.0
    if t.sharding == "hsdp":
        # The same inside the node, over its own link; then, once per optimizer step, each rank
        # all-reduces its 1/g of the fp32 gradients with its peers on the other nodes (a ring of n):
        # the node's g ranks together push 2(n-1)/n of the whole gradients through the node's link.
        g, n = t.gpus_per_node, t.nodes
        inside = (g - 1) / g * sharded / (t.gpu.link_gbs * 1e9)
        across = 2 * (n - 1) / n * grads / (t.inter_node_gbs * 1e9)
        return inside, across
    return 0.0, ring * grads / link


def _gather_copy_seconds(t: ThroughputInputs) -> float:
    """Per micro-batch, under FSDP/HSDP: copying the weights out of the all-gather buffers (forward and
    backward; ``foreach_all_gather_copy_out``), on the compute stream."""
    if t.sharding not in ("fsdp", "hsdp") or t.world_size == 1:
        return 0.0
    return 2 * t.architecture.parameters * GATHER_COPY_BYTES / (t.gpu.bandwidth_gbs * 1e9)


def predict(t: ThroughputInputs) -> Prediction:
    """Predicted real tokens/s for the job and the MFU it means (module docstring convention)."""
    micro = _micro_step_seconds(t) + _gather_copy_seconds(t)
    comm_micro, comm_step = _comm_seconds(t)
    micro += max(0.0, comm_micro - COMM_OVERLAP * micro)
    step = micro * t.gradient_accumulation_steps
    step += max(0.0, comm_step - COMM_OVERLAP * micro)
    if t.method == "full":
        shard = state_shards(t.sharding, t.world_size, t.gpus_per_node)
        step += t.architecture.parameters / shard * ADAMW_BYTES_PER_PARAM / (t.gpu.bandwidth_gbs * 1e9)
    tokens = t.micro_batch_size * t.sequence_length * t.gradient_accumulation_steps * t.world_size
    real = tokens * (1.0 if t.packing else PADDING_EFFICIENCY) / step
    flops = model_flops_per_token(t.architecture, t.method, t.sequence_length)
    mfu = real * flops / (t.gpu.peak_tflops * 1e12 * t.world_size)
    return Prediction(tokens_per_second=real, mfu=mfu, step_seconds=step)
