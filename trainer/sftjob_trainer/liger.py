"""Liger's fused kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy): applied to a model when the
plan says so, and which of them the model really runs (the log, the throughput benchmark, evaluation)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from sftjob_trainer import remote_code

log = logging.getLogger("sftjob_trainer")


def apply_liger(model: Any, device: torch.device) -> None:
    if remote_code.computes_own_loss(model):  # planned for no remote code: a config from elsewhere
        log.warning(
            "Liger kernels planned but %s is the model's own code, whose loss the trainer computes from the"
            " logits: continuing without them",
            type(model).__name__,
        )
        return
    if device.type != "cuda":
        log.info("Liger kernels planned but this is a CPU run: continuing without them")
        return
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        log.warning("Liger kernels planned but liger_kernel is not importable: continuing without them")
        return
    _apply_liger_kernel_to_instance(model=model)
    applied = liger_kernels_in(model)
    if applied:
        log.info("Liger kernels applied: %s", ", ".join(applied))
    else:
        log.warning("Liger kernels planned but none applied to %s", type(model).__name__)


def liger_kernels_in(model: Any) -> list[str]:
    """The Liger kernels a model really runs: its loss (fused linear cross-entropy: no logits while
    training), RoPE (patched in the modeling module) and the norm/MLP modules it patched."""
    found = ["fused linear cross-entropy"] if _from_liger(getattr(model, "forward", None)) else []
    modeling = sys.modules.get(type(model).__module__)
    if _from_liger(getattr(modeling, "apply_rotary_pos_emb", None)):
        found.append("RoPE")
    patched = {
        m._get_name() if m._get_name().startswith("Liger") else f"Liger {type(m).__name__}"
        for m in model.modules()
        if type(m).__name__.startswith("Liger") or _from_liger(m.__dict__.get("forward"))
    }
    return found + sorted(patched)


def _from_liger(function: Any) -> bool:
    return str(getattr(function, "__module__", "")).startswith("liger_kernel")
