"""The trained model as users take it away: a fully fine-tuned model in the precision it trained in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sftjob_trainer.model import save_output
from sftjob_trainer.tiny import make_tokenizer

pytestmark = pytest.mark.trainer


def test_a_full_fine_tune_is_written_in_bf16_with_a_config_that_says_so_and_its_head_still_tied(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)  # fp32 master weights, as full fine-tuning keeps them
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}

    save_output(model, tokenizer, str(tmp_path), None, torch.bfloat16)

    files = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in files.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the live model is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name].to(torch.bfloat16)), name
