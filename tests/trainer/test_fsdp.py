"""FSDP2 keeps what sharding saves: no whole model or whole gradient on a GPU, one fp16 loss scale for all.

The planner counts a sharded job's weights and gradients as 1/world per GPU. The trainer therefore leaves
the loaded model on the CPU for ``fully_shard`` to move layer by layer, reduce-scatters the gradients
after every micro-batch instead of accumulating them unsharded, and with fp16 makes every rank skip the
same overflowing steps (each rank only sees its own gradient shards).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sftjob.config import TrainerConfig
from sftjob_trainer import distributed
from sftjob_trainer.distributed import DistContext, wrap_model
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# No GPU here: the meta device stands for the rank's GPU (moving a module there is as visible).
GPU = torch.device("meta")
# Config overrides for full fine-tuning sharded over the ranks, with the fixture's global batch of 8.
SHARDED = {
    "method": "full",
    "distributed": {"nprocPerNode": RANKS, "sharding": "fsdp"},
    "training": {"gradientAccumulationSteps": 1},
}

# Two micro-batches of fp16 training on a small model sharded over the ranks; each rank writes what it saw.
FSDP_PROBE = """
import json, sys
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from sftjob.config import TrainerConfig
from sftjob_trainer.distributed import init_distributed, no_sync, wrap_model
from sftjob_trainer.loop import make_scaler
from sftjob_trainer.model import precision_plan

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()

config = TrainerConfig.load(sys.argv[1])
ctx = init_distributed(config)
torch.manual_seed(0)
model = wrap_model(Small(), config, ctx, torch.float32)
scaler = make_scaler(precision_plan("full", "fp16"), ctx.device, sharded=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
seen = {"scaler": type(scaler).__name__, "stepped": [], "scale": []}
for overflow in (False, True):
    with no_sync(model, last_micro_batch=False):
        scaler.scale(model(torch.ones(2, 8))).backward()
    seen["shardedAfterFirstMicroBatch"] = all(
        isinstance(p.grad, DTensor) and p.grad.placements[0].is_shard() for p in model.parameters()
    )
    with no_sync(model, last_micro_batch=True):
        scaler.scale(model(torch.ones(2, 8))).backward()
    if overflow and ctx.rank == 0:  # in a gradient shard only rank 0 holds
        next(model.parameters()).grad.to_local()[0, 0] = float("inf")
    before = [p.detach().to_local().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    after = [p.detach().to_local() for p in model.parameters()]
    seen["stepped"].append(any(not torch.equal(b, a) for b, a in zip(before, after)))
    seen["scale"].append(scaler.get_scale())
with open(f"{sys.argv[2]}/rank-{ctx.rank}.json", "w") as fh:
    json.dump(seen, fh)
ctx.barrier()
ctx.close()
"""


def test_under_fsdp_the_loaded_model_stays_on_the_cpu_for_fully_shard_to_move_layer_by_layer(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TrainerConfig.load(str(trainer_config(**SHARDED)))
    devices_when_sharded: list[set[torch.device]] = []

    def fully_shard(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
        devices_when_sharded.append({p.device for p in model.parameters()})
        return model

    monkeypatch.setattr(distributed, "_fully_shard", fully_shard)
    wrap_model(nn.Linear(4, 4), config, DistContext(0, RANKS, 0, RANKS, GPU), torch.bfloat16)
    assert devices_when_sharded == [{torch.device("cpu")}]


def test_without_fsdp_the_whole_model_moves_to_the_device(trainer_config: MakeConfig) -> None:
    config = TrainerConfig.load(str(trainer_config(method="full")))
    model = wrap_model(nn.Linear(4, 4), config, DistContext(0, 1, 0, 1, GPU), torch.bfloat16)
    assert {p.device for p in model.parameters()} == {GPU}


def test_fsdp_reduce_scatters_every_micro_batch_and_all_ranks_skip_an_fp16_overflow_together(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config(name="probe", **SHARDED)
    script = config.parent / "fsdp_probe.py"
    script.write_text(FSDP_PROBE)
    assert torchrun(config, termination_log, [str(script), str(config), str(config.parent)]) == 0, (
        trainer_output(config)
    )
    for rank in range(RANKS):
        seen = json.loads((config.parent / f"rank-{rank}.json").read_text())
        assert seen["scaler"] == "ShardedGradScaler"
        # Sharded gradients already after the first micro-batch: no whole fp32 gradient waits on the GPU.
        assert seen["shardedAfterFirstMicroBatch"], rank
        # A clean step is taken; an overflow in rank 0's shard is skipped by both, which halve the scale.
        assert seen["stepped"] == [True, False], rank
        assert seen["scale"] == [65536.0, 32768.0], rank
