"""Packed rows under eager attention: the model types the trainer trusts give every packed example the
logits it has alone; the others (their masks or positions blind to the examples' boundaries) would let
examples attend to each other, so a packed run of them is a ConfigError, before the data is read."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import ModelSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import attention
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.data import Example
from sftjob_trainer.loop import model_inputs
from sftjob_trainer.model import resolve_attention, resolve_model_class
from sftjob_trainer.tiny import make_tokenizer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

CPU = torch.device("cpu")
VOCABULARY = 128
_LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCABULARY,
    "max_position_embeddings": 128,
}
_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCABULARY, "n_positions": 128}
_WINDOW = {"sliding_window": 4}  # shorter than every example: the window is in play
# A tiny config of each trusted model type (attention.PACKED_EAGER).
TRUSTED: dict[str, dict[str, Any]] = {
    "codegen": _GPT2 | {"rotary_dim": 4},
    "cohere": _LLAMA,
    "cohere2": _LLAMA | _WINDOW,
    "exaone4": _LLAMA | _WINDOW,
    "gemma": _LLAMA | {"head_dim": 8},
    "gemma2": _LLAMA | _WINDOW | {"head_dim": 8},
    "gemma3": {
        "text_config": _LLAMA | _WINDOW | {"head_dim": 8},
        "vision_config": {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        "mm_tokens_per_image": 4,
    },
    "gemma3_text": _LLAMA | _WINDOW | {"head_dim": 8},
    "gpt2": _GPT2,
    "gpt_bigcode": _GPT2,
    "gpt_neo": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "vocab_size": VOCABULARY,
        "max_position_embeddings": 128,
        "attention_types": [[["global", "local"], 1]],
        "window_size": 4,
    },
    "gpt_neox": _LLAMA,
    "gptj": _GPT2 | {"rotary_dim": 4},
    "granite": _LLAMA,
    "granitemoe": _LLAMA | {"num_local_experts": 4, "num_experts_per_tok": 2},
    "llama": _LLAMA,
    "mistral": _LLAMA | _WINDOW,
    "mixtral": _LLAMA | _WINDOW | {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmo": _LLAMA,
    "olmo2": _LLAMA,
    "olmo3": _LLAMA | _WINDOW,
    "phi": _LLAMA,
    "phi3": _LLAMA | _WINDOW | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": _LLAMA | _WINDOW | {"use_sliding_window": True, "max_window_layers": 1},
    "qwen2_moe": _LLAMA
    | {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "qwen3": _LLAMA | {"head_dim": 8},
    "qwen3_moe": _LLAMA
    | {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "stablelm": _LLAMA,
    "starcoder2": _LLAMA | _WINDOW,
}
_FALCON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCABULARY}
_MPT = {"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCABULARY, "max_seq_len": 128}
_BLOOM = {"hidden_size": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCABULARY}
# Model types whose packed examples attend to each other under eager attention.
LEAKY: dict[str, dict[str, Any]] = {
    "falcon": _FALCON,
    "mpt": _MPT,
    "bloom": _BLOOM,
    "xglm": {
        "d_model": 32,
        "num_layers": 2,
        "attention_heads": 4,
        "ffn_dim": 64,
        "vocab_size": VOCABULARY,
        "max_position_embeddings": 128,
    },
    "biogpt": _LLAMA,
    "opt": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "ffn_dim": 64,
        "num_attention_heads": 4,
        "vocab_size": VOCABULARY,
        "max_position_embeddings": 128,
        "word_embed_proj_dim": 32,
    },
    "gpt_oss": _LLAMA | _WINDOW | {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def _config(model_type: str, shape: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **shape)


def _largest_gap(model_type: str, shape: dict[str, Any]) -> float:
    """How far the logits of packed examples under eager attention are from their logits alone: two
    packed rows, padded to one width, as the trainer's eager layout gives them to the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(model_type, shape), attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(0)
    lengths = (13, 9, 7, 11, 5)
    examples = [
        Example(torch.randint(3, VOCABULARY, (n,), generator=generator).tolist(), [1] * n) for n in lengths
    ]
    units = make_units(examples, packing_length=24)
    assert len(units) == 2 and len(units[0].input_ids) != len(units[1].input_ids)  # one row padded
    batch = collate(units, Layout(packing=True, flatten=False, pad_id=0))
    gap = 0.0
    with torch.no_grad():
        packed = model(**model_inputs(batch, CPU), use_cache=False).logits
        for row, unit in enumerate(units):
            start = 0
            for n in unit.lengths:
                ids = torch.tensor([unit.input_ids[start : start + n].tolist()])
                alone = model(input_ids=ids, use_cache=False).logits[0]
                gap = max(gap, float((packed[row, start : start + n] - alone).abs().max()))
                start += n
    return gap


