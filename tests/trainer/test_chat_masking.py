"""The loss mask of chat rows: every assistant turn is trained on, or only the last one when the chat
template renders earlier turns differently once a later one follows (Qwen3 drops earlier reasoning); the
whole conversation is tokenized as inference tokenizes it, and only chat formats get a template. Rows
render the same on any day, a message's reasoning reaches the template, and answers the template renders
without part of their text, and those left untrained, are counted and warned about. A tokenizer with named
chat templates renders with its default one."""

from __future__ import annotations

import json
import logging
from datetime import date, datetime
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import DatasetSource
from sftjob_trainer.chat import CHAT_TEMPLATE_DATE, chat_segments, ensure_chat_template
from sftjob_trainer.data import IGNORE_INDEX, BadRow, DataStats, load_examples, tokenize_row
from sftjob_trainer.evaluation import fingerprint
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


# Like Llama 3.2's and 3.3's: the system header prints today's date unless the caller gives a date_string.
PRINTS_TODAY = (
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}"
    "<|system|>Today Date: {{ date_string }}\n"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Like Qwen3's: the last answer opens with a <think> block holding the message's reasoning_content.
RENDERS_REASONING = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' and loop.last %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n"
    "{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}"
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


def _clock(day: date) -> type[datetime]:
    class Clock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return cls(day.year, day.month, day.day)

    return Clock


def test_a_template_that_prints_todays_date_tokenizes_the_same_rows_on_any_day(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(tokenizer, "chat_template", PRINTS_TODAY)
    renders, examples = [], []
    for day in (date(2025, 1, 31), date(2025, 2, 1)):  # a resume after midnight
        monkeypatch.setattr(chat_template_utils, "datetime", _clock(day))  # what strftime_now reads
        renders.append(tokenizer.apply_chat_template(CHAT, tokenize=False))
        example = tokenize_row({"messages": CHAT}, "messages", tokenizer, 1000, DataStats())
        assert example is not None
        examples.append(example)
    assert renders[0] != renders[1]  # the template does print the day it renders on
    assert fingerprint(examples[:1]) == fingerprint(examples[1:])  # the held-out examples stay the same
    assert f"Today Date: {CHAT_TEMPLATE_DATE}" in tokenizer.decode(examples[0].input_ids.tolist())


def test_a_template_that_prints_the_date_without_taking_one_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    tok = make_tokenizer()
    tok.chat_template = PRINTS_TODAY.replace("date_string", "today")
    with caplog.at_level(logging.WARNING):
        load_examples(DatasetSource(path=str(path)), tok)
    assert "prints the current date (strftime_now) and takes no date_string" in caplog.text
    caplog.clear()
    tok.chat_template = PRINTS_TODAY
    with caplog.at_level(logging.WARNING):
        load_examples(DatasetSource(path=str(path)), tok)
    assert "strftime_now" not in caplog.text


def _answer(tokenizer: Any, row: dict[str, Any]) -> str:
    example = tokenize_row(row, "messages", tokenizer, 1000, DataStats())
    assert example is not None
    return str(tokenizer.decode([t for t in example.labels.tolist() if t != IGNORE_INDEX]))


def test_a_messages_reasoning_content_reaches_the_chat_template_and_is_trained_on(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", RENDERS_REASONING)
    answer = {"role": "assistant", "content": "abc", "reasoning_content": "repeat the words"}
    row = {"messages": [{"role": "user", "content": "repeat: abc"}, answer]}
    assert _answer(tokenizer, row) == "<think>\nrepeat the words\n</think>\n\nabc</s>"  # not an empty one
    parquet_like = {
        "messages": [{"role": "user", "content": "repeat: abc", "reasoning_content": None}, answer]
    }
    assert "repeat the words" in _answer(tokenizer, parquet_like)  # a column's None is no reasoning
    with pytest.raises(BadRow, match="message 1's 'reasoning_content' is not a string"):
        tokenize_row(
            {"messages": [row["messages"][0], answer | {"reasoning_content": 7}]},
            "messages",
            tokenizer,
            1000,
            DataStats(),
        )


@pytest.mark.parametrize(
    ("template", "answer"),
    [
        (THINKS_AT_THE_PROMPT, {"content": "<think>copy it</think>abc"}),  # drops <think> blocks
        (None, {"content": "abc", "reasoning_content": "copy it"}),  # the fallback ignores reasoning
    ],
    ids=["a template that drops think blocks", "a template that ignores reasoning_content"],
)
def test_answers_the_template_renders_without_part_of_their_text_are_counted_and_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, template: str | None, answer: dict[str, str]
) -> None:
    kept = {"messages": [{"role": "user", "content": "repeat: abc"}, {"role": "assistant", "content": "abc"}]}
    cut = {"messages": [kept["messages"][0], {"role": "assistant", **answer}]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [kept, cut, kept, cut, cut]))
    tok = make_tokenizer()
    tok.chat_template = template
    with caplog.at_level(logging.WARNING):
        examples, stats, _ = load_examples(DatasetSource(path=str(path)), tok)
    assert len(examples) == 5 and (stats.answers, stats.answers_cut_by_template) == (5, 3)
    warnings = [
        r.getMessage() for r in caplog.records if "lack part of their message's text" in r.getMessage()
    ]
    assert len(warnings) == 1 and warnings[0].startswith(
        "3 of 5 assistant turns trained on (the first at rows.jsonl:2)"
    )
    assert "rows.jsonl:2" in warnings[0]


def test_answers_the_template_renders_whole_are_not_counted_as_cut(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats = DataStats()
    for template in (None, RENDERS_REASONING, DROPS_EARLIER_REASONING):
        if template is not None:
            monkeypatch.setattr(tokenizer, "chat_template", template)
        tokenize_row({"messages": CHAT}, "messages", tokenizer, 1000, stats)
    # The fallback template trains both answers; the two like Qwen3's the last one, its reasoning kept.
    assert stats.answers_cut_by_template == 0 and stats.answers == 2 + 1 + 1
    assert stats.answers_untrained == 0 + 1 + 1


def test_assistant_turns_left_untrained_are_counted_and_warned_about_once_with_the_first_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    one_turn = {"messages": CHAT[:2]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [one_turn, {"messages": CHAT}] * 2))
    tok = make_tokenizer()
    tok.chat_template = DROPS_EARLIER_REASONING
    with caplog.at_level(logging.WARNING):
        examples, stats, _ = load_examples(DatasetSource(path=str(path)), tok)
    assert len(examples) == 4 and (stats.answers, stats.answers_untrained) == (4, 2)
    warnings = [r.getMessage() for r in caplog.records if "are not trained on" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("2 of 6 assistant turns are not trained on (the first at rows.jsonl:2)")


def test_named_chat_templates_train_as_their_default_one_does(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", THINKS_AT_THE_PROMPT)
    alone = _answer(tokenizer, {"messages": CHAT})
    monkeypatch.setattr(tokenizer, "chat_template", {"default": THINKS_AT_THE_PROMPT, "tool_use": "{{ 1 }}"})
    assert _answer(tokenizer, {"messages": CHAT}) == alone == "1</s>2</s>"
