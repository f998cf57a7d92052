"""HSDP on four CPU ranks (gloo) as two simulated nodes of two: FSDP2 inside a node, replicas across nodes.

The config's ``distributed.nnodes x nprocPerNode`` (2 x 2) shapes the mesh while one torchrun starts all
four ranks, numbered node by node as torchrun numbers them on real nodes. A row of the mesh is a node:
parameters are sharded along it and replicated down its columns, and inside a gradient accumulation only
the reduce-scatter along the row runs before the last micro-batch; the all-reduce between the rows waits.

Full fine-tuning under HSDP must train as one process does on the same global batch (rank 0's pretrained
weights broadcast into the 2-D shards, gradient clipping over 2-D DTensors, the saved model gathered
whole), and its checkpoints must load under FSDP and FSDP's under HSDP: an OOM re-plan or a change of
layout can switch between them from one attempt to the next.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sftjob.failures import ExitCode
from sftjob_trainer.train import run
from tests.trainer import runs
from tests.trainer.runs import SMALL_SHARDED_MODEL, MakeConfig, torchrun, trainer_output
from tests.trainer.test_distributed import (
    _assert_same_training,
    _checkpoint_root,
    _output,
    _summary,
    _training,
)

pytestmark = pytest.mark.trainer

NODES, PER_NODE = 2, 2
STEPS = 6
# AdamW moves a weight by up to the learning rate (3e-3) a step however small its gradient, so the float
# order of four ranks' sums shows in weights whose gradients are near zero: 1.2e-5 seen, far below a step.
WEIGHTS_ATOL = 1e-4

# Two micro-batches of a small model on the 2 x 2 mesh; each rank writes what it saw.
HSDP_PROBE = (
    """
import json, sys
import torch
from torch import nn
from sftjob.config import TrainerConfig
from sftjob_trainer.distributed import init_distributed, no_sync, wrap_model

"""
    + SMALL_SHARDED_MODEL
    + """weight = model.layers[0].weight
seen = {
    "mesh": weight.device_mesh.mesh.tolist(),
    "dims": list(weight.device_mesh.mesh_dim_names),
    "placements": [type(p).__name__ for p in weight.placements],
}
x = torch.full((2, 8), float(ctx.rank + 1))  # every rank its own data
with no_sync(model, last_micro_batch=False):
    model(x).backward()
seen["gradientsBeforeTheLastMicroBatch"] = [p.grad is not None for p in model.parameters()]
with no_sync(model, last_micro_batch=True):
    model(x).backward()
seen["headGradient"] = model.head.weight.grad.full_tensor().tolist()
with open(f"{sys.argv[2]}/rank-{ctx.rank}.json", "w") as fh:
    json.dump(seen, fh)
ctx.barrier()
ctx.close()
"""
)


@pytest.fixture
def four_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts the two simulated nodes' four ranks on this machine."""
    monkeypatch.setattr(runs, "RANKS", NODES * PER_NODE)


def _layout(sharding: str) -> dict[str, Any]:
    """Config overrides for full fine-tuning on the 2 x 2 layout with the fixture's global batch of 8:
    micro-batches of 1, accumulated over 2."""
    return {
        "method": "full",
        "training": {"maxSteps": STEPS, "microBatchSize": 1, "gradientAccumulationSteps": 2},
        "distributed": {"nnodes": NODES, "nprocPerNode": PER_NODE, "sharding": sharding},
        "checkpoints": {"everySteps": 2, "keep": 3},
    }


def _assert_same_weights(got: Path, expected: Path) -> None:
    """The saved model is whole (gathered from the 2-D shards) and has the one-process weights."""
    from safetensors.torch import load_file

    a, b = load_file(got / "model.safetensors"), load_file(expected / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=0, atol=WEIGHTS_ATOL, msg=name)


def _switch(config: Path, sharding: str) -> None:
    """The next attempt of the same job runs with ``sharding`` (same folders, same batch)."""
    data = json.loads(config.read_text())
    data["distributed"]["sharding"] = sharding
    config.write_text(json.dumps(data))


def test_hsdp_shards_inside_each_node_and_all_reduces_between_nodes_only_on_the_last_micro_batch(
    trainer_config: MakeConfig, termination_log: Path, four_ranks: None
) -> None:
    config = trainer_config(name="probe", **_layout("hsdp"))
    script = config.parent / "hsdp_probe.py"
    script.write_text(HSDP_PROBE)
    assert torchrun(config, termination_log, [str(script), str(config), str(config.parent)]) == 0, (
        trainer_output(config)
    )
    torch.manual_seed(0)  # the probe's model, whole, on every rank's data in turn
    layers, head = [nn.Linear(8, 8), nn.Linear(8, 8)], nn.Linear(8, 1)
    reference = nn.Sequential(*layers, head)
    for rank in range(NODES * PER_NODE):
        for _micro_batch in range(2):
            reference(torch.full((2, 8), float(rank + 1))).sum().backward()
    assert head.weight.grad is not None
    mean_head_gradient = head.weight.grad / (NODES * PER_NODE)  # FSDP2 averages over all ranks
    for rank in range(NODES * PER_NODE):
        seen = json.loads((config.parent / f"rank-{rank}.json").read_text())
        # A row per node, its ranks the node's: they shard each parameter; the rows replicate it.
        assert seen["mesh"] == [[0, 1], [2, 3]], rank
        assert seen["dims"] == ["replicate", "shard"], rank
        assert seen["placements"] == ["Replicate", "Shard"], rank
        # Before the last micro-batch the reduce-scattered shards wait in FSDP2's buffer: no gradient yet.
        assert seen["gradientsBeforeTheLastMicroBatch"] == [False] * 6, rank
        torch.testing.assert_close(torch.tensor(seen["headGradient"]), mean_head_gradient, msg=f"rank {rank}")


def test_hsdp_full_fine_tuning_trains_like_one_process_and_its_checkpoints_resume_under_fsdp_and_back(
    trainer_config: MakeConfig, termination_log: Path, four_ranks: None
) -> None:
    one = trainer_config(
        name="one",
        method="full",
        training={"maxSteps": STEPS, "microBatchSize": 2, "gradientAccumulationSteps": 4},
    )
    assert run(str(one)) == ExitCode.OK
    expected = _training(one)

    config = trainer_config(name="hsdp", **_layout("hsdp"))
    assert torchrun(config, termination_log) == ExitCode.OK, trainer_output(config)
    _assert_same_training(config, expected, range(1, STEPS + 1))
    _assert_same_weights(_output(config), _output(one))

    # An attempt under FSDP from the HSDP checkpoint of step 2; it writes step 4's checkpoint itself.
    root = _checkpoint_root(config)
    shutil.rmtree(root / "checkpoint-4")
    _switch(config, "fsdp")
    assert torchrun(config, termination_log) == ExitCode.OK, trainer_output(config)
    assert _summary(config)["resumedFromStep"] == 2
    _assert_same_training(config, expected, range(3, STEPS + 1))
    _assert_same_weights(_output(config), _output(one))

    # And under HSDP again, from FSDP's checkpoint of step 4.
    _switch(config, "hsdp")
    assert torchrun(config, termination_log) == ExitCode.OK, trainer_output(config)
    assert _summary(config)["resumedFromStep"] == 4
    _assert_same_training(config, expected, range(5, STEPS + 1))
    _assert_same_weights(_output(config), _output(one))
