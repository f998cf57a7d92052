"""Preflight's GPU checks run on every rank before it touches its GPU or meets its peers: a missing, faulty
or occupied GPU fails with GPU_UNAVAILABLE naming it (the operator avoids the node), not as the
``set_device``, the communication probe or NCCL's buffers would fail on it (UNKNOWN, COMMUNICATION_ERROR,
CUDA_OOM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError, read_exit_tag
from sftjob_trainer import distributed, preflight, train
from sftjob_trainer.preflight import GIB, DriverInfo, check_first_kernel
from tests.trainer.runs import RANKS, MakeConfig

pytestmark = pytest.mark.trainer


def _never(what: str) -> Any:
    def called(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{what} before the GPU checks failed")

    return called


@pytest.fixture
def last_rank_of_a_gpu_node(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The last of ``RANKS`` ranks on one node whose driver is fine and whose CUDA starts; it must neither
    select its GPU nor join the process group."""
    for name, value in {"WORLD_SIZE": RANKS, "RANK": RANKS - 1, "LOCAL_RANK": RANKS - 1}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(RANKS))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(preflight, "read_driver_info", lambda: DriverInfo("580.95.05", (13, 0)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: RANKS)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA L40S")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (44 * GIB, 45 * GIB))
    monkeypatch.setattr(preflight, "check_first_kernel", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "set_device", _never("set_device"))
    monkeypatch.setattr(distributed.dist, "init_process_group", _never("the rendezvous"))
    return monkeypatch


def _gpu_config(trainer_config: MakeConfig) -> Any:
    return trainer_config(
        distributed={"nprocPerNode": RANKS},
        training={"microBatchSize": 2, "gradientAccumulationSteps": 2},
        gpu={"required": True, "memoryGib": 40.0},
    )


def test_a_rank_whose_gpu_the_node_does_not_show_exits_gpu_unavailable_not_unknown(
    trainer_config: MakeConfig, termination_log: Path, last_rank_of_a_gpu_node: pytest.MonkeyPatch
) -> None:
    last_rank_of_a_gpu_node.setattr(torch.cuda, "device_count", lambda: RANKS - 1)  # one GPU fell off

    assert train.run(str(_gpu_config(trainer_config))) == ExitCode.GPU_UNAVAILABLE
    code, reason = read_exit_tag(termination_log.read_text())
    assert code == ExitCode.GPU_UNAVAILABLE
    assert f"{RANKS - 1} GPU(s) visible, the plan needs {RANKS} on this node" in reason


def test_a_gpu_a_stray_process_holds_fails_its_rank_with_gpu_unavailable_before_any_collective(
    trainer_config: MakeConfig, last_rank_of_a_gpu_node: pytest.MonkeyPatch
) -> None:
    last_rank_of_a_gpu_node.setattr(torch.cuda, "mem_get_info", lambda *args: (3.1 * GIB, 45 * GIB))

    with pytest.raises(TrainerError) as raised:
        distributed.init_distributed(TrainerConfig.load(str(_gpu_config(trainer_config))))
    assert raised.value.code == ExitCode.GPU_UNAVAILABLE
    assert f"GPU {RANKS - 1} (NVIDIA L40S) has 3.1 GiB free" in raised.value.reason


def test_a_gpu_that_fails_its_first_kernel_fails_its_rank_with_that_class_before_the_probe(
    trainer_config: MakeConfig, last_rank_of_a_gpu_node: pytest.MonkeyPatch
) -> None:
    def faulty(*args: object, **kwargs: object) -> None:
        raise torch.AcceleratorError("CUDA error: unspecified launch failure")

    last_rank_of_a_gpu_node.setattr(preflight, "check_first_kernel", check_first_kernel)  # the real one
    last_rank_of_a_gpu_node.setattr(preflight.torch, "ones", faulty)

    with pytest.raises(TrainerError) as raised:
        distributed.init_distributed(TrainerConfig.load(str(_gpu_config(trainer_config))))
    assert raised.value.code == ExitCode.GPU_UNAVAILABLE
    assert f"GPU {RANKS - 1} (NVIDIA L40S) fails its first kernel" in raised.value.reason
