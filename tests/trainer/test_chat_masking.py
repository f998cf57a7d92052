"""The loss mask of chat rows: every assistant turn is trained on, or only the last one when the chat
template renders earlier turns differently once a later one follows (Qwen3 drops earlier reasoning)."""

from __future__ import annotations

from typing import Any

import pytest

from sftjob_trainer.data import BadRow, chat_segments, ensure_chat_template
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
