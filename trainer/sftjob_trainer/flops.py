"""Model FLOPs per step and MFU, with the planner's functions from :mod:`sftjob.throughput`.

Weights: 6·N FLOPs per real token for full fine-tuning, 4·N for LoRA/QLoRA (frozen weights get no
weight gradients), N = the matmul weights every token goes through (decoder layers + output head; of a
mixture of experts, the router and the experts it routes the token to, not all of them).
Attention: 12·L·q_dim FLOPs per causal query-key pair (forward 4, backward 8), counted exactly from
the sequence lengths in each batch. Recomputation (gradient checkpointing) is not model FLOPs.
The peak is the card's dense bf16 number from :mod:`sftjob.gpus`, times the number of GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sftjob.architectures import architecture_from_hf_config
from sftjob.config import Method
from sftjob.gpus import profile_for_product
from sftjob.throughput import attention_flops_per_pair, weight_flops_per_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlopsModel:
    per_token: float  # weight FLOPs per real token
    per_attention_pair: float  # attention FLOPs per causal (query, key) pair

    def step_flops(self, tokens: float, attention_pairs: float) -> float:
        return self.per_token * tokens + self.per_attention_pair * attention_pairs


def flops_model(hf_config: dict[str, Any], method: Method, fallback_parameters: int) -> FlopsModel:
    """From the model's config; when it cannot be read as a decoder shape, weights only."""
    try:
        arch = architecture_from_hf_config(hf_config)
    except ValueError as exc:
        log.info("MFU counts weights only (%d parameters): %s", fallback_parameters, exc)
        return FlopsModel(weight_flops_per_token(fallback_parameters, method), 0.0)
    return FlopsModel(weight_flops_per_token(arch.matmul_parameters, method), attention_flops_per_pair(arch))


def peak_flops(device_name: str | None, world_size: int) -> tuple[str, float | None]:
    """(GPU label for metrics, dense bf16 peak FLOP/s of all GPUs); no peak for CPUs or unknown cards."""
    if device_name is None:
        return "cpu", None
    profile = profile_for_product(device_name)
    if profile is None:
        log.info("no GPU profile for %r: MFU is not reported", device_name)
        return device_name.replace(" ", "-"), None
    return profile.key, profile.peak_tflops * 1e12 * world_size


def mfu(flops_per_second: float, peak: float | None) -> float:
    return flops_per_second / peak if peak else 0.0
