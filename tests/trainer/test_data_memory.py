"""Every training process holds the whole tokenized dataset, so it is held as int32 arrays (not Python int
lists, six times larger), never twice over for unpacked examples, and a JSON array file is decoded a row at
a time rather than whole."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sftjob.config import DatasetSource
from sftjob.failures import TrainerError
from sftjob_trainer.batching import make_units, trim_heap
from sftjob_trainer.data import Example, load_examples
from sftjob_trainer.sources import _JSON_CHUNK_BYTES, _JsonArray
from sftjob_trainer.tiny import make_tokenizer, write_dataset

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def _owns_int32(array: np.ndarray) -> bool:
    """An int32 array holding its own tokens: no view keeping a longer (untruncated) buffer alive."""
    return isinstance(array, np.ndarray) and array.dtype == np.int32 and array.base is None


@pytest.mark.parametrize(("fmt", "cut"), [("messages", 45), ("alpaca", 45), ("text", 20)])
def test_examples_hold_their_tokens_in_int32_arrays_of_their_own_also_when_cut(
    tmp_path: Path, tokenizer: Any, fmt: str, cut: int
) -> None:
    source = DatasetSource(path=str(write_dataset(tmp_path / "rows.jsonl", fmt, rows=40)))
    examples, stats, _ = load_examples(source, tokenizer, row_length=cut)
    assert stats.truncated > 0
    assert all(_owns_int32(e.input_ids) and _owns_int32(e.labels) for e in examples)


def test_units_hold_int32_arrays_and_an_unpacked_unit_shares_its_examples() -> None:
    examples = [
        Example(np.arange(5, 5 + n, dtype=np.int32), np.full(n, -100, dtype=np.int32), row=n)
        for n in (9, 7, 4)
    ]
    packed = make_units(examples, 16)
    assert all(_owns_int32(u.input_ids) and _owns_int32(u.labels) for u in packed)
    alone = make_units(examples, None)
    assert all(
        u.input_ids is e.input_ids and u.labels is e.labels for u, e in zip(alone, examples, strict=True)
    )
    trim_heap()  # gives the freed examples' heap back where the C library can; harmless anywhere


def test_a_json_array_file_is_decoded_a_row_at_a_time_not_read_whole() -> None:
    rows = [{"instruction": f"row {i}", "output": "x" * 100} for i in range(3 * _JSON_CHUNK_BYTES // 100)]
    data = io.BytesIO(json.dumps(rows).encode())
    reader = _JsonArray(data, Path("rows.json")).rows()
    assert next(reader) == rows[0]
    assert data.tell() <= _JSON_CHUNK_BYTES < len(data.getvalue()) // 2
    assert [next(reader) for _ in range(len(rows) - 1)] == rows[1:]


def test_a_json_array_file_broken_early_fails_without_reading_the_rest() -> None:
    rows = [{"instruction": f"row {i}", "output": "x" * 100} for i in range(3 * _JSON_CHUNK_BYTES // 100)]
    text = json.dumps(rows).replace('"row 1"', '"row 1" "extra"', 1)  # a syntax error in the second row
    data = io.BytesIO(text.encode())
    with pytest.raises(TrainerError, match="Expecting ',' delimiter at line 1 column 166"):
        list(_JsonArray(data, Path("rows.json")).rows())
    assert data.tell() <= _JSON_CHUNK_BYTES
