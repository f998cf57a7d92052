"""Where chat training goes past what the base model knows: answers that end with a turn-end token its
generation config does not stop at (added to the saved one, or named in the log for an adapter), and
examples longer than the positions it was trained for (a warning)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import LoraSettings, TrainingSettings
from sftjob_trainer.chat import ensure_chat_template
from sftjob_trainer.model import check_positions, prepare_for_training
from sftjob_trainer.output import save_output
from sftjob_trainer.tiny import make_tokenizer, tiny_llama

pytestmark = pytest.mark.trainer

# Like Qwen2.5's: an answer ends with <|im_end|> and a newline, not with the base's EOS.
IM_END_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _chat_tokenizer(template: str | None) -> Any:
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = template
    ensure_chat_template(tokenizer)
    return tokenizer


def _tiny_llama(tokenizer: Any) -> Any:
    return tiny_llama(tokenizer, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id)


def _eos(folder: Path) -> Any:
    return json.loads((folder / "generation_config.json").read_text())["eos_token_id"]


def test_a_model_trained_to_end_answers_with_a_turn_end_token_stops_generating_at_it(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    tokenizer = _chat_tokenizer(IM_END_TEMPLATE)
    save_output(_tiny_llama(tokenizer), tokenizer, tmp_path, None, torch.bfloat16)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [tokenizer.eos_token_id, im_end]


def test_answers_ending_with_the_bases_eos_leave_its_generation_config_as_it_was(tmp_path: Path) -> None:
    tokenizer = _chat_tokenizer(None)  # the fallback template ends answers with the EOS token
    save_output(_tiny_llama(tokenizer), tokenizer, tmp_path, None, torch.bfloat16)
    assert _eos(tmp_path) == tokenizer.eos_token_id


def test_an_adapter_whose_answers_end_with_a_turn_end_token_names_it_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokenizer = _chat_tokenizer(IM_END_TEMPLATE)
    model = prepare_for_training(
        _tiny_llama(tokenizer), "lora", LoraSettings(), TrainingSettings(), torch.device("cpu")
    )
    with caplog.at_level(logging.WARNING):
        save_output(model, tokenizer, tmp_path, None, None)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert f"answers end with <|im_end|> (id {im_end}), which the base's generation config" in caplog.text


def test_examples_longer_than_the_bases_positions_warn_unless_its_rope_is_scaled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(max_position_embeddings=64)
    with caplog.at_level(logging.WARNING):
        check_positions(config, 64)
        assert not caplog.text
        check_positions(config, 65)
        assert (
            "longest example has 65 tokens, more than the model's max_position_embeddings=64" in caplog.text
        )
        caplog.clear()
        scaled = LlamaConfig(
            max_position_embeddings=64, rope_parameters={"rope_type": "linear", "factor": 2.0}
        )
        check_positions(scaled, 128)
    assert not caplog.text
