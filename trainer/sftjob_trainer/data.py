"""Turning SFT rows (read by ``sources.py``) into token ids with loss masks, and counting what is lost.

Three row formats: ``messages`` (a chat rendered with the tokenizer's chat template by ``chat.py``),
``alpaca`` (instruction / input / output, rendered as a one-turn chat) and ``text`` (plain language
modelling).
For chats the loss covers only the assistant turns, and the turns left untrained are counted. A
malformed row (also one that raises an error no check foresaw while it is tokenized: the first one's
traceback is logged) is counted and skipped with a log line naming where it is; more than
``dataset.max_bad_row_fraction`` of them, or no usable row at all, fails with DataError.
Examples are cut to the longest sequence training takes (``dataset.max_seq_length``, or the packed-row
length when shorter); one left without any target token is dropped, and past the fractions below the run
warns, then fails with DataError, rather than train on what is left.
Every process holds the whole tokenized dataset: an example's tokens are int32 arrays, 8 bytes a token
with its labels, where Python lists of the ints a tokenizer returns take about 50.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.chat import (
    REASONING_FIELDS,
    answers_cut_by_template,
    chat_segments,
    ensure_chat_template,
    tokenize_pieces,
    warn_answers_without_end,
    warn_clock,
)
from sftjob_trainer.sources import BadRow, read_rows

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROLES = frozenset({"system", "user", "assistant"})
_SHOWN_BAD_ROWS = 10
_DETECT_ROWS = 20
# Examples cut to the sequence length: past the first fraction a warning, past the second (of examples
# left without any target token) DataError. Documented in docs/trainer.md.
CUT_WARN_FRACTION = 0.01
WITHOUT_TARGET_FAIL_FRACTION = 0.5


@dataclass(frozen=True, eq=False, slots=True)
class Example:
    """One tokenized sample, its tokens in int32 arrays: ``labels`` is ``IGNORE_INDEX`` where no loss is
    taken; ``row`` is the number of the dataset row it came from (from 0, malformed rows counted)."""

    input_ids: np.ndarray
    labels: np.ndarray
    row: int = 0


@dataclass
class DataStats:
    rows: int = 0
    bad_rows: int = 0
    truncated: int = 0
    without_target: int = 0
    bad_examples: list[str] = field(default_factory=list)
    answers: int = 0  # assistant turns trained on
    answers_cut_by_template: int = 0  # of them, those the chat template renders without part of their text
    first_cut_by_template: str = ""  # where the first of them is
    answers_untrained: int = 0  # assistant turns not trained on: only their row's last answer is
    first_untrained: str = ""  # where the first of them is

    def bad(self, where: str, reason: str) -> None:
        self.bad_rows += 1
        if self.bad_rows <= _SHOWN_BAD_ROWS:
            log.warning("skipping malformed row %s: %s", where, reason)
            self.bad_examples.append(f"{where}: {reason}")


def load_examples(
    source: DatasetSource, tokenizer: Any, row_length: int | None = None
) -> tuple[list[Example], DataStats, str]:
    """Read, validate and tokenize the whole dataset; returns examples, counts and the format used.

    Examples are cut to ``dataset.max_seq_length`` or, when packing into shorter rows, to ``row_length``.
    """
    rows = read_rows(source)
    head: list[tuple[str, Any]] = []
    for item in rows:
        head.append(item)
        if len(head) >= _DETECT_ROWS:
            break
    if not head:
        raise TrainerError(ExitCode.DATA_ERROR, f"dataset {_where(source)} is empty")
    if source.format == "auto":
        _check_any_object(source, head)
    fmt = source.format if source.format != "auto" else detect_format([r for _, r in head])
    if fmt != "text":
        ensure_chat_template(tokenizer)
        warn_clock(tokenizer.chat_template)
        warn_answers_without_end(tokenizer)
    limit = min(source.max_seq_length, row_length or source.max_seq_length)
    stats = DataStats()
    examples: list[Example] = []
    traced = False
    for where, row in _chain(head, rows):
        stats.rows += 1
        cut_before, untrained_before = stats.answers_cut_by_template, stats.answers_untrained
        try:
            example = tokenize_row(row, fmt, tokenizer, limit, stats)
        except BadRow as exc:
            stats.bad(where, str(exc))
            continue
        except (MemoryError, TrainerError):
            raise
        except Exception as exc:  # a row no check foresaw: located, counted and skipped like a malformed one
            if not traced:  # the traceback once, should it be a bug of the trainer's
                log.warning(
                    "row %s raised %s, which no check for malformed rows foresaw: skipped like one",
                    where,
                    type(exc).__name__,
                    exc_info=True,
                )
                traced = True
            stats.bad(where, f"unexpected {type(exc).__name__}: {exc}")
            continue
        if stats.answers_cut_by_template > cut_before and not stats.first_cut_by_template:
            stats.first_cut_by_template = where
        if stats.answers_untrained > untrained_before and not stats.first_untrained:
            stats.first_untrained = where
        if example is not None:
            examples.append(replace(example, row=stats.rows - 1))
    _check_quality(source, stats, limit, len(examples))
    _warn_cut_by_template(stats)
    _warn_untrained(stats)
    log.info(
        "data: %d rows (%s format), %d malformed skipped, %d truncated to %d tokens, %d without a target"
        " after truncation, %d examples",
        stats.rows,
        fmt,
        stats.bad_rows,
        stats.truncated,
        limit,
        stats.without_target,
        len(examples),
    )
    return examples, stats, fmt


def _check_quality(source: DatasetSource, stats: DataStats, limit: int, usable: int) -> None:
    fraction = stats.bad_rows / stats.rows
    if fraction > source.max_bad_row_fraction:
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"{stats.bad_rows} of {stats.rows} rows ({fraction:.1%}) in {_where(source)} are malformed,"
            f" more than dataset.maxBadRowFraction={source.max_bad_row_fraction};"
            f" first: {stats.bad_examples[0]}",
        )
    if usable + stats.without_target > 0:
        _check_cuts(source, stats, limit, usable + stats.without_target)
    if usable == 0:
        raise TrainerError(ExitCode.DATA_ERROR, f"dataset {_where(source)} has no usable rows")


def _check_cuts(source: DatasetSource, stats: DataStats, limit: int, examples: int) -> None:
    """Examples cut to ``limit`` train on a cut answer, or are dropped when no target token is left:
    warn past :data:`CUT_WARN_FRACTION` of them, fail past :data:`WITHOUT_TARGET_FAIL_FRACTION` dropped."""
    bound, advice = f"dataset.maxSeqLength={source.max_seq_length}", "raise dataset.maxSeqLength"
    if limit < source.max_seq_length:
        bound += f"; packed rows of {limit} tokens from training.packingLength or an OOM re-plan"
        advice = "raise training.packingLength (or give the GPU more memory)"
    cut, dropped = stats.truncated / examples, stats.without_target / examples
    if dropped > WITHOUT_TARGET_FAIL_FRACTION:
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"{stats.without_target} of {examples} examples ({dropped:.1%}) in {_where(source)} have no"
            f" target token left once cut to {limit} tokens ({bound}), more than"
            f" {WITHOUT_TARGET_FAIL_FRACTION:.0%}: {advice} or shorten the prompts",
        )
    if max(cut, dropped) > CUT_WARN_FRACTION:
        log.warning(
            "%d of %d examples (%.1f%%) are longer than %d tokens (%s) and cut there: %d (%.1f%%) are left"
            " without a target token and dropped, the others train on a cut answer",
            stats.truncated,
            examples,
            cut * 100,
            limit,
            bound,
            stats.without_target,
            dropped * 100,
        )


def _warn_cut_by_template(stats: DataStats) -> None:
    """One warning for the answers the chat template rendered without part of their message's text (a
    template that drops ``<think>`` blocks, one that ignores ``reasoning_content``): the model learns the
    answers without it."""
    if stats.answers_cut_by_template:
        log.warning(
            "%d of %d assistant turns trained on (the first at %s) lack part of their message's text"
            " (content or reasoning) once the chat template renders them: the template drops it (reasoning in"
            " <think> blocks, a reasoning_content field it does not render) and the model learns the answers"
            " without it. To train on the reasoning, put it in the field the template renders (Qwen3's keeps"
            " reasoning_content and <think> blocks in content) or use a tokenizer whose template renders it",
            stats.answers_cut_by_template,
            stats.answers,
            stats.first_cut_by_template,
        )


def _warn_untrained(stats: DataStats) -> None:
    """One warning for the assistant turns left untrained: a chat template that renders an earlier turn
    differently once a later one follows (Qwen3 drops earlier reasoning, Mistral v0.3 moves the system
    message into the last user turn) trains only each row's last answer, in the context inference gives it."""
    if stats.answers_untrained:
        log.warning(
            "%d of %d assistant turns are not trained on (the first at %s): the chat template renders an"
            " earlier turn differently once a later one follows (Qwen3 drops earlier reasoning, Mistral v0.3"
            " moves the system message into the last user turn), so only each such row's last answer is"
            " trained, in the context the model sees at inference. To train every turn, split multi-turn"
            " rows into one row per answer",
            stats.answers_untrained,
            stats.answers + stats.answers_untrained,
            stats.first_untrained,
        )


