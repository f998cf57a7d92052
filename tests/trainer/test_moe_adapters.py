"""LoRA's ``all-linear`` on a mixture of experts wraps the linear layers the planner counts, not the fused
expert tensors and router that peft reaches in transformers 5, and a dense model's adapters are peft's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.architectures import architecture_from_hf_config
from sftjob.config import LoraSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.adapters import add_adapters, linear_layer_names

pytestmark = pytest.mark.trainer

VOCAB = 128
SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ROUTING: dict[str, Any] = {"vocab_size": VOCAB, "num_experts_per_tok": 2}  # 2 of the 4 experts


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**SHAPE, **ROUTING, intermediate_size=96, num_local_experts=4)
    return MixtralForCausalLM(config)


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**SHAPE, **ROUTING, intermediate_size=96, moe_intermediate_size=32, num_experts=4)
    return Qwen3MoeForCausalLM(config)


def _olmoe() -> Any:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(**SHAPE, **ROUTING, intermediate_size=32, num_experts=4, eos_token_id=0)
    return OlmoeForCausalLM(config)


def _llama(folder: Path) -> Any:
    """The tiny Llama every trainer test trains (``sftjob_trainer.tiny.make_tiny_model``)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder)


MIXTURES = [_mixtral, _qwen3_moe, _olmoe]


def _trainable(model: Any) -> dict[str, int]:
    return {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}


def _wrapped_layers(model: Any) -> dict[str, type]:
    """Each module peft put adapters on, with the class of the layer it wraps."""
    from peft.tuners.lora import LoraLayer

    return {
        name.removeprefix("base_model.model."): type(module.get_base_layer())
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


@pytest.mark.parametrize("family", MIXTURES, ids=lambda f: f.__name__.strip("_"))
def test_all_linear_adapts_a_mixtures_linear_layers_as_many_as_the_planner_counts(family: Any) -> None:
    base = family()
    lora = LoraSettings()  # all-linear, dropout 0.05: what peft's own all-linear fails with here
    arch = architecture_from_hf_config(base.config.to_dict())
    model = add_adapters(base, lora, seed=0, revision=None)

    wrapped = _wrapped_layers(model)
    assert wrapped and set(wrapped.values()) == {torch.nn.Linear}
    trainable = _trainable(model)
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert not [name for name in trainable if ".experts." in name or ".mlp.gate." in name]
    assert sum(trainable.values()) == arch.lora_parameters(lora.r, "all-linear")

    ids = torch.randint(0, VOCAB, (2, 16))
    model.train()(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_all_linear_adapts_a_dense_model_as_peft_does(tiny_model: Path) -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraSettings()
    ours = add_adapters(_llama(tiny_model), lora, seed=0, revision=None)
    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules="all-linear"
    )
    peft_own = get_peft_model(_llama(tiny_model), config)

    assert _wrapped_layers(ours) == _wrapped_layers(peft_own)
    assert sum(_trainable(ours).values()) == sum(_trainable(peft_own).values())
    arch = architecture_from_hf_config(ours.config.to_dict())
    assert sum(_trainable(ours).values()) == arch.lora_parameters(lora.r, "all-linear")


def test_a_linear_layer_whose_name_another_module_bears_is_adapted_by_its_path(tiny_model: Path) -> None:
    model = _llama(tiny_model)
    model.model.layers[0].self_attn.o_proj = torch.nn.Identity()

    names = linear_layer_names(model)
    assert "model.layers.1.self_attn.o_proj" in names and "o_proj" not in names
    assert "lm_head" not in names
    wrapped = _wrapped_layers(add_adapters(model, LoraSettings(), seed=0, revision=None))
    assert "model.layers.1.self_attn.o_proj" in wrapped and "model.layers.0.self_attn.o_proj" not in wrapped


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        (_mixtral, ["q_proj", "w1", "w2", "w3"]),
        (_qwen3_moe, ["q_proj", "gate_proj", "up_proj", "down_proj"]),
        (_qwen3_moe, ["q_proj", "gate_proj"]),
        (_olmoe, ["q_proj", "gate"]),
    ],
    ids=["mixtral experts", "qwen3-moe experts", "gate without up", "olmoe router"],
)
def test_target_modules_naming_a_mixtures_experts_or_router_are_a_config_error(
    family: Any, targets: list[str]
) -> None:
    with pytest.raises(TrainerError) as raised:
        add_adapters(family(), LoraSettings(target_modules=targets), seed=0, revision=None)
    assert raised.value.code == ExitCode.CONFIG_ERROR
    assert raised.value.reason.startswith(
        f"spec.lora.targetModules {targets} reaches the experts or the router"
    )
