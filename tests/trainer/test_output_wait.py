"""Rank 0 alone writes the output while the other ranks wait for it, for as long as the write takes: a 70B
model written at a slow volume's pace outlasts what a collective may wait (the process group's timeout),
and ending the attempt there would lose every step a full fine-tune did since its last checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# The process group's timeout scaled down to 2 s; rank 0's write takes 5.
SLOW_WRITE = """
import sys, time
from datetime import timedelta
from sftjob.config import TrainerConfig
from sftjob_trainer import distributed, output

distributed.PROCESS_GROUP_TIMEOUT = timedelta(seconds=2)
config = TrainerConfig.load(sys.argv[1])
ctx = distributed.init_distributed(config)

def write(folder):
    time.sleep(5)
    (folder / "model.safetensors").write_text("weights")

output.save(config, ctx, {"steps": 1}, write)
ctx.close()
"""


def test_the_other_ranks_wait_for_rank_0s_output_longer_than_a_collective_may_wait(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config(
        distributed={"nprocPerNode": RANKS, "sharding": "ddp"}, training={"gradientAccumulationSteps": 1}
    )
    script = config.parent / "slow_write.py"
    script.write_text(SLOW_WRITE)
    assert torchrun(config, termination_log, [str(script), str(config)]) == 0, trainer_output(config)
    assert (config.parent / "output" / "model.safetensors").read_text() == "weights"
