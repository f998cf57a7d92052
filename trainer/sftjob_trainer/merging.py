"""The adapter merged into its base (``spec.output.mergeAdapter``): one standalone model, in a ``merged``
folder beside the adapter, that serves like any other (vLLM, TGI, ``from_pretrained``) without peft.

Rank 0 merges while it writes the output (``output.write_model``), once the adapter is in the output's
temporary folder: it loads the base again on the CPU, in the precision the run computed in (bf16 in every
plan), the adapter onto it from that folder, and folds each ``B @ A`` into its layer's weight (peft's
``merge_and_unload``, which refuses weights made non-finite); output.py writes the merged model as it writes
a fully fine-tuned one. The base is loaded unquantised for QLoRA too:
its adapter was trained against the 4-bit NF4 copy, and merged into the 4-bit weights it would be rounded
back to 4 bits; the full-precision base is what every serving engine loads a QLoRA adapter onto as well.

The host memory this takes, the base in that precision once more, is in the pod's request
(``sftjob.resources.pod_resources``); the GPUs hold the trained model meanwhile and take no part in it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.model import load_model, precision_plan

log = logging.getLogger(__name__)

MERGED_FOLDER = "merged"
# An attention implementation every model class has; what a model serves with is the serving engine's choice.
MERGE_ATTENTION = "eager"


def merge_dtype(config: TrainerConfig) -> torch.dtype:
    """The precision the merged model is written in: the one the adapter's base computed in."""
    return precision_plan(config.method, config.training.precision).compute_dtype


def merged_model(config: TrainerConfig, adapter: Path) -> Any:
    """The base, loaded on the CPU in :func:`merge_dtype` and not quantised, with the adapter saved in
    ``adapter`` merged into its weights."""
    from peft import PeftModel

    unquantised = config.model_copy(update={"method": "lora"})  # QLoRA's base in the compute dtype
    base = load_model(unquantised, torch.device("cpu"), MERGE_ATTENTION)
    log.info("merging the adapter into %s (%s, on the CPU)", type(base).__name__, merge_dtype(config))
    try:
        return PeftModel.from_pretrained(base, adapter).merge_and_unload(safe_merge=True)
    except ValueError as exc:  # safe_merge: a merged weight is not finite
        raise TrainerError(
            ExitCode.DIVERGED, f"the adapter could not be merged into its base: {exc}"
        ) from exc
