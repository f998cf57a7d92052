"""How a chat becomes the text the tokenizer reads, and which of its tokens are the answers.

``data.py`` turns ``messages`` and ``alpaca`` rows into chats; here the tokenizer's chat template (or the
documented fallback) renders each into pieces of prompt and answer, the whole text is tokenized once as
inference tokenizes it, and the answers the template renders without part of their text are found. Rows
render the same on any day (:data:`CHAT_TEMPLATE_DATE`). The output reads the token the template ends an
answer with (:func:`answer_end_token`), the one the saved model stops at.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from collections.abc import Sequence
from typing import Any

from sftjob_trainer.sources import BadRow

log = logging.getLogger(__name__)

# The day chat templates that print today's date are given (``date_string``, Llama 3.2/3.3's variable, here
# their own fallback), so that every attempt on any day tokenizes the same rows (docs/trainer.md).
CHAT_TEMPLATE_DATE = "26 Jul 2024"
# A message's reasoning, passed to the chat template under the names transformers gives it (Qwen3 reads
# ``reasoning_content``, gpt-oss ``thinking``).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPACE = re.compile(r"\s+")

# Used when the tokenizer has no chat template of its own (documented in docs/trainer.md).
FALLBACK_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        log.info("tokenizer has no chat template: using the documented fallback template")
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE


def warn_clock(template: Any) -> None:
    """A template that reads the clock (``strftime_now``) without taking a ``date_string`` (Llama 3.2/3.3
    take one: :data:`CHAT_TEMPLATE_DATE`) renders the rows differently on another day: warned about."""
    if isinstance(template, str) and "strftime_now" in template and "date_string" not in template:
        log.warning(
            "the chat template prints the current date (strftime_now) and takes no date_string: rows"
            " rendered on another day tokenize differently, so an attempt resumed on another day trains on"
            " other tokens and compares no evaluation loss with the earlier attempts'; give the tokenizer a"
            " template with a fixed date, or a system message in every row if its template prints the date"
            " only without one"
        )


def chat_segments(tokenizer: Any, chat: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """Split the rendered chat into (text, is_assistant) pieces by rendering it turn by turn.

    Some templates render earlier turns differently once a later one follows (Qwen3 drops an earlier
    answer's ``<think>`` block), so a turn's rendering is no prefix of the next: the conversation is
    then the context of its last assistant turn, which alone is trained on (what the model sees at
    inference). A generation prompt may add text the rendered answer lacks (DeepSeek-R1's and QwQ's
    ``<think>`` opening): the answer is then trained from where the two part. A chat the template cannot
    render even that way is a bad row.
    """

    def render(messages: list[dict[str, str]], prompt: bool) -> str:
        try:
            return str(
                tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=prompt, date_string=CHAT_TEMPLATE_DATE
                )
            )
        except Exception as exc:  # jinja raises for chats the template refuses
            raise BadRow(f"the chat template rejected the conversation: {exc}") from exc

    def answer_start(i: int, prompt: str, full: str) -> int | None:
        """Where turn ``i``'s answer starts in ``full``: after the generation prompt, or where the two
        part, but never inside the conversation before it."""
        if full.startswith(prompt):
            return len(prompt)
        start = _shared_length(prompt, full)
        history = render(chat[:i], False)
        if start == len(full) or not (full.startswith(history) and prompt.startswith(history)):
            return None
        _note_generation_prompt(tokenizer.chat_template, prompt[start:])
        return start

    turns = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    segments: list[tuple[str, bool]] = []
    done = ""
    for i in turns:
        prompt, full = render(chat[:i], True), render(chat[: i + 1], False)
        start = answer_start(i, prompt, full) if full.startswith(done) else None
        if start is None or start < len(done):
            break
        segments += [(full[len(done) : start], False), (full[start:], True)]
        done = full
    else:
        return segments
    last = turns[-1]
    prompt, full = render(chat[:last], True), render(chat[: last + 1], False)
    start = answer_start(last, prompt, full)
    if start is None:
        raise BadRow("the chat template renders the last answer's prompt differently from its answer")
    return [(full[:start], False), (full[start:], True)]


_NOTED_PROMPTS: set[tuple[str, str]] = set()


def _note_generation_prompt(template: str, extra: str) -> None:
    if (template, extra) not in _NOTED_PROMPTS:
        _NOTED_PROMPTS.add((template, extra))
        log.info(
            "the chat template's generation prompt ends with %r, which its rendered answers do not start"
            " with: answers are trained from where the two part",
            extra,
        )


def answers_cut_by_template(chat: list[dict[str, str]], segments: list[tuple[str, bool]]) -> list[bool]:
    """For each answer trained on (:func:`chat_segments`' pieces), whether the chat template rendered it
    without part of its message's text: its content or reasoning, spaces aside, not found in the trained
    text (or starting in the generation prompt before it, as a ``<think>`` that prompt opens)."""
    answers = [message for message in chat if message["role"] == "assistant"]
    trained = [
        (segments[i - 1][0] if i else "", text) for i, (text, is_answer) in enumerate(segments) if is_answer
    ]
    if len(trained) < len(answers):  # only the last answer trains (chat_segments)
        answers = answers[-1:]
    return [
        not all(
            _rendered_in(message[name], before, text)
            for name in ("content", *REASONING_FIELDS)
            if name in message
        )
        for message, (before, text) in zip(answers, trained, strict=True)
    ]


def _rendered_in(part: str, before: str, text: str) -> bool:
    """Whether ``part`` lies in ``text``, or starts in ``before`` and ends in ``text``, spaces aside."""
    part, before, text = (_SPACE.sub("", s) for s in (part, before, text))
    return not part or (before + text).find(part, max(0, len(before) - len(part) + 1)) >= 0


def tokenize_pieces(tokenizer: Any, pieces: list[str]) -> tuple[list[int], list[int]]:
    """The tokens of the pieces' whole text, tokenized once as inference tokenizes it, and for each the
    piece its last character lies in.

    Tokenizing each piece alone would differ where a SentencePiece-style tokenizer prepends ``▁`` to each
    or a merge spans a boundary. Fast tokenizers give each token's character span; for others the
    tokens before each boundary are those the text up to it shares with the whole.
    """
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoding["input_ids"], [bisect.bisect_left(ends, end) for _, end in encoding["offset_mapping"]]
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    owners: list[int] = []
    for piece, end in enumerate(ends[:-1]):
        before = tokenizer(text[:end], add_special_tokens=False)["input_ids"]
        owners += [piece] * (_shared_length(before, ids) - len(owners))
    return ids, owners + [len(pieces) - 1] * (len(ids) - len(owners))


def _shared_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


_PROBE_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def answer_end_token(tokenizer: Any) -> int | None:
    """The special token the chat template ends an answer with (Llama 3's ``<|eot_id|>``, Qwen's
    ``<|im_end|>``, the fallback template's EOS): the one a model trained on chats learns to stop at.
    None without a template, when it refuses a one-turn chat, or ends answers with no special token."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        segments = chat_segments(tokenizer, _PROBE_CHAT)
    except BadRow:
        return None
    ids, pieces = tokenize_pieces(tokenizer, [text for text, _ in segments])
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    ends = [
        token for token, piece in zip(ids, pieces, strict=True) if segments[piece][1] and token in special
    ]
    return ends[-1] if ends else None
