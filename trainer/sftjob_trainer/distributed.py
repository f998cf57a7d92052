"""Process-group setup and model wrapping for torchrun launches: DDP, or FSDP2 when the plan shards, over
every rank (``fsdp``) or over each node's ranks with the nodes holding replicas (``hsdp``).

A plain ``python -m sftjob_trainer.train`` (or the console script) is world size 1 and never touches
torch.distributed; under torchrun the backend is NCCL on GPUs and gloo on CPUs, and the first collective is
a bounded probe (:func:`probe_communication`), so links that hang fail the attempt in minutes. Preflight's
GPU checks run before any of it, on every rank (:func:`init_distributed`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from sftjob.config import TrainerConfig
from sftjob.failures import COMMUNICATION_PROBE, ExitCode, TrainerError
from sftjob.gpus import profile_for_product
from sftjob_trainer.adapters import towers_in_training
from sftjob_trainer.preflight import check_gpu

log = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # checkpoint saves of big models can hold ranks apart
# How long the other ranks wait for rank 0's download and load of the pretrained weights (a 70B base is
# 140 GB), on a CPU group of their own: NCCL's watchdog would abort them after PROCESS_GROUP_TIMEOUT.
# The operator's stall timeout (restartPolicy.stallTimeoutSeconds) is the limit that applies.
SETUP_TIMEOUT = timedelta(days=1)
# The first collective, an all-reduce right after the process group is up, must end within this. Where the
# links work it takes well under a second (NCCL connects its transports on it); where GPU-to-GPU traffic
# hangs (PCIe-only GPUs whose peer-to-peer path ACS or the IOMMU blocks) it would wait PROCESS_GROUP_TIMEOUT,
# and the operator's stall timeout, 30 minutes too, would end the attempt as Stalled, not CommunicationError.
COMMUNICATION_PROBE_TIMEOUT = timedelta(minutes=5)
_PROBE_ELEMENTS = 2**18  # 1 MiB of float32, a small gradient bucket's traffic
_PROBE_POLL_SECONDS = 0.01


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (one collective for several numbers)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def sum_after_setup(self, values: list[float]) -> list[float]:
        """:meth:`sum` in the setup group, on the CPU: ranks may arrive up to ``SETUP_TIMEOUT`` apart (one
        downloading a big dataset that another has cached)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=_setup_group())
        return [float(v) for v in t.tolist()]

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value, on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wait_for_rank0(self) -> None:
        """Collective: every rank waits here, up to ``SETUP_TIMEOUT``, until rank 0 arrives (after a
        long piece of work of its own, before the collectives that need its result)."""
        if self.active:
            dist.barrier(group=_setup_group())

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()
            _setup_group.cache_clear()


@functools.cache
def _setup_group() -> Any:
    """A gloo group over every rank with a one-day timeout (created on first use, by every rank)."""
    return dist.new_group(backend="gloo", timeout=SETUP_TIMEOUT)


def init_distributed(config: TrainerConfig) -> DistContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world != config.distributed.world_size:
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"launched with WORLD_SIZE={world} but the plan is for {config.distributed.world_size} processes"
            " (distributed.nnodes x distributed.nprocPerNode)",
        )
    if config.gpu.required:
        # Preflight's GPU checks, before this rank touches its GPU or meets its peers: else a rank whose
        # CUDA is down picks gloo while its peers pick NCCL (a 30-min wait blaming no node), a missing GPU
        # fails set_device, a faulty one the probe, and a GPU a stray process holds NCCL's buffers, each
        # with a class that would not avoid the node (UNKNOWN, CUDA_OOM, COMMUNICATION_ERROR).
        check_gpu(config.gpu, local_rank, local_world)
    else:
        log.info("preflight: GPU checks skipped because gpu.required is false (CPU run)")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(
            backend=backend, timeout=PROCESS_GROUP_TIMEOUT, device_id=device if cuda else None
        )
        log.info("process group up: rank %d of %d, backend %s", rank, world, backend)
        probe_communication(device, world, backend, local_world=local_world)
    return DistContext(rank, world, local_rank, local_world, device)


