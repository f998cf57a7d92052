"""The first collective of a multi-rank attempt is a bounded all-reduce: a peer-to-peer path that hangs ends
the attempt with COMMUNICATION_ERROR in minutes, not as Stalled after NCCL's or the operator's 30."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError, read_exit_tag
from sftjob_operator.attempt_end import PEER_NEVER_JOINED
from sftjob_operator.termination import GPU_FAULT_SIGNATURE
from sftjob_trainer import distributed
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# The last rank never reaches the probe (as a GPU whose peer-to-peer traffic never arrives), and leaves later.
LAST_RANK_NEVER_JOINS_THE_PROBE = """
import os, time
from datetime import timedelta
from sftjob_trainer import distributed, train

distributed.COMMUNICATION_PROBE_TIMEOUT = timedelta(seconds=2)
if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    def never_joins(*args, **kwargs):
        time.sleep(6)
        os._exit(0)

    distributed.probe_communication = never_joins
train.main()
"""


def test_a_first_collective_that_hangs_ends_the_attempt_with_a_communication_error_naming_nccl_p2p_level(
    trainer_config: MakeConfig, termination_log: Path, tmp_path: Path
) -> None:
    config = trainer_config(
        distributed={"nprocPerNode": RANKS, "sharding": "ddp"},
        training={"microBatchSize": 2, "gradientAccumulationSteps": 2},
    )
    script = tmp_path / "last_rank_never_joins.py"
    script.write_text(LAST_RANK_NEVER_JOINS_THE_PROBE)
    assert torchrun(config, termination_log, [str(script)]) == 1
    assert "exiting with COMMUNICATION_ERROR" in trainer_output(config)
    code, reason = read_exit_tag(termination_log.read_text())
    assert code == ExitCode.COMMUNICATION_ERROR, reason
    assert "did not finish within 2 s" in reason and "NCCL_P2P_LEVEL unset" in reason, reason
    # The operator's NCCL fallback skips a peer that never joined torchrun's rendezvous: this is not one.
    assert PEER_NEVER_JOINED.search(reason) is None


class _Done:
    """A collective that ended at once without adding anything up."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def test_a_first_collective_that_returns_wrong_sums_is_a_communication_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda *args, **kwargs: _Done())
    with pytest.raises(TrainerError) as raised:
        distributed.probe_communication(torch.device("cpu"), 2, "gloo", local_world=2)
    assert raised.value.code == ExitCode.COMMUNICATION_ERROR and "wrong sums" in raised.value.reason


def test_a_single_process_starts_without_a_communication_probe(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_collectives(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a single process runs no collective")

    monkeypatch.setattr(distributed.dist, "all_reduce", no_collectives)
    ctx = distributed.init_distributed(TrainerConfig.load(str(trainer_config())))
    assert not ctx.active


@pytest.mark.parametrize(
    ("world", "local_world", "between_nodes", "inside_a_node"),
    [(4, 2, True, True), (2, 1, True, False), (2, 2, False, True)],
)
def test_a_failed_probe_blames_the_pods_network_across_nodes_and_the_pcie_path_inside_a_node(
    monkeypatch: pytest.MonkeyPatch, world: int, local_world: int, between_nodes: bool, inside_a_node: bool
) -> None:
    monkeypatch.setattr(distributed.dist, "all_reduce", lambda *args, **kwargs: _Done())
    with pytest.raises(TrainerError) as raised:
        distributed.probe_communication(torch.device("cpu"), world, "gloo", local_world=local_world)
    reason = raised.value.reason
    assert ("every TCP port must be open between them" in reason) is between_nodes, reason
    assert ("PCIe ACS or the IOMMU" in reason) is inside_a_node, reason
    if between_nodes and inside_a_node:  # the network first: the job's status keeps only the start
        assert reason.index("between nodes") < reason.index("inside a node")
    # Still a CommunicationError for the operator, not a GPU fault.
    assert GPU_FAULT_SIGNATURE.search(reason) is None
