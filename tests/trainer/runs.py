"""Helpers for the trainer tests: reading a run's per-step losses, starting the trainer as a process or
under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

MakeConfig = Callable[..., Path]

RANKS = 2  # torchrun's processes in the multi-rank tests: a one-node, two-GPU pod
LAUNCH_TIMEOUT_SECONDS = 180
# torchrun, on SIGTERM, gives its ranks 30 s before it kills them: a little longer for it to do so and exit.
TORCHRUN_STOP_SECONDS = 40
# trainer_config overrides for one epoch of 256 rows packed into 128-token rows, checkpointed every 2 steps
# and all kept: a run to kill at a step and resume with another row length.
ONE_PACKED_EPOCH: dict[str, object] = {
    "rows": 256,
    "training": {"maxSteps": None, "epochs": 1.0, "packingLength": 128},
    "checkpoints": {"everySteps": 2, "keep": 20},
}


def train_log(config_path: Path) -> dict[int, float]:
    """Loss per step from the run's train_log.jsonl; a re-run step keeps its latest loss."""
    config = json.loads(config_path.read_text())
    losses: dict[int, float] = {}
    log = Path(config["outputDir"]) / "train_log.jsonl"
    if not log.exists():
        return losses
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run may be cut
            continue
        if "loss" in record:  # not an evaluation's line
            losses[record["step"]] = record["loss"]
    return losses


def killed_at(config_path: Path, step: int) -> dict[str, Any]:
    """The finished run's settings, its checkpoints after `step` removed: as if it had been killed there."""
    from sftjob_trainer.checkpoints import checkpoint_dirs

    settings: dict[str, Any] = json.loads(config_path.read_text())
    for saved, path in checkpoint_dirs(Path(settings["checkpoints"]["dir"])):
        if saved > step:
            shutil.rmtree(path)
    return settings


def start_trainer(config_path: Path, termination_log: Path) -> subprocess.Popen[bytes]:
    """The trainer as its container runs it: a separate process with the config in SFTJOB_CONFIG."""
    env = os.environ | {"SFTJOB_CONFIG": str(config_path), "SFTJOB_TERMINATION_LOG": str(termination_log)}
    out = (config_path.parent / "trainer.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "sftjob_trainer.train"], env=env, stdout=out, stderr=subprocess.STDOUT
    )


def start_torchrun(
    config_path: Path, termination_log: Path, entry: list[str] | None = None, *, launched: bool = False
) -> subprocess.Popen[bytes]:
    """The trainer as a one-node multi-GPU pod runs it, with gloo over loopback instead of NCCL; with
    ``launched``, under the trainer's launcher as the pod's PID 1 (sftjob_trainer.launch, torchrun's
    --tee=2), which the returned process then is."""
    env = os.environ | {
        "SFTJOB_CONFIG": str(config_path),
        "SFTJOB_TERMINATION_LOG": str(termination_log),
        "GLOO_SOCKET_IFNAME": "lo",
        "CUDA_VISIBLE_DEVICES": "",
    }
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    if launched:
        launcher = [sys.executable, "-m", "sftjob_trainer.launch", *launcher, "--tee=2"]
    with (config_path.parent / "trainer.log").open("ab") as out:
        return subprocess.Popen(
            [*launcher, *(entry or ["-m", "sftjob_trainer.train"])],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def torchrun(config_path: Path, termination_log: Path, entry: list[str] | None = None) -> int:
    """Launch and wait; torchrun exits 0 when every rank did, else 1 (each rank's code is in the log)."""
    proc = start_torchrun(config_path, termination_log, entry)
    try:
        return proc.wait(timeout=LAUNCH_TIMEOUT_SECONDS)
    finally:
        stop_torchrun(proc)


def stop_torchrun(proc: subprocess.Popen[Any]) -> None:
    """End a torchrun still running, its ranks too. Each rank runs in a session of its own, so killing
    torchrun would leave them running: a SIGTERM has torchrun stop them (its SIGTERM, then its SIGKILL),
    and only a torchrun that is still there after that is killed."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.communicate(timeout=TORCHRUN_STOP_SECONDS)  # reads its pipes, if any, so it can exit
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def wait_for_step(config_path: Path, proc: subprocess.Popen[bytes], step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while max(train_log(config_path), default=0) < step:
        assert proc.poll() is None, (
            f"trainer exited early with {proc.returncode}: {trainer_output(config_path)}"
        )
        assert time.monotonic() < deadline, f"no step {step} in {timeout}s: {trainer_output(config_path)}"
        time.sleep(0.005)


def trainer_output(config_path: Path) -> str:
    return (config_path.parent / "trainer.log").read_text(errors="replace")[-3000:]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


# For the multi-rank probes: a two-layer model wrapped for the config's sharding (the script defines the
# imports: json, sys, torch, nn, TrainerConfig, init_distributed, wrap_model).
SMALL_SHARDED_MODEL = """
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
"""


def tiny_glm_moe_config(vocab_size: int, **extra: Any) -> Any:
    """A tiny GLM-4 MoE's config: a mixture whose router correction bias is a buffer its weights carry and
    its class keeps in fp32 (``_keep_in_fp32_modules_strict``), which a model built from its config zeroes."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        **extra,
    )
