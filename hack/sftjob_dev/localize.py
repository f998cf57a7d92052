"""Turning what the operator injected into a trainer pod into a local CPU run of the same trainer.

The local trainer runner (``sftjob_dev.runner``) plays the container runtime for pods of the fake
cluster; these pure functions decide what that run gets: the operator's own ``TrainerConfig`` with the
in-pod folders (``/checkpoints``, ``/output``, ``/model``, ``/data``) mapped to local ones, GPU checks
off, a free metrics port, no dataloader workers and one process instead of torchrun's several; and
the pod's environment with the same folders mapped. The runner does the I/O around them.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sftjob import constants as c
from sftjob.config import DistributedSettings, TrainerConfig
from sftjob.gpu_products import card_config

# Set by the runner itself (or meaningless outside a pod): never copied from the pod spec.
# The runner sets these itself; HOME and the Triton cache stay the developer's on a local run.
RUNNER_ENV = frozenset(
    {c.CONFIG_ENV, "POD_NAME", "POD_NAMESPACE", "NODE_NAME", "KUBECONFIG", "HOME", "TRITON_CACHE_DIR"}
)


def localize_path(path: str, mounts: Mapping[str, Path]) -> str:
    """``/checkpoints/final`` -> ``<local checkpoints>/final`` for the first mount that holds it."""
    for mount, local in mounts.items():
        if path == mount:
            return str(local)
        if path.startswith(mount.rstrip("/") + "/"):
            return str(local / posixpath.relpath(path, mount))
    return path


def config_key(data: Mapping[str, str], product: str | None) -> str:
    """The ConfigMap key the trainer on a node with GPU ``product`` reads (``card_config``): its card's
    plan, if the operator rendered one per candidate card, else ``config.json``."""
    planned = json.loads(data[c.CONFIG_PRODUCTS]) if c.CONFIG_PRODUCTS in data else {}
    return card_config(list(data), planned, product) or c.CONFIG_FILE


def local_config(
    config: TrainerConfig, mounts: Mapping[str, Path], metrics_port: int | None
) -> tuple[TrainerConfig, list[str]]:
    """The operator's config for a CPU run on this machine, and one note per change worth logging."""
    notes = [f"{mount} -> {local}" for mount, local in mounts.items()]
    tensorboard = config.tracking.tensorboard_dir
    if tensorboard is not None:
        tensorboard = localize_path(tensorboard, mounts)
    update: dict[str, Any] = {
        "checkpoints": config.checkpoints.model_copy(
            update={"dir": localize_path(config.checkpoints.dir, mounts)}
        ),
        "output_dir": localize_path(config.output_dir, mounts),
        "gpu": config.gpu.model_copy(update={"required": False}),
        "tracking": config.tracking.model_copy(update={"tensorboard_dir": tensorboard}),
        "report": config.report.model_copy(update={"metrics_port": metrics_port}),
    }
    notes.append("gpu.required false: a CPU run, the trainer skips its GPU checks")
    if config.model.path is not None:
        update["model"] = config.model.model_copy(update={"path": localize_path(config.model.path, mounts)})
    if config.dataset.path is not None:
        update["dataset"] = config.dataset.model_copy(
            update={"path": localize_path(config.dataset.path, mounts)}
        )
    # Data loads in the trainer's own process: workers only cost a small shared machine time and memory.
    training: dict[str, Any] = {"dataloader_workers": 0}
    notes.append(f"dataloader workers {config.training.dataloader_workers} -> 0")
    world = config.distributed.world_size
    if world > 1:
        # One process does the work of `world` ranks: the same global batch, more accumulation.
        training["gradient_accumulation_steps"] = config.training.gradient_accumulation_steps * world
        update["distributed"] = DistributedSettings()
        notes.append(f"{world} ranks run as one process: gradient accumulation x{world}")
    update["training"] = config.training.model_copy(update=training)
    return TrainerConfig.model_validate(config.model_dump() | update), notes


def pod_env(pod: Mapping[str, Any], container: str, mounts: Mapping[str, Path]) -> dict[str, str]:
    """The plain ``value`` environment of the pod's trainer container, with in-pod folders mapped.
    ``valueFrom`` entries (the downward API, secrets) are skipped: the runner sets what it can."""
    spec = pod.get("spec") or {}
    found = next((x for x in spec.get("containers") or [] if x.get("name") == container), None)
    env: dict[str, str] = {}
    for var in (found or {}).get("env") or []:
        if var.get("name") in RUNNER_ENV or "value" not in var:
            continue
        value = str(var["value"])
        env[var["name"]] = localize_path(value, mounts) if value.startswith("/") else value
    return env
