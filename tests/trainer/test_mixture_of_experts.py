"""A mixture-of-experts model's shape, read from transformers' own configs, holds the parameters the model
class builds (every expert), and its MFU counts the experts each token goes through."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sftjob.architectures import architecture_from_hf_config
from sftjob_trainer.flops import flops_model

pytestmark = pytest.mark.trainer


def _mixtral() -> tuple[Any, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralConfig(), MixtralForCausalLM


def _qwen2_moe() -> tuple[Any, Any]:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeConfig(), Qwen2MoeForCausalLM


@pytest.mark.parametrize(("family", "billions"), [(_mixtral, 46.70), (_qwen2_moe, 14.32)])
def test_a_mixture_of_experts_counts_every_parameter_its_model_class_builds(
    family: Any, billions: float
) -> None:
    config, model_class = family()
    with torch.device("meta"):  # the full-size model, without memory
        model = model_class(config)
    arch = architecture_from_hf_config(config.to_dict())
    assert arch.parameters == sum(p.numel() for p in model.parameters())
    assert round(arch.parameters / 1e9, 2) == billions


def test_mixtral_mfu_counts_the_two_experts_each_token_goes_through() -> None:
    config, _ = _mixtral()
    flops = flops_model(config.to_dict(), "full", fallback_parameters=0)
    h, layers = config.hidden_size, config.num_hidden_layers
    attention = 2 * h * h + 2 * h * (h // 4)  # q and o; k and v over 8 of the 32 heads
    experts = 2 * 3 * h * config.intermediate_size + h * config.num_local_experts  # 2 of 8, and the router
    assert flops.per_token == 6 * (layers * (attention + experts) + config.vocab_size * h)