def probe_communication(device: torch.device, world: int, backend: str, *, local_world: int) -> None:
    """One all-reduce over every rank, bounded by ``COMMUNICATION_PROBE_TIMEOUT``: a hang, a failure or a
    wrong sum ends the attempt with COMMUNICATION_ERROR, which the operator answers on PCIe-only GPUs with
    ``NCCL_P2P_LEVEL=NVL`` on the next attempt. ``Work.wait`` does not bound an NCCL collective (it only
    orders the streams), so the work is polled until the deadline."""
    started = time.monotonic()
    ones = torch.ones(_PROBE_ELEMENTS, device=device)
    work = dist.all_reduce(ones, async_op=True)
    deadline = started + COMMUNICATION_PROBE_TIMEOUT.total_seconds()
    while not work.is_completed():
        if time.monotonic() > deadline:
            if backend == "nccl":  # ends the hung kernels: destroying the group would wait for them
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()
            seconds = COMMUNICATION_PROBE_TIMEOUT.total_seconds()
            raise _probe_failure(device, world, local_world, f"did not finish within {seconds:.0f} s")
        time.sleep(_PROBE_POLL_SECONDS)
    try:
        work.wait()
    except Exception as exc:
        raise _probe_failure(device, world, local_world, f"failed ({type(exc).__name__}: {exc})") from exc
    if not bool((ones == world).all()):
        raise _probe_failure(device, world, local_world, "returned wrong sums (data corrupted on the way)")
    log.info("communication probe: all-reduce over %d ranks in %.2f s", world, time.monotonic() - started)


