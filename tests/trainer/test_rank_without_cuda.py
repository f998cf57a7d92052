"""A rank of a GPU job whose CUDA does not start fails before the rendezvous with preflight's reason: it
would otherwise pick gloo while its peers pick NCCL, and the ranks would wait for each other for 30
minutes, ending as a communication error that blames no node."""

from __future__ import annotations

import pytest
import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import distributed, preflight
from sftjob_trainer.preflight import DriverInfo
from tests.trainer.runs import RANKS, MakeConfig

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            "Unexpected error from cudaGetDeviceCount(). Error 802: system not yet initialized",
            ExitCode.GPU_UNAVAILABLE,
        ),
        ("The NVIDIA driver on your system is too old (found version 12080).", ExitCode.DRIVER_MISMATCH),
    ],
    ids=["fabric manager down", "driver too old"],
)
def test_a_rank_whose_cuda_does_not_start_fails_before_joining_its_peers_with_preflights_reason(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch, error: str, expected: ExitCode
) -> None:
    def init() -> None:
        raise RuntimeError(error)

    def joins(*args: object, **kwargs: object) -> None:
        raise AssertionError("the rank joined the process group")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(preflight, "read_driver_info", lambda: DriverInfo("580.95.05", (13, 0)))
    monkeypatch.setattr(distributed.dist, "init_process_group", joins)
    for name, value in {"WORLD_SIZE": RANKS, "RANK": 1, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": RANKS}.items():
        monkeypatch.setenv(name, str(value))
    config = trainer_config(
        distributed={"nprocPerNode": RANKS},
        training={"microBatchSize": 2, "gradientAccumulationSteps": 2},
        gpu={"required": True},
    )

    with pytest.raises(TrainerError) as raised:
        distributed.init_distributed(TrainerConfig.load(str(config)))
    assert raised.value.code == expected and error in raised.value.reason
