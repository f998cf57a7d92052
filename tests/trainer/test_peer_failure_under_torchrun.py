"""When one rank fails, torchrun SIGTERMs its peers: the termination message the pod's ranks share keeps
the failed rank's reason, not a peer's PREEMPTED (which the operator would take for a free restart)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sftjob.failures import ExitCode, read_exit_tag
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# The last rank fails its storage check at once; the others take a moment longer over theirs, so torchrun's
# SIGTERM finds them in setup, before any collective.
LAST_RANK_FAILS_PREFLIGHT = """
import os, time
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import train

def preflight(config):
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        raise TrainerError(ExitCode.STORAGE_ERROR, "output directory /output is not writable: disk full")
    time.sleep(2)

train.run_preflight = preflight
train.main()
"""


def test_a_peer_stopped_by_torchrun_keeps_the_failed_ranks_reason_in_the_termination_message(
    trainer_config: MakeConfig, termination_log: Path, tmp_path: Path
) -> None:
    config = trainer_config(
        distributed={"nprocPerNode": RANKS, "sharding": "ddp"},
        training={"microBatchSize": 2, "gradientAccumulationSteps": 2},
    )
    script = tmp_path / "last_rank_fails.py"
    script.write_text(LAST_RANK_FAILS_PREFLIGHT)
    assert torchrun(config, termination_log, [str(script)]) == 1
    log = trainer_output(config)
    assert "exiting with PREEMPTED" in log  # rank 0 was stopped by torchrun, not by the failure itself
    code, reason = read_exit_tag(termination_log.read_text())
    assert code == ExitCode.STORAGE_ERROR and "disk full" in reason, reason
