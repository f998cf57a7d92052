"""FSDP shards a model block by block: the decoder layers whatever the family calls them (Llama's
``model.layers``, GPT-2's, Falcon's and Bloom's ``transformer.h``, MPT's ``transformer.blocks``), a
multimodal model's language and vision layers, under peft's wrapper too; a model that names none is sharded
whole, with a warning. Built on the meta device: no weights, no process group."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from sftjob_trainer import distributed
from sftjob_trainer.distributed import fsdp_blocks

pytestmark = pytest.mark.trainer

_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
SHAPES: dict[str, tuple[dict[str, Any], str]] = {
    "llama": (_LLAMA, "model.layers"),
    "gpt2": ({"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 128}, "transformer.h"),
    "gpt_bigcode": ({"n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": 128}, "transformer.h"),
    "falcon": (
        {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 128},
        "transformer.h",
    ),
    "bloom": ({"hidden_size": 32, "n_layer": 3, "n_head": 4, "vocab_size": 128}, "transformer.h"),
    "mpt": ({"d_model": 32, "n_layers": 3, "n_heads": 4, "vocab_size": 128}, "transformer.blocks"),
}


def _meta_model(model_type: str, **shape: Any) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape))


def _names(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    where = {id(module): name for name, module in model.named_modules()}
    return [where[id(block)] for block in blocks]


@pytest.mark.parametrize("model_type", sorted(SHAPES))
def test_fsdp_shards_each_decoder_layer_whatever_the_family_calls_its_list(model_type: str) -> None:
    shape, layers = SHAPES[model_type]
    model = _meta_model(model_type, **shape)
    assert _names(model, fsdp_blocks(model)) == [f"{layers}.{i}" for i in range(3)]


def test_gemma3_shards_its_language_layers_and_its_vision_blocks_not_only_its_vision_encoder() -> None:
    model = _meta_model(
        "gemma3",
        text_config=_LLAMA | {"head_dim": 8},
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    names = _names(model, fsdp_blocks(model))
    assert [n for n in names if n.startswith("model.language_model.")] == [
        f"model.language_model.layers.{i}" for i in range(3)
    ]
    assert {"model.vision_tower.encoder.layers.0", "model.vision_tower.encoder.layers.1"} <= set(names)
    assert not any(a != b and b.startswith(f"{a}.") for a in names for b in names)  # none inside another


def test_under_peft_the_blocks_are_still_the_decoder_layers() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _meta_model("llama", **_LLAMA), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    names = _names(model, fsdp_blocks(model))
    assert names == [f"base_model.model.model.layers.{i}" for i in range(3)]


def test_fully_shard_takes_every_block_then_the_root_and_warns_for_a_model_without_blocks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed.fsdp as fsdp

    sharded: list[nn.Module] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: sharded.append(module))
    model = _meta_model("gpt2", **SHAPES["gpt2"][0])
    distributed._fully_shard(model, torch.bfloat16, None)
    assert sharded == [*model.transformer.h, model]

    sharded.clear()
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with caplog.at_level(logging.WARNING):
        distributed._fully_shard(plain, torch.bfloat16, None)
    assert sharded == [plain]
    assert "Sequential names no blocks to keep whole" in caplog.text