def test_every_trusted_model_type_has_a_tiny_model_here_and_none_of_the_leaky_ones_is_trusted() -> None:
    assert set(TRUSTED) == attention.PACKED_EAGER
    assert not set(LEAKY) & attention.PACKED_EAGER


@pytest.mark.parametrize("model_type", sorted(TRUSTED))
def test_each_trusted_model_type_gives_packed_examples_under_eager_attention_their_logits_alone(
    model_type: str,
) -> None:
    assert _largest_gap(model_type, TRUSTED[model_type]) < 1e-5


@pytest.mark.parametrize("model_type", sorted(LEAKY))
def test_falcon_mpt_bloom_and_the_other_leaky_types_mix_packed_examples_under_eager_attention(
    model_type: str,
) -> None:
    assert _largest_gap(model_type, LEAKY[model_type]) > 1e-3


@pytest.mark.parametrize("model_type", ["falcon", "mpt", "bloom", "gpt_oss"])
def test_a_packed_run_of_a_model_that_always_runs_eager_and_mixes_examples_is_padded_before_the_data(
    model_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(model_type, LEAKY[model_type])
    source = ModelSource(name=f"org/{model_type}")
    with caplog.at_level(logging.WARNING):
        found, packing = resolve_model_class(config, True, source)
    assert not packing and f"packing off: {model_type} (" in caplog.text  # padded: nothing to keep apart
    assert resolve_attention("sdpa", CPU, packing, config, 64, found) in ("sdpa", "eager")
    assert resolve_model_class(config, False, source) == (found, False)


def test_planned_eager_attention_for_packed_rows_is_refused_for_an_untrusted_type_only() -> None:
    with pytest.raises(TrainerError, match="opt \\(OPTForCausalLM\\) is not among"):
        resolve_attention("eager", CPU, True, _config("opt", LEAKY["opt"]), 64)
    assert resolve_attention("eager", CPU, False, _config("opt", LEAKY["opt"]), 64) == "eager"
    assert resolve_attention("eager", CPU, True, _config("gemma2", TRUSTED["gemma2"]), 64) == "eager"


def test_an_untrusted_sliding_window_model_is_refused_once_an_example_outgrows_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "PACKED_EAGER", attention.PACKED_EAGER - {"mistral"})
    mistral = _config("mistral", TRUSTED["mistral"])  # a window of 4 tokens
    assert resolve_attention("sdpa", CPU, True, mistral, 4) == attention.VARLEN  # exact without the window
    with pytest.raises(TrainerError, match="sliding window of 4 tokens"):
        resolve_attention("sdpa", CPU, True, mistral, 5)


def test_a_trusted_model_type_loads_eager_with_a_log_line_that_says_what_keeps_the_examples_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_attention("sdpa", CPU, True, _config("stablelm", TRUSTED["stablelm"]), 64) == "eager"
    assert "StableLmForCausalLM takes no attention function of transformers' registry" in caplog.text
    assert "a block-diagonal mask from their position_ids" in caplog.text


@pytest.fixture(scope="module")
def tiny_falcon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import FalconConfig, FalconForCausalLM

    folder = tmp_path_factory.mktemp("tiny-falcon") / "model"
    tokenizer = make_tokenizer()
    shape = _FALCON | {"vocab_size": len(tokenizer)}
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    FalconForCausalLM(FalconConfig(**shape, **ids)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_trainer_trains_a_packed_falcon_run_on_padded_batches_saying_why(
    trainer_config: MakeConfig, tiny_falcon: Path, caplog: pytest.LogCaptureFixture
) -> None:
    packed = trainer_config(name="packed", model={"path": str(tiny_falcon)}, training={"maxSteps": 1})
    with caplog.at_level(logging.INFO):
        assert run(str(packed)) == ExitCode.OK
    assert "packing off: falcon (FalconForCausalLM)" in caplog.text
    assert "training units (one example each)" in caplog.text  # not packed into rows
    assert Path(json.loads(packed.read_text())["outputDir"]).joinpath("train_log.jsonl").exists()