def _probe_failure(device: torch.device, world: int, local_world: int, what: str) -> TrainerError:
    """The COMMUNICATION_ERROR of a failed probe, naming the GPUs' interconnect and NCCL_P2P_LEVEL, and what
    can block the traffic: between nodes (``world`` > ``local_world``) the network between the pods, inside
    a node the peer-to-peer path of PCIe-only GPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = profile_for_product(name)
        where = f"{name} ({profile.interconnect if profile else 'interconnect unknown'})"
    else:
        where = "gloo on the CPU"
    level = os.environ.get("NCCL_P2P_LEVEL", "unset")
    causes = []
    if world > local_world:  # the likeliest cause first: the job's status keeps the first 300 characters
        causes.append(
            "between nodes, the pods' network (every TCP port must be open between them, not only the"
            " rendezvous port; MTU; NCCL_SOCKET_IFNAME; the RDMA GID)"
        )
    if local_world > 1:
        causes.append(
            "inside a node, PCIe ACS or the IOMMU blocking the P2P traffic of PCIe-only GPUs (A40, L40S), on"
            " which the operator retries with NCCL_P2P_LEVEL=NVL"
        )
    return TrainerError(
        ExitCode.COMMUNICATION_ERROR,
        f"{COMMUNICATION_PROBE} the {world} ranks (a 1 MiB all-reduce) {what} on {where} with"
        f" NCCL_P2P_LEVEL {level}; likely causes: {'; '.join(causes)}",
    )


def shards(config: TrainerConfig, ctx: DistContext) -> bool:
    """The model is sharded with FSDP2, over all ranks or inside each node (rather than replicated with
    DDP, or alone on one process)."""
    return ctx.active and config.distributed.sharding in ("fsdp", "hsdp")


def hybrid_mesh(config: TrainerConfig, ctx: DistContext) -> DeviceMesh | None:
    """HSDP's mesh: a row per node, replicas of each other, whose ranks shard the model among them; None
    under FSDP (``fully_shard``'s default: every rank on one axis).

    FSDP2 reads a 2-D mesh as (replicate, shard) (``HSDPMeshInfo(replicate_mesh_dim=0, shard_mesh_dim=1)``):
    parameters are ``(Replicate(), Shard(0))`` DTensors, gathered and reduce-scattered along a row and
    all-reduced down the columns. The mesh numbers ranks row by row, as torchrun numbers each node's ranks
    one after the other, so a row is one node's GPUs and only the all-reduce leaves the node.
    """
    d = config.distributed
    if d.sharding != "hsdp":
        return None
    return init_device_mesh(
        ctx.device.type, (d.nnodes, d.nproc_per_node), mesh_dim_names=("replicate", "shard")
    )


def loads_on_rank0(config: TrainerConfig, ctx: DistContext) -> bool:
    """Full fine-tuning or LoRA under FSDP or HSDP: every rank builds the model without weights
    (``model.build_model``, with LoRA adapters), shards it, and the pretrained weights come from rank 0
    alone (:func:`load_rank0_weights`; for LoRA with the adapters' initial values), or, for full
    fine-tuning, from a checkpoint when the run resumes (an adapter checkpoint holds no base). Otherwise
    each process loads the whole model itself.

    Global rank 0, not each node's first rank: ``broadcast_from_rank0`` sends from global rank 0 to every
    rank (under HSDP too: each keeps its slice of the 2-D mesh), so a copy loaded on any other node would
    never be read. A node thus needs one fp32 copy in host memory,
    not one per GPU (operator/sftjob/resources.py).
    """
    return shards(config, ctx) and config.method != "qlora"


def wrap_model(
    model: nn.Module, config: TrainerConfig, ctx: DistContext, compute_dtype: torch.dtype
) -> nn.Module:
    """Put the model on this rank's device and wrap it for data parallelism.

    Under FSDP the model stays where it was built or loaded: ``fully_shard`` moves each decoder layer's
    CPU tensors to the device as it shards it (torch's ``_move_states_to_device``), then the embeddings
    and the head, so a GPU holds its shards plus one unsharded piece at a time, never the whole fp32 model.
    Parameters on the meta device (:func:`loads_on_rank0`) are sharded as they are and then given empty
    shards on the device, for :func:`load_rank0_weights` or a checkpoint to fill. QLoRA models were loaded
    onto the device already.
    """
    if shards(config, ctx):
        model = _fully_shard(model, compute_dtype, hybrid_mesh(config, ctx))
        _materialise(model, ctx.device)
        return model
    if config.method != "qlora" and next(model.parameters()).device != ctx.device:
        model = model.to(ctx.device)
    if not ctx.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    # A multimodal model's towers, trained in full fine-tuning, get no gradient from text.
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=towers_in_training(model))


def _fully_shard(model: nn.Module, compute_dtype: torch.dtype, mesh: DeviceMesh | None) -> nn.Module:
    """FSDP2: shard every block (:func:`fsdp_blocks`), then the root; bf16/fp16 compute with fp32
    gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = fsdp_blocks(model)
    if blocks:
        kinds = ", ".join(sorted({type(block).__name__ for block in blocks}))
        log.info("FSDP: %d blocks (%s) gathered one at a time", len(blocks), kinds)
    else:
        log.warning(
            "FSDP: %s names no blocks to keep whole (_no_split_modules): it is sharded as one unit, which"
            " every forward and backward gathers whole, where the plan counted one layer at a time",
            type(model).__name__,
        )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards and gathers one at a time: those of the classes transformers keeps whole on
    one device (``_no_split_modules``, gathered from every submodel: the decoder layers, and a multimodal
    model's vision encoder layers), found anywhere in the model (under peft's wrapper too), outermost
    first, in order. Not the first ``ModuleList`` named ``layers``: GPT-2, Falcon and Bloom keep their
    layers in ``transformer.h``, MPT in ``transformer.blocks``, and Gemma 3's first such list is its
    vision tower's."""
    kinds: set[str] = set()
    for module in model.modules():
        kinds.update(getattr(module, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    taken: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if type(module).__name__ in kinds and not name.startswith(taken):
            blocks.append(module)
            taken += (f"{name}.",)
    return blocks


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Empty shards on ``device`` for a model sharded on the meta device (the torch recipe for FSDP2 with
    ``broadcast_from_rank0``). ``to_empty`` re-allocates the buffers too: they are not in any state dict
    (RoPE frequencies) or come from it anyway, so their values, computed when the model was built, are
    copied back."""
    if not any(p.is_meta for p in model.parameters()):
        return
    buffers = dict(model.named_buffers())
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def load_rank0_weights(model: nn.Module, weights: dict[str, Any]) -> None:
    """Rank 0's whole state dict (``weights``; empty on the other ranks) into every rank's shards.

    Collective. One tensor at a time, rank 0 copies it to its device and broadcasts it, and each rank
    keeps its shard, so no rank but 0 ever holds more than one whole tensor. Strict: a parameter that
    rank 0's weights lack fails the run instead of training from uninitialised memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)


def unwrap(model: nn.Module) -> Any:
    """The module inside DDP (FSDP2 shards in place, so there is nothing to unwrap)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def no_sync(model: nn.Module, last_micro_batch: bool) -> Any:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation.

    DDP: ``no_sync``. FSDP2 reduce-scatters after every micro-batch instead. Skipping it
    (``set_requires_gradient_sync(False)``) would keep each parameter's whole, unsharded gradient on every
    GPU in fp32 (the reduce dtype) until the last micro-batch: the memory sharding exists to save, and
    the planner counts gradients as sharded. One reduce-scatter per micro-batch is the price; under HSDP
    it stays inside the node, and the all-reduce between nodes waits for the last micro-batch
    (``set_requires_all_reduce(False)``: FSDP2 sums the reduce-scattered shards in a buffer of their
    size meanwhile). On FSDP's one-axis mesh there is no all-reduce to skip.
    """
    if last_micro_batch:
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _all_reduce_deferred(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _all_reduce_deferred(model: FSDPModule) -> Iterator[None]:
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)
