"""How a chat becomes the text the tokenizer reads, and which of its tokens are the answers.

``data.py`` turns ``messages`` and ``alpaca`` rows into chats; here the tokenizer's chat template (or the
documented fallback) renders each into pieces of prompt and answer, the whole text is tokenized once as
inference tokenizes it, and the answers the template renders without part of their text are found. Rows
render the same on any day (:data:`CHAT_TEMPLATE_DATE`). The output reads the token the template ends an
answer with (:func:`answer_end_token`), the one the saved model stops at; a template that ends answers with
none is warned about (:func:`warn_answers_without_end`).
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
    inference). Text a template ends every conversation with after its last message (Phi-3's EOS when
    no generation prompt follows) is no such difference: the answers before the last train without it.
    A generation prompt may add text the rendered answer lacks (DeepSeek-R1's and QwQ's ``<think>``
    opening): the answer is then trained from where the two part. A template that renders the last
    answer's context differently once the answer follows (Mistral v0.3's and Nemo's put the system
    message into the last user turn only) trains that answer after the prompt inference renders. A chat
    the template cannot render even that way is a bad row.
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
        if _once(tokenizer.chat_template, f"generation prompt {prompt[start:]}"):
            log.info(
                "the chat template's generation prompt ends with %r, which its rendered answers do not"
                " start with: answers are trained from where the two part",
                prompt[start:],
            )
        return start

    def answer_after_context(i: int, prompt: str, full: str) -> str | None:
        """Turn ``i``'s answer as ``full`` renders it after the message before it, from where what
        ``prompt`` renders after that message stops matching: the text that follows ``prompt`` at
        inference. Where that message ends in each is found by rendering it with a mark after its text."""
        if i == 0:
            return None
        before = chat[i - 1]
        marked = [*chat[: i - 1], before | {"content": before["content"] + _MARK}]
        try:
            in_prompt = _shared_length(prompt, render(marked, True))
            in_full = _shared_length(full, render([*marked, chat[i]], False))
        except BadRow:
            return None
        after_prompt, after_full = prompt[in_prompt:], full[in_full:]
        shared = _shared_length(after_prompt, after_full)
        if shared == len(after_full) or (after_prompt and not shared):  # nothing left, or nothing agrees
            return None
        return after_full[shared:]

    turns = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    segments: list[tuple[str, bool]] = []
    done = ""
    for i in turns:
        prompt, full = render(chat[:i], True), render(chat[: i + 1], False)
        if segments and not full.startswith(done):
            end = _conversation_end(tokenizer, done, full, render(chat[:i], False))
            answer = segments[-1][0]
            if end and answer.endswith(end) and len(answer) > len(end):
                segments[-1], done = (answer[: -len(end)], True), done[: -len(end)]
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
    if start is not None:
        return [(full[:start], False), (full[start:], True)]
    after = answer_after_context(last, prompt, full)
    if after is None:
        raise BadRow("the chat template renders the last answer's prompt differently from its answer")
    if _once(tokenizer.chat_template, "context moved"):
        log.info(
            "the chat template renders an answer's context differently once the answer follows it (Mistral"
            " v0.3's and Nemo's put the system message into the last user turn only): such a row's last"
            " answer is trained after the prompt inference renders, its earlier answers are not"
        )
    return [(prompt, False), (after, True)]


# Appended to a message's text to find where the template renders its end (a private-use character).
_MARK = "\ue000"
_NOTED: set[tuple[str, str]] = set()


def _once(template: Any, note: str) -> bool:
    """Whether ``note`` about ``template`` (a string, or a dict of named templates) is new: each is logged
    once a process."""
    key = (repr(template), note)
    if key in _NOTED:
        return False
    _NOTED.add(key)
    return True


def _conversation_end(tokenizer: Any, done: str, full: str, history: str) -> str:
    """What ``done`` (the conversation up to an answer) ends with where ``full`` (the conversation one turn
    on) goes on instead, when it is text the template ends every rendering without a generation prompt
    with (Phi-3's EOS): ``full`` and ``history`` (the conversation before the new answer) end with it
    too. Else ""."""
    end = done[_token_start(tokenizer, done, _shared_length(done, full)) :]
    return end if end and full.endswith(end) and history.endswith(end) else ""


def _token_start(tokenizer: Any, text: str, at: int) -> int:
    """``at``, or the start of the special token ``text`` holds across it (``</s>`` where the next turn's
    ``<|user|>`` shares its ``<``)."""
    for token in _special_tokens(tokenizer):
        start = text.find(token, max(0, at - len(token) + 1), at + len(token) - 1)
        if 0 <= start < at:
            return start
    return at


def _special_tokens(tokenizer: Any) -> set[str]:
    tokens = {str(token) for token in tokenizer.all_special_tokens}
    tokens |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return {token for token in tokens if token}


def _special_ids(tokenizer: Any) -> set[int]:
    special = set(tokenizer.all_special_ids)
    return special | {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


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
_PROBE_TURNS = [*_PROBE_CHAT, {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Bye"}]


def answer_end_token(tokenizer: Any) -> int | None:
    """The special token the chat template ends an answer with (Llama 3's ``<|eot_id|>``, Qwen's
    ``<|im_end|>``, Phi-3's ``<|end|>``, the fallback template's EOS): the one a model trained on chats
    learns to stop at. That of an answer another turn follows, so not the EOS Phi-3's template ends a
    whole conversation with, else the last answer's. None without a template, when it refuses the probe
    chats, or ends answers with no special token (:func:`warn_answers_without_end`)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    return next((end for _, end in _probe_answers(tokenizer) if end is not None), None)


def warn_answers_without_end(tokenizer: Any) -> None:
    """A chat template that ends answers with no special token (GLM-4's and ChatGLM3's: their models stop
    at the next turn's ``<|user|>``, which the template renders as part of the next prompt, never as an
    answer's) fine-tunes a model that is never trained to stop: warned about once, with what it renders."""
    answers = _probe_answers(tokenizer)
    if not answers or any(end is not None for _, end in answers):
        return
    if _once(tokenizer.chat_template, "answers without an end"):
        name = getattr(tokenizer, "name_or_path", "")
        log.warning(
            "the chat template%s ends answers with no special token (it renders those of a probe chat as"
            " %s): no token after an answer carries the loss, so the fine-tuned model is not trained to stop"
            " after one and runs on until it happens to emit a stop token or reaches max_new_tokens, and the"
            " output's generation config gets no stop token from the template (GLM-4's models stop at the"
            " next turn's <|user|>, which the template renders in the next prompt). Use a tokenizer whose"
            " template ends each answer with an end-of-turn token the tokenizer holds as special",
            f" of {name}" if name else "",
            ", ".join(repr(text) for text, _ in answers),
        )


def _probe_answers(tokenizer: Any) -> list[tuple[str, int | None]]:
    """The answers of a two-turn probe chat (one turn when the template refuses two) as trained, each
    with the last special token in it (None: none); none when the template refuses both."""
    special = _special_ids(tokenizer)
    for chat in (_PROBE_TURNS, _PROBE_CHAT):
        try:
            segments = chat_segments(tokenizer, chat)
        except BadRow:
            continue
        ids, pieces = tokenize_pieces(tokenizer, [text for text, _ in segments])
        ends: dict[int, int] = {}
        for token, piece in zip(ids, pieces, strict=True):
            if segments[piece][1] and token in special:
                ends[piece] = token
        return [(text, ends.get(piece)) for piece, (text, answer) in enumerate(segments) if answer]
    return []
