"""Which trainer config a pod reads: the operator's ``config.json``, or, when it rendered one per
candidate card (``gpu.type: Any`` or a preference list), ``config-<profile>.json`` of the card found.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sftjob.config import TrainerConfig
from sftjob.constants import CONFIG_VARIANT
from sftjob.failures import ExitCode, TrainerError
from sftjob.gpus import profile_for_product

log = logging.getLogger("sftjob_trainer")


def config_for_device(path: str) -> str:
    """The plan for the card this pod landed on: for `gpu.type: Any` or a preference list the operator
    renders ``config-<profile>.json`` per candidate card beside the default ``config.json``."""
    if not torch.cuda.is_available():
        return path
    profile = profile_for_product(torch.cuda.get_device_name())
    if profile is None:
        return path
    variant = Path(path).with_name(CONFIG_VARIANT.format(profile=profile.key))
    if not variant.exists():
        return path
    log.info("using the plan for %s: %s", profile.key, variant)
    return str(variant)


def load_config(path: str) -> TrainerConfig:
    try:
        return TrainerConfig.load(path)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise TrainerError(ExitCode.CONFIG_ERROR, f"cannot load the trainer config {path}: {exc}") from exc
