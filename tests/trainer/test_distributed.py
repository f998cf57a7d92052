"""Two ranks under torchrun on the CPU (gloo, loopback): DDP and FSDP2 as a multi-GPU pod runs them.

One process with micro-batch x accumulation = the global batch and two ranks with half the
accumulation see the same units in every optimizer step (batching.Schedule), so their per-step losses
and gradient norms differ only by the order of float32 gradient sums (all-reduce vs. accumulation):
about 1e-7 relative here, checked to 1e-4 as in the resume tests. LoRA dropout is off where one process
is compared with two: each rank draws its own dropout masks, one process draws them all in sequence.
FSDP2 (``fully_shard``) runs on the CPU with gloo in torch 2.15, so it is tested the same way.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_OWNER_FILE
from sftjob.failures import ExitCode
from sftjob_trainer.checkpoints import REQUIRED_FILES, TENSORS_DIR, checkpoint_dirs, problem, rng_file
from sftjob_trainer.observer import TRAIN_LOG_FILE
from sftjob_trainer.train import run
from tests.trainer.runs import (
    LAUNCH_TIMEOUT_SECONDS,
    RANKS,
    MakeConfig,
    start_torchrun,
    stop_torchrun,
    torchrun,
    train_log,
    trainer_output,
    wait_for_step,
)

pytestmark = pytest.mark.trainer

STEPS = 6
REL = 1e-4


def _batch(world: int, steps: int = STEPS, sharding: str = "ddp") -> dict[str, Any]:
    """Config overrides for the same global batch of 8 units on one process or ``world`` ranks."""
    return {
        "training": {
            "maxSteps": steps,
            "globalBatchSize": 8,
            "microBatchSize": 2,
            "gradientAccumulationSteps": 4 // world,
        },
        "distributed": {"nprocPerNode": world, "sharding": sharding if world > 1 else "none"},
    }


def _output(config: Path) -> Path:
    return Path(json.loads(config.read_text())["outputDir"])


def _checkpoint_root(config: Path) -> Path:
    return Path(json.loads(config.read_text())["checkpoints"]["dir"])


def _summary(config: Path) -> dict[str, Any]:
    return dict(json.loads((_output(config) / "summary.json").read_text()))


def _grad_norms(config: Path) -> dict[int, float]:
    lines = (_output(config) / TRAIN_LOG_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["gradNorm"] for r in records if "gradNorm" in r}  # not an evaluation's line


def _assert_same_training(got: Path, expected: dict[int, tuple[float, float]], steps: range) -> None:
    """Per-step (loss, gradient norm) of ``got`` match ``expected``; the norm catches a gradient scaled by
    the world size, which AdamW would hide from the losses."""
    losses, norms = train_log(got), _grad_norms(got)
    assert sorted(losses) == sorted(expected), (losses, expected)
    for step in steps:
        assert (losses[step], norms[step]) == pytest.approx(expected[step], rel=REL), step


# A share of the rows held out and evaluated every two steps (spec.evaluation).
HELD_OUT = {"evaluation": {"fraction": 0.1, "everySteps": 2}}


def _training(config: Path) -> dict[int, tuple[float, float]]:
    norms = _grad_norms(config)
    return {step: (loss, norms[step]) for step, loss in train_log(config).items()}


def _assert_same_weights(got: Path, expected: Path) -> None:
    """The saved model is whole (gathered from the shards) and has the one-process weights."""
    from safetensors.torch import load_file

    a, b = load_file(got / "model.safetensors"), load_file(expected / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert tensor.shape == b[name].shape and torch.allclose(tensor, b[name], rtol=0, atol=1e-5), name


def test_two_ddp_ranks_train_with_the_losses_of_one_process_on_the_same_global_batch(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    lora = {"lora": {"dropout": 0.0}}
    one = trainer_config("messages", name="one", **_batch(1), **lora, **HELD_OUT)
    assert run(str(one)) == ExitCode.OK

    two = trainer_config("messages", name="two", **_batch(RANKS), **lora, **HELD_OUT)
    assert torchrun(two, termination_log) == ExitCode.OK, trainer_output(two)
    _assert_same_training(two, _training(one), range(1, STEPS + 1))
    assert _summary(two)["tokens"] == _summary(one)["tokens"]  # counted over both ranks
    # Each rank evaluates its share of the held-out examples; the loss is over all of them.
    assert _summary(two)["evalLoss"] == pytest.approx(_summary(one)["evalLoss"], rel=REL)
    assert termination_log.read_text().startswith(f"completed {STEPS} steps")


def test_two_ranks_write_one_complete_copy_of_each_checkpoint_and_resume_like_an_uninterrupted_run(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    # LoRA with dropout: each rank's RNG state has to come back from its own file for the losses to match.
    config = trainer_config("messages", name="ddp", **_batch(RANKS), checkpoints={"everySteps": 2, "keep": 3})
    assert torchrun(config, termination_log) == ExitCode.OK, trainer_output(config)
    uninterrupted = _training(config)
    assert sorted(uninterrupted) == list(range(1, STEPS + 1))
    train_log_file = _output(config) / TRAIN_LOG_FILE
    assert len(train_log_file.read_text().splitlines()) == STEPS  # rank 0 alone writes it

    root = _checkpoint_root(config)
    # An adapter run saves its last step too. OWNER names the attempt the folder belongs to.
    checkpoint_names = ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in root.iterdir()) == [CHECKPOINT_OWNER_FILE, *checkpoint_names]
    expected_files = {
        *REQUIRED_FILES,
        TENSORS_DIR,
        CHECKPOINT_COMPLETE_MARKER,
        *(rng_file(r) for r in range(RANKS)),
    }
    for _step, path in checkpoint_dirs(root):
        assert problem(path) is None
        assert {p.name for p in path.iterdir()} == expected_files
        # The adapters are replicated: written once, though both ranks save their share.
        assert len(list((path / TENSORS_DIR).glob("*.distcp"))) <= RANKS
    assert [p.name for p in _output(config).glob("*.safetensors")] == ["adapter_model.safetensors"]

    for name in ("checkpoint-6", "checkpoint-4"):  # as if killed between the saves of step 2 and step 4
        shutil.rmtree(root / name)
    assert torchrun(config, termination_log) == ExitCode.OK, trainer_output(config)
    assert _summary(config)["resumedFromStep"] == 2
    assert len(train_log_file.read_text().splitlines()) == STEPS + STEPS - 2
    _assert_same_training(config, uninterrupted, range(3, STEPS + 1))


def test_sigterm_to_the_pods_launcher_stops_both_ranks_after_the_same_step_with_one_checkpoint(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    batch = _batch(RANKS, steps=400)
    # With dataloader workers, as planned: torchrun signals the whole process group, workers included.
    batch["training"]["dataloaderWorkers"] = 2
    config = trainer_config("messages", name="preempted", **batch, checkpoints={"everySteps": 1000})
    proc = start_torchrun(config, termination_log, launched=True)
    try:
        wait_for_step(config, proc, 3)
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends the container's PID 1: it tells torchrun
        proc.wait(timeout=LAUNCH_TIMEOUT_SECONDS)
    finally:
        stop_torchrun(proc)
    log = trainer_output(config)
    # torchrun reports any failed rank as exit code 1; each rank's own code is in the log.
    assert (
        proc.returncode != ExitCode.OK
        and log.count(f"exiting with PREEMPTED ({ExitCode.PREEMPTED:d})") == RANKS
    ), log
    (step, path), *others = checkpoint_dirs(_checkpoint_root(config))
    assert not others and step == max(train_log(config))
    assert problem(path) is None and (path / rng_file(RANKS - 1)).is_file()
    assert termination_log.read_text().startswith(
        f"[exit {ExitCode.PREEMPTED:d}] preempted (SIGTERM): checkpoint saved at step {step}"
    )


# The trainer with a CUDA out-of-memory error on the last rank in its third step.
OOM_ON_LAST_RANK = """
import os
import torch
from sftjob_trainer import train

