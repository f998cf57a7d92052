"""Host-side needs of a trainer pod: CPU, memory, /dev/shm, and the environment the plan sets.

The GPU plan decides the training configuration; this module sizes what surrounds it on the node:
CPUs for the dataloader workers and the process, host memory to load and save the model, a
memory-backed /dev/shm for the workers and NCCL's shared-memory transport (Docker's 64 MB default
breaks both: NVIDIA/nccl #290, #342, #525), and environment variables by interconnect.
The byte counts per parameter are the memory estimator's (:mod:`sftjob.memory`), applied to what the
trainer actually holds on the host (trainer/sftjob_trainer/model.py, checkpoints.py).
"""

from __future__ import annotations

import math

from sftjob.architectures import Architecture
from sftjob.config import LoraSettings, Method, Optimizer, Precision
from sftjob.memory import ADAPTER_STATE_BYTES, BF16_BYTES, FULL_STATE_BYTES, GIB, OPTIMIZER_BYTES
from sftjob.plan import PodResources

CPUS_PER_GPU = 8
MAX_CPUS_PER_POD = 64
MAX_WORKERS = 4
HOST_MEMORY_FLOOR_GIB = 32
LOAD_HEADROOM = 1.5  # host memory while loading shared shards, as a multiple of the loaded model
HOST_GIB_PER_PROCESS = 3  # Python, CUDA host allocations, pinned buffers, dataloader workers
SHM_GIB_PER_GPU = 4
SHM_FLOOR_GIB = 8


def workers_per_process(cpus_per_gpu: int) -> int:
    """Dataloader workers per training process: half its CPUs, at most 4 (data is pre-tokenised)."""
    return max(1, min(MAX_WORKERS, cpus_per_gpu // 2))


def _round_up(gib: float, step: int = 8) -> int:
    return step * math.ceil(gib / step)


def checkpoint_gib(
    architecture: Architecture, method: Method, lora: LoraSettings, optimizer: Optimizer
) -> float:
    """One checkpoint on disk, and the time its save takes (the pod's termination grace period).

    ``checkpoints.save`` writes the trainable parameters only (``ignore_frozen_params``): every fp32
    master weight for full fine-tuning, the fp32 LoRA adapters otherwise, and the optimizer state of the
    same parameters (AdamW's fp32 m and v, 8 B/param; 8-bit AdamW about 2). Each rank writes its own
    shards from the GPU, a tensor at a time, so a checkpoint takes no host memory to speak of. The
    scheduler, scaler, step counters and RNG states are kilobytes.
    """
    if method == "full":
        params, weight_bytes = architecture.parameters, FULL_STATE_BYTES["weights"]
    else:
        params = architecture.lora_parameters(lora.r, lora.target_modules)
        weight_bytes = ADAPTER_STATE_BYTES["weights"]
    return params * (weight_bytes + OPTIMIZER_BYTES[optimizer]) / GIB


def pod_resources(
    architecture: Architecture,
    method: Method,
    gpus_per_node: int,
    precision: Precision = "bf16",
    *,
    nodes: int = 1,
    sharded: bool = False,
    merged: bool = False,
) -> tuple[PodResources, int]:
    """Requests for one node's pod, and the CPUs each GPU's process gets.

    Host memory is the largest of the transient needs below, plus what the pod holds all along. Global
    rank 0 runs in the pod of node rank 0 (torchrun's static rendezvous), so only that pod needs the
    first two; on several nodes the others (``worker_memory``) ask for the rest (a full fine-tune of
    Mixtral 8x22B on eight nodes: 88Gi instead of 848Gi per pod):

    - loading the model: under FSDP or HSDP (not QLoRA: the trainer's ``loads_on_rank0``) global rank 0
      alone loads the whole model as loaded (fp32 for full fine-tuning or an fp32 run, bf16 otherwise)
      into its own CPU memory and broadcasts it into every rank's shards, times ``LOAD_HEADROOM`` for the
      page cache of the files it reads. Otherwise every process loads straight onto its GPU
      (``device_map``): the host holds only page cache, which the kernel reclaims before it kills;
    - saving the final model: under FSDP rank 0 gathers it, the size of what it loaded; a fully
      fine-tuned model on one GPU or under DDP goes through a host copy in the precision it trained in
      (bf16, or fp32 for an fp32 run), times ``LOAD_HEADROOM``; adapters are small. Checkpoints need no
      host memory (:func:`checkpoint_gib`);
    - merging an adapter into its base (``merged``: ``spec.output.mergeAdapter``): rank 0 loads the base
      once more on the CPU, unquantised, in the precision it computed in, and writes it merged
      (trainer/sftjob_trainer/merging.py), times ``LOAD_HEADROOM``;
    - ``HOST_MEMORY_FLOOR_GIB``, for small models, the tokenised dataset and the rest;
    - all along: ``HOST_GIB_PER_PROCESS`` per training process, and the memory-backed /dev/shm,
      which counts against the pod's memory limit.
    """
    cpus = min(CPUS_PER_GPU * gpus_per_node, MAX_CPUS_PER_POD)
    fp32 = precision == "fp32"
    if sharded and method != "qlora":
        rank0 = architecture.parameters * (
            FULL_STATE_BYTES["weights"] if fp32 or method == "full" else BF16_BYTES
        )
    elif method == "full":
        rank0 = architecture.parameters * (FULL_STATE_BYTES["weights"] if fp32 else BF16_BYTES)
    else:
        rank0 = 0
    if merged:
        rank0 = max(rank0, architecture.parameters * (FULL_STATE_BYTES["weights"] if fp32 else BF16_BYTES))
    shm = max(SHM_FLOOR_GIB, SHM_GIB_PER_GPU * gpus_per_node)
    held = HOST_GIB_PER_PROCESS * gpus_per_node + shm
    memory = f"{_round_up(max(HOST_MEMORY_FLOOR_GIB, LOAD_HEADROOM * rank0 / GIB) + held)}Gi"
    worker = f"{_round_up(HOST_MEMORY_FLOOR_GIB + held)}Gi"
    return PodResources(
        cpu=str(cpus),
        memory=memory,
        shm_size=f"{shm}Gi",
        worker_memory=worker if nodes > 1 and worker != memory else None,
    ), cpus // gpus_per_node


def pod_environment(gpus_per_node: int, nodes: int, cpus_per_gpu: int) -> dict[str, str]:
    """Environment for the trainer container.

    - ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the fix for the seed guide's "memory free
      but allocation fails" fragmentation problem.
    - P2P is left to NCCL's own topology detection, which prefers NVLink where there is one. No
      ``NCCL_P2P_LEVEL``: it only restricts, and the pod's environment comes from the first candidate
      card's plan wherever the pod lands, so NVLink-only P2P set for an A800 SXM4 plan would turn P2P
      off on a PCIe card. A host whose ACS/IOMMU setup breaks PCIe P2P shows as a communication error;
      the next attempts then keep P2P to NVLink (``sftjob_operator.restarts``, research §3.1).
    - Single node: no network transport (``NCCL_IB_DISABLE=1``). Multi-GPU: NCCL logs its init and
      the transport per channel ("via P2P/IPC", "via SHM") once, so a slow PCIe path is visible.
    """
    workers = workers_per_process(cpus_per_gpu)
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "OMP_NUM_THREADS": str(max(1, cpus_per_gpu - workers - 1)),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if gpus_per_node * nodes > 1:
        env |= {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV"}
        if nodes == 1:
            env["NCCL_IB_DISABLE"] = "1"
    return env
