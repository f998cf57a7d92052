"""Which trainer config a pod reads: the operator's ``config.json``, or, when it rendered one per
candidate card (several cards fit: ``gpu.type: Any``, a preference list, or a type of several cards such as
the A800's), ``config-<profile>.json`` of the card found;
and loading it, its schema version checked before anything else.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from sftjob.config import SCHEMA_VERSION, TrainerConfig
from sftjob.constants import CONFIG_FILE, CONFIG_PRODUCTS
from sftjob.failures import ExitCode, TrainerError
from sftjob.gpu_products import card_config

log = logging.getLogger("sftjob_trainer")


def config_for_device(path: str) -> str:
    """The plan for the card this pod landed on: for `gpu.type: Any` or a preference list the operator
    renders ``config-<profile>.json`` per candidate card beside the default ``config.json``, and the
    product labels it planned them for in ``products.json``."""
    if not torch.cuda.is_available():
        return path
    folder, name = Path(path).parent, torch.cuda.get_device_name()
    products = folder / CONFIG_PRODUCTS
    planned = json.loads(products.read_text()) if products.exists() else {}
    chosen = card_config([p.name for p in folder.iterdir()], planned, name)
    if chosen is None:
        log.warning(
            "no plan of the job is for this GPU (%s; planned: %s): running the most preferred card's plan."
            " Its node's nvidia.com/gpu.product label or the operator's --gpu-products names another card",
            name,
            ", ".join(sorted(set(planned.values()))) or "see the job's ConfigMap",
        )
        return path
    if chosen == CONFIG_FILE:
        return path
    log.info("using the plan for %s: %s", name, chosen)
    return str(folder / chosen)


def load_config(path: str) -> TrainerConfig:
    """The config at ``path``; CONFIG_ERROR when it is unreadable, invalid, or of another schema version."""
    try:
        raw = json.loads(Path(path).read_text())
        check_schema_version(raw)
        return TrainerConfig.model_validate(raw)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise TrainerError(ExitCode.CONFIG_ERROR, f"cannot load the trainer config {path}: {exc}") from exc


def check_schema_version(raw: Any) -> None:
    """Before any other field: a config of another contract version (an operator upgraded or rolled back
    while spec.image pins a trainer image) would fail on the first field one side does not know."""
    if not isinstance(raw, dict):
        return  # validation says what is wrong with it
    version = raw.get("schemaVersion", raw.get("schema_version", SCHEMA_VERSION))
    if version != SCHEMA_VERSION:
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"the operator wrote trainer config schema {version}, this trainer image reads {SCHEMA_VERSION}:"
            " use the trainer image that matches the operator (spec.image: unset it, or build yours from the"
            " operator's release; without spec.image, the operator's default, the chart's"
            " defaults.trainerImage or the operator's --image, must be of the operator's release)",
        )
