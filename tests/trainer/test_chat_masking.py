"""The loss mask of chat rows: every assistant turn is trained on, or only the last one when the chat
template renders earlier turns differently once a later one follows (Qwen3 drops earlier reasoning); the
whole conversation is tokenized as inference tokenizes it, and only chat formats get a template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import DatasetSource
from sftjob_trainer.data import (
    IGNORE_INDEX,
    BadRow,
    DataStats,
    chat_segments,
    ensure_chat_template,
    load_examples,
    tokenize_row,
)
from sftjob_trainer.tiny import make_tokenizer

pytestmark = pytest.mark.trainer

CHAT = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "<think>a</think>1"},
    {"role": "user", "content": "two"},
    {"role": "assistant", "content": "<think>b</think>2"},
]
# Like Qwen3's: an answer followed by another turn loses its <think> block.
DROPS_EARLIER_REASONING = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Like DeepSeek-R1-Distill's: the generation prompt opens a <think> block that rendered answers, their
# reasoning dropped, lack.
THINKS_AT_THE_PROMPT = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
    "{% else %}<|assistant|>{{ m.content.split('</think>')[-1] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok = make_tokenizer()
    ensure_chat_template(tok)
    return tok


def trained(segments: list[tuple[str, bool]]) -> list[str]:
    return [text for text, trainable in segments if trainable]


def test_a_template_that_renders_turn_by_turn_trains_every_answer(tokenizer: Any) -> None:
    segments = chat_segments(tokenizer, CHAT)
    assert len(trained(segments)) == 2
    assert "".join(text for text, _ in segments) == tokenizer.apply_chat_template(CHAT, tokenize=False)


def test_a_template_that_drops_earlier_reasoning_trains_the_last_answer_in_its_real_context(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", DROPS_EARLIER_REASONING)
    segments = chat_segments(tokenizer, CHAT)
    (answer,) = trained(segments)
    assert answer.startswith("<think>b</think>2")
    context = segments[0][0]
    assert "<think>a</think>" not in context and "<|assistant|>1" in context


def test_a_template_that_refuses_the_chat_makes_a_bad_row(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", "{{ raise_exception('no system role') }}")
    with pytest.raises(BadRow, match="rejected"):
        chat_segments(tokenizer, CHAT)


def test_a_generation_prompt_that_opens_reasoning_trains_every_answer_after_the_assistant_header(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", THINKS_AT_THE_PROMPT)
    segments = chat_segments(tokenizer, CHAT)
    assert trained(segments) == ["1</s>", "2</s>"]
    assert "".join(text for text, _ in segments) == tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert segments[0] == ("<s><|user|>one<|assistant|>", False)


def _metaspace_llama_tokenizer() -> Any:
    """A LlamaTokenizer as transformers 5 builds one: Metaspace pre-tokenizer, prepend_scheme "first"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizer

    bpe = Tokenizer(models.BPE(byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    bpe.train_from_iterator(
        ["one two\n1 2", "<|user|>\n<|assistant|>\n"] * 50,
        trainers.BpeTrainer(vocab_size=300, special_tokens=specials),
    )
    model = json.loads(bpe.to_str())["model"]
    tok = LlamaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    ensure_chat_template(tok)
    return tok


def test_answers_are_labelled_on_the_tokens_of_the_whole_conversation_as_inference_tokenizes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tok = _metaspace_llama_tokenizer()
    chat = [{"role": m["role"], "content": m["content"].split(">")[-1]} for m in CHAT]
    example = tokenize_row({"messages": chat}, "messages", tok, 1000, DataStats())
    assert example is not None
    whole = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    assert example.input_ids.tolist() == whole  # not "\u25811": each piece alone gets a "\u2581" first
    answers = [token for token in example.labels.tolist() if token != IGNORE_INDEX]
    assert tok.decode(answers) == "1</s>\n2</s>\n"

    monkeypatch.setattr(type(tok), "is_fast", property(lambda _: False))  # no offsets: prefix fallback
    again = tokenize_row({"messages": chat}, "messages", tok, 1000, DataStats())
    assert again is not None
    assert again.input_ids.tolist() == whole and again.labels.tolist() == example.labels.tolist()


def test_a_text_dataset_leaves_a_tokenizer_without_a_template_without_one(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "one two"}) + "\n")
    tok = make_tokenizer()
    load_examples(DatasetSource(path=str(path)), tok)
    assert tok.chat_template is None  # the saved output carries no template the model never saw
