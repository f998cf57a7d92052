"""Where rows come from: a hub dataset at its pinned revision, the split's files of a dataset folder (found
as the datasets library finds them), JSON array files, strict UTF-8, where a bad row is, and the fallback
chat template starting with BOS like the ``text`` format, and that a row which is malformed in a way no
check foresaw is skipped like any other malformed row."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import data, sources
from sftjob_trainer.data import load_examples
from sftjob_trainer.sources import BadRow, read_rows
from sftjob_trainer.tiny import format_row, make_tokenizer

pytestmark = pytest.mark.trainer

ROW = format_row("repeat: abc", "abc", "alpaca")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def _write(path: Path, rows: int, tag: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(ROW | {"input": tag}) + "\n" for _ in range(rows)))


def _tags(source: DatasetSource) -> list[str]:
    return [row["input"] for _, row in read_rows(source)]


def test_a_hub_snapshot_folder_reads_only_the_files_of_the_requested_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "data" / "train-00000-of-00002.jsonl", 2, "train")
    _write(tmp_path / "data" / "train-00001-of-00002.jsonl", 1, "train")
    _write(tmp_path / "data" / "test-00000-of-00001-a3ec.jsonl", 5, "test")
    with caplog.at_level(logging.INFO):
        assert _tags(DatasetSource(path=str(tmp_path))) == ["train"] * 3
    assert "data/train-00000-of-00002.jsonl, data/train-00001-of-00002.jsonl" in caplog.text
    assert _tags(DatasetSource(path=str(tmp_path), split="test")) == ["test"] * 5


def test_split_names_in_folder_names_come_before_those_in_file_names(tmp_path: Path) -> None:
    _write(tmp_path / "train" / "part-0.jsonl", 2, "train")
    _write(tmp_path / "validation" / "part-0.json", 7, "validation")
    _write(tmp_path / "test-notes.jsonl", 1, "notes")  # no split: a folder name carries one
    assert _tags(DatasetSource(path=str(tmp_path), split="validation")) == ["validation"] * 7
    assert _tags(DatasetSource(path=str(tmp_path))) == ["train"] * 2
    with pytest.raises(TrainerError, match=r"none is split 'test' \(dataset.split\)"):
        _tags(DatasetSource(path=str(tmp_path), split="test"))


def test_a_snapshot_with_sharded_split_files_reads_the_split_of_that_exact_name_only(tmp_path: Path) -> None:
    for split, rows in (("train_sft", 3), ("train_gen", 2), ("test_sft", 1), ("test_gen", 1)):
        _write(tmp_path / "data" / f"{split}-00000-of-00001-a3ecf927.jsonl", rows, split)
    assert _tags(DatasetSource(path=str(tmp_path), split="train_sft")) == ["train_sft"] * 3
    with pytest.raises(TrainerError, match=r"none is split 'train' \(dataset.split\)") as raised:
        _tags(DatasetSource(path=str(tmp_path), split="train"))
    assert raised.value.code == ExitCode.DATA_ERROR
    for split in ("train_sft", "train_gen", "test_sft", "test_gen"):
        assert f"{split} (data/{split}-00000-of-00001-a3ecf927.jsonl)" in str(raised.value)


def test_hidden_files_folders_starting_with_two_underscores_and_dataset_metadata_are_not_read(
    tmp_path: Path,
) -> None:
    _write(tmp_path / "part-0.jsonl", 2, "data")
    _write(tmp_path / ".ipynb_checkpoints" / "part-0-checkpoint.jsonl", 1, "checkpoint")
    _write(tmp_path / "__MACOSX" / "part-0.jsonl", 1, "resource fork")
    _write(tmp_path / "._part-0.jsonl", 1, "resource fork")
    _write(tmp_path / "dataset_info.json", 1, "metadata")
    assert _tags(DatasetSource(path=str(tmp_path))) == ["data"] * 2
    _write(tmp_path / "train.jsonl", 1, "train")
    _write(tmp_path / ".cache" / "test.jsonl", 1, "cached")  # hidden: neither read nor a split's file
    assert _tags(DatasetSource(path=str(tmp_path))) == ["train"]


def test_a_folder_whose_files_name_no_split_is_read_whole(tmp_path: Path) -> None:
    _write(tmp_path / "part-0.jsonl", 2, "a")
    _write(tmp_path / "latest" / "part-1.jsonl", 1, "b")  # "test" inside a word is no split name
    assert sorted(_tags(DatasetSource(path=str(tmp_path), split="train"))) == ["a", "a", "b"]


def test_a_folder_with_split_files_but_none_for_the_split_fails_naming_dataset_split_and_its_splits(
    tmp_path: Path,
) -> None:
    _write(tmp_path / "train.jsonl", 1, "train")
    _write(tmp_path / "test.jsonl", 1, "test")
    with pytest.raises(TrainerError, match=r"dataset\.split") as raised:
        _tags(DatasetSource(path=str(tmp_path), split="validation"))
    assert raised.value.code == ExitCode.DATA_ERROR
    assert str(raised.value).endswith("the splits it has: train (train.jsonl); test (test.jsonl)")


def test_bad_rows_are_located_by_their_path_in_the_dataset_folder_and_their_number_from_1(
    tmp_path: Path,
) -> None:
    for part in ("en", "de"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "train.jsonl").write_text(json.dumps(ROW) + "\n{broken\n")
    (tmp_path / "de" / "train.json").write_text(json.dumps([ROW, 7]))
    rows = read_rows(DatasetSource(path=str(tmp_path)))
    bad = [where for where, row in rows if not isinstance(row, dict)]
    assert bad == ["de/train.json[2]", "de/train.jsonl:2", "en/train.jsonl:2"]
    (where, _), *_ = read_rows(DatasetSource(path=str(tmp_path / "en" / "train.jsonl")))
    assert where == "train.jsonl:1"


@pytest.mark.parametrize(
    "text",
    [json.dumps(ROW, indent=2), json.dumps([ROW, ROW], indent=2)],
    ids=["a pretty-printed object", "a pretty-printed array"],
)
def test_a_jsonl_file_that_is_not_json_lines_fails_naming_its_first_line_and_what_is_wrong(
    tmp_path: Path, tokenizer: Any, text: str
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    with pytest.raises(
        TrainerError, match=r"none of the first \d+ rows .* is a JSON object \(first:"
    ) as raised:
        load_examples(DatasetSource(path=str(path)), tokenizer)
    assert raised.value.code == ExitCode.DATA_ERROR
    assert "rows.jsonl:1: not valid JSON (" in str(raised.value)


@pytest.mark.parametrize("indent", [None, 4])
def test_a_json_file_holding_an_array_is_read_as_rows(
    tmp_path: Path, tokenizer: Any, indent: int | None
) -> None:
    path = tmp_path / "alpaca_data.json"
    path.write_text(json.dumps([ROW] * 5, indent=indent))
    examples, stats, fmt = load_examples(DatasetSource(path=str(path)), tokenizer)
    assert (fmt, stats.rows, stats.bad_rows, len(examples)) == ("alpaca", 5, 0, 5)


@pytest.mark.parametrize("chunk", [3, 4, 7, 1 << 20])
def test_a_json_array_read_in_chunks_gives_the_rows_json_loads_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(sources, "_JSON_CHUNK_BYTES", chunk)  # numbers and UTF-8 characters straddle chunks
    rows = [ROW, {"output": "é😀\n", "n": -12.5e-3}, 123456789, [1.5e300, None, True], {}, "x", 7]
    path = tmp_path / "rows.json"
    for text in (json.dumps(rows, ensure_ascii=False), " \n" + json.dumps(rows, indent=3) + "\n", "[]"):
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert [row for _, row in read_rows(DatasetSource(path=str(path)))] == json.loads(text)


BREAKS = {
    "cut short": lambda t: t[:-10],
    "no comma": lambda t: t.replace("},", "}", 1),
    "more": lambda t: t + " [",
}


@pytest.mark.parametrize("chunk", [5, 1 << 20])
@pytest.mark.parametrize("broken", BREAKS)
def test_a_json_file_that_is_a_broken_array_fails_with_where_it_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, broken: str
) -> None:
    monkeypatch.setattr(sources, "_JSON_CHUNK_BYTES", chunk)
    path = tmp_path / "rows.json"
    path.write_text(BREAKS[broken](json.dumps([ROW] * 3, indent=2)))
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(path.read_text())
    where = f"{expected.value.msg} at line {expected.value.lineno} column {expected.value.colno}"
    with pytest.raises(TrainerError, match=f"not a JSON array: {where}$") as raised:
        list(read_rows(DatasetSource(path=str(path))))
    assert raised.value.code == ExitCode.DATA_ERROR


def test_a_json_array_file_that_is_not_utf8_fails_naming_the_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "_JSON_CHUNK_BYTES", 4)
    path = tmp_path / "rows.json"
    data = b'["caf\xc3\xa9", "ab\xe9"]'
    path.write_bytes(data)
    bad = data.index(b"ab\xe9") + 2  # in the fifth chunk, after a character split between two
    with pytest.raises(TrainerError, match=rf"not UTF-8 text \(byte {bad}: ") as raised:
        list(read_rows(DatasetSource(path=str(path))))
    assert raised.value.code == ExitCode.DATA_ERROR


def test_a_line_that_is_not_utf8_is_a_bad_row_not_replacement_characters(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    good = json.dumps(ROW).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good.replace(b"abc", b"ab\xe9") + b"\n" + good + b"\n")
    rows = [row for _, row in read_rows(DatasetSource(path=str(path)))]
    assert rows[0] == ROW and rows[2] == ROW  # a byte-order mark on the first line is no error
    assert isinstance(rows[1], BadRow) and "not UTF-8" in str(rows[1])


def test_the_fallback_chat_template_starts_chats_with_bos_like_the_text_format(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = tmp_path / "rows.jsonl"
    for fmt in ("alpaca", "text"):
        path.write_text(json.dumps(format_row("repeat: abc", "abc", fmt)) + "\n")
        (example,), _, _ = load_examples(DatasetSource(path=str(path), format=fmt), tokenizer)
        assert example.input_ids[0] == tokenizer.bos_token_id
        assert (example.input_ids == tokenizer.bos_token_id).sum() == 1


def test_a_hub_dataset_is_read_at_the_revision_the_spec_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    asked: list[dict[str, Any]] = []

    def load_dataset(name: str, **kwargs: Any) -> list[dict[str, Any]]:
        asked.append({"name": name, **kwargs})
        return [ROW]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = list(read_rows(DatasetSource(name="org/chats", split="train", revision="v1.2")))
    assert rows == [("org/chats[1]", ROW)]  # numbered from 1, as a file's lines
    assert asked == [{"name": "org/chats", "split": "train", "revision": "v1.2"}]


@pytest.mark.parametrize("role", [["user"], {"name": "user"}, 7], ids=["a list", "an object", "a number"])
def test_a_message_whose_role_is_not_a_string_is_a_located_bad_row_and_the_others_train(
    tmp_path: Path, tokenizer: Any, role: Any
) -> None:
    good = format_row("repeat: abc", "abc", "messages")
    bad = {"messages": [{"role": role, "content": "x"}, {"role": "assistant", "content": "y"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [good] * 200 + [bad]))
    examples, stats, _ = load_examples(DatasetSource(path=str(path)), tokenizer)
    assert len(examples) == 200 and stats.bad_rows == 1
    assert stats.bad_examples == [
        "rows.jsonl:201: message 0 needs a role in ['assistant', 'system', 'user'] and a string content"
    ]


def test_a_row_that_raises_an_error_no_check_foresaw_is_a_located_bad_row_with_its_traceback_logged_once(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = data.tokenize_row

    def tokenize_row(row: Any, *args: Any) -> Any:
        if row["input"] == "odd":
            raise ValueError("a shape nobody expected")
        return real(row, *args)

    monkeypatch.setattr(data, "tokenize_row", tokenize_row)
    path = tmp_path / "rows.jsonl"
    tags = ["", "odd", *[""] * 200, "odd"]
    path.write_text("".join(json.dumps(ROW | {"input": tag}) + "\n" for tag in tags))
    with caplog.at_level(logging.WARNING):
        examples, stats, _ = load_examples(DatasetSource(path=str(path)), tokenizer)
    assert len(examples) == 201 and stats.bad_rows == 2
    assert stats.bad_examples == [
        f"rows.jsonl:{n}: unexpected ValueError: a shape nobody expected" for n in (2, 203)
    ]
    (traced,) = [r for r in caplog.records if r.exc_info]
    assert traced.getMessage().startswith("row rows.jsonl:2 raised ValueError")

    def out_of_memory(row: Any, *args: Any) -> Any:
        raise MemoryError  # not the row's fault: the attempt ends, as before

    monkeypatch.setattr(data, "tokenize_row", out_of_memory)
    with pytest.raises(MemoryError):
        load_examples(DatasetSource(path=str(path)), tokenizer)
