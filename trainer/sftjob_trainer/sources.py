"""Where SFT rows come from: JSON Lines, JSON array and Parquet files, dataset folders, hub datasets.

Which files of a folder hold the split is for :mod:`sftjob_trainer.dataset_folders` to say. Text is
decoded strictly: a JSON Lines line that is not UTF-8 or not JSON comes through as a :class:`BadRow`,
counted with the other malformed rows. A row's location is its file's path in the dataset folder and its
line or row number, from 1.
"""

from __future__ import annotations

import codecs
import importlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.dataset_folders import DATA_SUFFIXES, files_of
from sftjob_trainer.failures import load_failure

log = logging.getLogger(__name__)

_UTF8_BOM = b"\xef\xbb\xbf"
_JSON_CHUNK_BYTES = 1 << 20  # what a JSON array file is read in
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_LOOKAHEAD = 3
_CUT_MARGIN = 16  # characters: a value cut at the window's end fails within them ("-Infinit")


class BadRow(ValueError):
    """A row that cannot be used; the message says why, in words a user can act on."""


def read_rows(source: DatasetSource) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)``; a row that is not even JSON comes through as a :class:`BadRow`."""
    if source.path is not None:
        return _read_path(Path(source.path), source.split)
    return _read_hub(source)


def _read_path(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    return _read_files(files_of(path, split), path if path.is_dir() else path.parent)


def _read_files(files: list[Path], root: Path) -> Iterator[tuple[str, Any]]:
    """The rows of ``files``, each located by its file's path relative to ``root`` (the dataset folder)."""
    for file in files:
        name = file.relative_to(root).as_posix()
        try:
            if DATA_SUFFIXES[file.suffix] == "parquet":
                yield from _read_parquet(file, name)
            elif file.suffix == ".json" and _starts_with(file, b"["):
                yield from _read_json_array(file, name)
            else:
                yield from _read_jsonl(file, name)
        except OSError as exc:
            unreadable = TrainerError(ExitCode.DATA_ERROR, f"dataset file {file} is unreadable: {exc}")
            raise load_failure(exc, f"dataset file {file}") or unreadable from exc  # a failing disk: retried


def _starts_with(file: Path, char: bytes) -> bool:
    with file.open("rb") as fh:
        head = fh.read(4096).removeprefix(_UTF8_BOM).lstrip()
    return head.startswith(char)


def _read_jsonl(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    """JSON Lines, each line decoded as UTF-8 on its own: a line that is not is a bad row, not a
    replacement character in the training text."""
    with file.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{name}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRow(f"not UTF-8 text (byte {exc.start} of the line: {exc.reason})")
                continue
            if number == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, BadRow(f"not valid JSON ({exc.msg})")


def _read_json_array(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    """A ``.json`` file holding one JSON array of rows (the layout of alpaca_data.json), decoded a row at a
    time: ``json.loads`` of the whole file takes 4 to 6 times its size, in every training process."""
    with file.open("rb") as fh:
        for number, row in enumerate(_JsonArray(fh, file).rows(), start=1):
            yield f"{name}[{number}]", row


class _JsonArray:
    """The rows of a JSON array read from a window of the file's text that holds about one row (grown
    while a row is longer than a chunk): what is decoded is dropped, where it ended is counted in lines
    and columns for the error messages."""

    def __init__(self, fh: BinaryIO, file: Path) -> None:
        self.fh, self.file = fh, file
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()
        self.text, self.pos, self.eof, self.bytes_read = "", 0, False, 0
        self.line, self.column = 1, 0  # where text[0] lies in the file: line from 1, columns before it

    def rows(self) -> Iterator[Any]:
        if self._next_char() != "[":
            raise self._broken("Expecting value", self.pos)
        self.pos += 1
        if self._next_char() == "]":
            self.pos += 1
        else:
            while True:
                yield self._value()
                char = self._next_char()
                if char not in (",", "]"):
                    raise self._broken("Expecting ',' delimiter", self.pos)
                self.pos += 1
                if char == "]":
                    break
        if self._next_char():
            raise self._broken("Extra data", self.pos)

    def _value(self) -> Any:
        self._next_char()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                # A row cut by the window's end fails at its end, or as a string left open; an error
                # anywhere else is the file's, and reading on would take the rest of it into memory.
                cut = exc.pos >= len(self.text) - _CUT_MARGIN or exc.msg.startswith("Unterminated string")
                if cut and self._more():  # the row goes on in the next chunk
                    continue
                raise self._broken(exc.msg, exc.pos) from exc
            # A number's end is known once three characters follow it ("1" may be "1.5" or "1e+5").
            if len(self.text) - end >= _NUMBER_LOOKAHEAD or not self._more():
                self.pos = end
                return value

    def _next_char(self) -> str:
        """The next character after whitespace, at ``self.pos``; empty at the end of the file."""
        while True:
            self.pos = self._after_space()
            if self.pos < len(self.text) or not self._more():
                return self.text[self.pos : self.pos + 1]

    def _after_space(self) -> int:
        match = _JSON_SPACE.match(self.text, self.pos)
        assert match is not None  # matches the empty string
        return match.end()

    def _more(self) -> bool:
        """Drop the decoded text and read on; False at the end of the file."""
        if self.eof:
            return False
        raw = self.fh.read(max(_JSON_CHUNK_BYTES, len(self.text) - self.pos))
        self.eof = not raw
        start = self.bytes_read - len(self.utf8.getstate()[0])  # the file's byte decoded first now
        self.bytes_read += len(raw)
        if start == 0 and raw.startswith(_UTF8_BOM):
            raw, start = raw[len(_UTF8_BOM) :], len(_UTF8_BOM)
        try:
            piece = self.utf8.decode(raw, final=self.eof)
        except UnicodeDecodeError as exc:
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"dataset file {self.file} is not UTF-8 text (byte {start + exc.start}: {exc.reason})",
            ) from exc
        done = self.text[: self.pos]
        lines = done.count("\n")
        self.line += lines
        self.column = len(done) - done.rfind("\n") - 1 if lines else self.column + len(done)
        self.text, self.pos = self.text[self.pos :] + piece, 0
        return True

    def _broken(self, reason: str, pos: int) -> TrainerError:
        lines = self.text.count("\n", 0, pos)
        column = pos - self.text.rfind("\n", 0, pos) if lines else self.column + pos + 1
        return TrainerError(
            ExitCode.DATA_ERROR,
            f"dataset file {self.file} starts with '[' but is not a JSON array: {reason} at line"
            f" {self.line + lines} column {column}",
        )


def _read_parquet(file: Path, name: str) -> Iterator[tuple[str, Any]]:
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")

    try:
        batches = pq.ParquetFile(file).iter_batches(batch_size=1024)
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                yield f"{name}:row {number}", row
    except pa.ArrowException as exc:
        raise TrainerError(
            ExitCode.DATA_ERROR, f"dataset file {file} is not readable Parquet: {exc}"
        ) from exc


def _read_hub(source: DatasetSource) -> Iterator[tuple[str, Any]]:
    import datasets

    what = f"hub dataset {source.name} split {source.split}"
    if source.revision:
        what += f" at revision {source.revision}"
    try:
        dataset = datasets.load_dataset(source.name, split=source.split, revision=source.revision)
    except Exception as exc:
        unusable = TrainerError(ExitCode.DATA_ERROR, f"could not load {what}: {exc}")
        raise load_failure(exc, what) or unusable from exc
    for number, row in enumerate(dataset, start=1):  # from 1, like a file's lines and rows
        yield f"{source.name}[{number}]", row