step, steps = train.train_step, []
def failing_step(*args, **kwargs):
    steps.append(1)
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1 and len(steps) == 3:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return step(*args, **kwargs)
train.train_step = failing_step
train.main()
"""


def test_the_termination_message_names_the_rank_that_ran_out_of_memory_not_its_peers_lost_connection(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config("messages", name="oom", **_batch(RANKS))
    script = config.parent / "oom_on_last_rank.py"
    script.write_text(OOM_ON_LAST_RANK)
    assert torchrun(config, termination_log, [str(script)]) != ExitCode.OK
    log = (config.parent / "trainer.log").read_text(errors="replace")
    assert f"exiting with CUDA_OOM ({ExitCode.CUDA_OOM:d})" in log
    assert f"exiting with COMMUNICATION_ERROR ({ExitCode.COMMUNICATION_ERROR:d})" in log  # rank 0
    assert termination_log.read_text().startswith(f"[exit {ExitCode.CUDA_OOM:d}] CUDA out of memory"), (
        termination_log.read_text()
    )


# The trainer, with each rank appending a line to pretrained-loads-rank<N> whenever it loads the whole model.
RECORD_PRETRAINED_LOADS = """
import os, sys
from transformers import AutoModelForCausalLM
from sftjob_trainer import train

load = AutoModelForCausalLM.from_pretrained
def recorded(*args, **kwargs):
    with open(os.path.join(sys.argv[1], f"pretrained-loads-rank{os.environ['RANK']}"), "a") as fh:
        fh.write("loaded\\n")
    return load(*args, **kwargs)
