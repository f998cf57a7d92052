"""The loss masks that model families' own chat templates give (their published texts, rendered with the
tiny tokenizer and the families' special tokens): Mistral v0.3/Nemo's system message in the last user turn
only, Phi-3/3.5's EOS after a conversation without a generation prompt, and GLM-4's answers that end with
no token at all."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import DatasetSource
from sftjob_trainer import chat
from sftjob_trainer.chat import answer_end_token, chat_segments
from sftjob_trainer.data import IGNORE_INDEX, DataStats, load_examples, tokenize_row
from sftjob_trainer.tiny import make_tokenizer

pytestmark = pytest.mark.trainer

# Mistral-7B-Instruct-v0.3's (Nemo's and Small-2409's alike), without its tool branches.
MISTRAL_V03 = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501

PHI_3_5 = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

GLM_4 = (
    "[gMASK]<sop>{% for item in messages %}{% if item['content'] %}<|{{ item['role'] }}|>\n"
    "{{ item['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "repeat: abc"},
    {"role": "assistant", "content": "abc"},
    {"role": "user", "content": "repeat: dde"},
    {"role": "assistant", "content": "dde"},
]


def _tokenizer(template: str | None, special: list[str], eos: str | None = None) -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": special} | ({"eos_token": eos} if eos else {}))
    tok.chat_template = template
    return tok


def _trained(tok: Any, messages: list[dict[str, str]], stats: DataStats | None = None) -> str:
    example = tokenize_row({"messages": messages}, "messages", tok, 1000, stats or DataStats())
    assert example is not None
    return str(tok.decode([t for t in example.labels.tolist() if t != IGNORE_INDEX]))


def _render(tok: Any, messages: list[dict[str, str]], prompt: bool) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


def test_mistral_v03_trains_a_row_with_a_system_message_on_its_last_answer_as_inference_prompts_it() -> None:
    tok = _tokenizer(MISTRAL_V03, ["[INST]", "[/INST]"])
    one = [SYSTEM, *TURNS[:2]]
    assert chat_segments(tok, one) == [(_render(tok, one[:2], True), False), (" abc</s>", True)]
    assert _render(tok, one[:2], True) == "<s>[INST] Be brief.\n\nrepeat: abc[/INST]"

    stats = DataStats()
    two = [SYSTEM, *TURNS]
    (prompt, _), (answer, _) = chat_segments(tok, two)
    assert prompt == _render(tok, two[:4], True) and answer == " dde</s>"
    assert _trained(tok, two, stats) == " dde</s>"
    assert (stats.answers, stats.answers_untrained, stats.answers_cut_by_template) == (1, 1, 0)
    # Without a system message every answer trains, as before.
    assert [text for text, trained in chat_segments(tok, TURNS) if trained] == [" abc</s>", " dde</s>"]


def test_phi_3_trains_every_answer_of_a_multi_turn_row_and_stops_at_its_turn_end() -> None:
    tok = _tokenizer(PHI_3_5, ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"], eos="<|endoftext|>")
    segments = chat_segments(tok, TURNS)
    assert "".join(text for text, _ in segments) == _render(tok, TURNS, False)
    assert [text for text, trained in segments if trained] == ["abc<|end|>\n", "dde<|end|>\n<|endoftext|>"]
    stats = DataStats()
    assert _trained(tok, [SYSTEM, *TURNS], stats) == "abc<|end|>\ndde<|end|>\n<|endoftext|>"
    assert (stats.answers, stats.answers_untrained) == (2, 0)
    # The output stops at <|end|>, which ends every answer, not at the EOS that ends a conversation.
    assert answer_end_token(tok) == tok.convert_tokens_to_ids("<|end|>")


def test_a_template_that_ends_answers_with_no_token_is_warned_about_once_naming_what_it_renders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat, "_NOTED", set())
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": TURNS}) + "\n")
    tok = _tokenizer(GLM_4, ["<|user|>", "<|assistant|>", "[gMASK]", "<sop>"])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # the training split, then an evaluation split
            load_examples(DatasetSource(path=str(path)), tok)
    warnings = [
        r.getMessage() for r in caplog.records if "ends answers with no special token" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "'\\nHello', '\\nBye'" in warnings[0]  # what the template renders after each generation prompt
    assert answer_end_token(tok) is None

    caplog.clear()
    for template in (None, PHI_3_5, MISTRAL_V03):  # answers that end with EOS, <|end|>, </s>
        tok = _tokenizer(template, ["<|end|>"])
        with caplog.at_level(logging.WARNING):
            load_examples(DatasetSource(path=str(path)), tok)
    assert "ends answers with no special token" not in caplog.text