def _check_any_object(source: DatasetSource, head: list[tuple[str, Any]]) -> None:
    """``format: auto`` needs an object among the first rows: when none is (a pretty-printed JSON object or
    array read as JSON Lines), the first row's location and what is wrong with it say why."""
    if any(isinstance(row, dict) for _, row in head):
        return
    where, row = head[0]
    reason = str(row) if isinstance(row, BadRow) else f"expected an object, got {type(row).__name__}"
    raise TrainerError(
        ExitCode.DATA_ERROR,
        f"cannot detect the dataset format: none of the first {len(head)} rows of {_where(source)} is a JSON"
        f" object (first: {where}: {reason}); a .jsonl file holds one JSON object per line, a .json file"
        " JSON Lines or one JSON array of objects",
    )


def _where(source: DatasetSource) -> str:
    return source.path or f"{source.name} (split {source.split})"


def _chain(head: list[tuple[str, Any]], rest: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    yield from head
    yield from rest


# --- formats -------------------------------------------------------------------------------------


def detect_format(rows: Iterable[Any]) -> str:
    keys: set[str] = set()
    for row in rows:
        if not isinstance(row, dict):
            continue
        keys = set(row)
        if "messages" in keys:
            return "messages"
        if {"instruction", "output"} <= keys:
            return "alpaca"
        if "text" in keys:
            return "text"
    raise TrainerError(
        ExitCode.DATA_ERROR,
        f"cannot detect the dataset format from the first rows (keys {sorted(keys)}); expected 'messages',"
        " 'instruction'+'output' or 'text', or set dataset.format",
    )


def row_messages(row: Any, fmt: str) -> list[dict[str, str]]:
    """The chat a ``messages`` or ``alpaca`` row stands for, validated: each message's role and content,
    and its reasoning when it has any (:data:`REASONING_FIELDS`, passed on to the chat template)."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object, got {type(row).__name__}")
    if fmt == "alpaca":
        instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
        if not isinstance(instruction, str) or not instruction.strip():
            raise BadRow("'instruction' is missing or empty")
        if not isinstance(output, str) or not output.strip():
            raise BadRow("'output' is missing or empty")
        if not isinstance(extra, str):
            raise BadRow("'input' is not a string")
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRow("'messages' is missing or not a non-empty list")
    chat = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES or not isinstance(m.get("content"), str):
            raise BadRow(f"message {i} needs a role in {sorted(ROLES)} and a string content")
        message = {"role": m["role"], "content": m["content"]}
        for name in REASONING_FIELDS:  # None: a Parquet column of messages that have none
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise BadRow(f"message {i}'s {name!r} is not a string")
                message[name] = m[name]
        chat.append(message)
    if not any(m["role"] == "assistant" and m["content"].strip() for m in chat):
        raise BadRow("no non-empty assistant message to learn from")
    return chat


def tokenize_row(row: Any, fmt: str, tokenizer: Any, max_len: int, stats: DataStats) -> Example | None:
    if fmt == "text":
        tokens = _text_ids(row, tokenizer)
        trained = np.ones(len(tokens), dtype=bool)
    else:
        chat = row_messages(row, fmt)
        segments = chat_segments(tokenizer, chat)
        cut = answers_cut_by_template(chat, segments)
        stats.answers += len(cut)
        stats.answers_untrained += sum(m["role"] == "assistant" for m in chat) - len(cut)
        stats.answers_cut_by_template += sum(cut)
        tokens, pieces = tokenize_pieces(tokenizer, [text for text, _ in segments])
        answers = np.array([is_answer for _, is_answer in segments], dtype=bool)
        trained = answers[np.array(pieces, dtype=np.intp)]
    if len(tokens) > max_len:
        stats.truncated += 1
        tokens, trained = tokens[:max_len], trained[:max_len]
    ids = np.array(tokens, dtype=np.int32)
    labels = np.where(trained, ids, np.int32(IGNORE_INDEX))
    labels[0] = IGNORE_INDEX  # nothing predicts a sequence's first token, also when packed after another
    if not (labels != IGNORE_INDEX).any():
        stats.without_target += 1
        return None
    return Example(ids, labels)


def _text_ids(row: Any, tokenizer: Any) -> list[int]:
    if isinstance(row, BadRow):
        raise row
    text = row.get("text") if isinstance(row, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise BadRow("'text' is missing or empty")
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