AutoModelForCausalLM.from_pretrained = recorded
train.main()
"""


def _pretrained_loads(folder: Path) -> list[int]:
    """How many times each rank loaded the whole pretrained model."""
    files = [folder / f"pretrained-loads-rank{rank}" for rank in range(RANKS)]
    return [len(f.read_text().splitlines()) if f.exists() else 0 for f in files]


def test_fsdp2_full_fine_tuning_on_two_ranks_trains_and_resumes_with_the_losses_of_one_process(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    one = trainer_config("messages", name="one", method="full", **_batch(1), **HELD_OUT)
    assert run(str(one)) == ExitCode.OK
    expected = _training(one)

    two = trainer_config("messages", name="fsdp", method="full", **_batch(RANKS, sharding="fsdp"), **HELD_OUT)
    script = two.parent / "record_pretrained_loads.py"
    script.write_text(RECORD_PRETRAINED_LOADS)
    entry = [str(script), str(two.parent)]
    assert torchrun(two, termination_log, entry) == ExitCode.OK, trainer_output(two)
    _assert_same_training(two, expected, range(1, STEPS + 1))
    _assert_same_weights(_output(two), _output(one))
    # Rank 0 alone held the whole model in CPU memory; rank 1 got its shards from rank 0's broadcast.
    assert _pretrained_loads(two.parent) == [1, 0]

    # Again from the checkpoint of step 4: full weights and optimizer state go back into the shards, and
    # no rank reads the pretrained weights the checkpoint replaces.
    assert torchrun(two, termination_log, entry) == ExitCode.OK, trainer_output(two)
    assert _summary(two)["resumedFromStep"] == 4
    _assert_same_training(two, expected, range(5, STEPS + 1))
    _assert_same_weights(_output(two), _output(one))
    assert _pretrained_loads(two.parent) == [1, 0]
    # The shards gather in every evaluation's forward passes: the ranks run as many, short ones included.
    assert _summary(two)["evalLoss"] == pytest.approx(_summary(one)["evalLoss"], rel=REL)
