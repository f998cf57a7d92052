"""Process-group setup and model wrapping for torchrun launches (DDP, or FSDP when the plan shards).

A plain ``python -m sftjob_trainer.train`` (or the console script) is world size 1 and never touches
torch.distributed; under torchrun the backend is NCCL on GPUs and gloo on CPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError

log = logging.getLogger(__name__)

PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)  # checkpoint saves of big models can hold ranks apart


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

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value, on every rank."""
        if not self.active:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


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
    return DistContext(rank, world, local_rank, local_world, device)


def wrap_model(
    model: nn.Module, config: TrainerConfig, ctx: DistContext, compute_dtype: torch.dtype
) -> nn.Module:
    if not ctx.active:
        return model
    if config.distributed.sharding == "fsdp":
        return _fully_shard(model, compute_dtype)
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _fully_shard(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root; bf16/fp16 compute with fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers: Any = next(
        (m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)),
        [],
    )
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def unwrap(model: nn.Module) -> Any:
    """The module inside DDP (FSDP2 shards in place, so there is nothing to unwrap)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def no_sync(model: nn.Module, last_micro_batch: bool) -> Any:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if last_micro_batch:
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


class _fsdp_no_sync(contextlib.AbstractContextManager[None]):
    def __init__(self, model: Any) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)
