"""A dataset folder is read like the datasets library reads a hub snapshot: the default config of the
``configs:`` in README.md's front matter chooses the split's files before any file-name rule, and an Arrow
folder written by ``save_to_disk`` is refused in words that say how to export it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.sources import read_rows

pytestmark = pytest.mark.trainer


def _parquet(path: Path, tags: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": tags}), path)


def _jsonl(path: Path, tags: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": tag}) + "\n" for tag in tags))


def _readme(folder: Path, configs: list[dict[str, Any]]) -> None:
    # JSON is YAML: the front matter a hub dataset card carries.
    (folder / "README.md").write_text(f"---\nlicense: mit\nconfigs: {json.dumps(configs)}\n---\n# A card\n")


def _tags(folder: Path, split: str = "train") -> list[str]:
    return [row["text"] for _, row in read_rows(DatasetSource(path=str(folder), split=split))]


def _subsets(folder: Path) -> None:
    """A snapshot whose ``all`` subset holds the rows of subsets ``a`` and ``b`` again."""
    _parquet(folder / "data" / "all" / "train-00000-of-00001.parquet", ["a1", "a2", "b1"])
    _parquet(folder / "data" / "a" / "train-00000-of-00001.parquet", ["a1", "a2"])
    _parquet(folder / "data" / "b" / "train-00000-of-00001.parquet", ["b1"])


def _config(name: str, data_files: Any, **more: Any) -> dict[str, Any]:
    return {"config_name": name, "data_files": data_files, **more}


def test_the_default_config_chooses_the_files_as_load_dataset_does(tmp_path: Path) -> None:
    _subsets(tmp_path)
    _readme(
        tmp_path,
        [
            _config("all", [{"split": "train", "path": "data/all/train-*"}], default=True),
            _config("a", [{"split": "train", "path": "data/a/train-*"}]),
            _config("b", [{"split": "train", "path": "data/b/train-*"}]),
        ],
    )
    assert _tags(tmp_path) == ["a1", "a2", "b1"]  # datasets.load_dataset(folder, split="train") reads 3


def test_a_config_named_default_or_the_only_one_is_the_default(tmp_path: Path) -> None:
    _subsets(tmp_path)
    _readme(tmp_path, [_config("a", "data/a/*.parquet"), _config("default", "data/b/*.parquet")])
    assert _tags(tmp_path) == ["b1"]
    _readme(tmp_path, [_config("a", "data/a/*.parquet")])
    assert _tags(tmp_path) == ["a1", "a2"]


def test_configs_without_a_default_fail_naming_them_and_how_to_train_another(tmp_path: Path) -> None:
    _subsets(tmp_path)
    _readme(tmp_path, [_config("a", "data/a/*.parquet"), _config("b", "data/b/*.parquet")])
    with pytest.raises(TrainerError, match="names configs a, b but none of them is the default") as raised:
        _tags(tmp_path)
    assert raised.value.code == ExitCode.DATA_ERROR
    assert "the trainer reads the default config; to train another, point dataset.path at its folder" in str(
        raised.value
    )


@pytest.mark.parametrize(
    ("data_files", "split", "expected"),
    [
        ("data/a/*.parquet", "train", ["a1", "a2"]),
        (["data/b/*.parquet", "data/a/*.parquet"], "train", ["b1", "a1", "a2"]),
        ([{"split": "train", "path": "data/a/*"}, {"split": "test", "path": "data/b/*"}], "test", ["b1"]),
        ([{"split": "train", "path": ["data/a/*", "data/b/*"]}], "train", ["a1", "a2", "b1"]),
        ("**/a/*.parquet", "train", ["a1", "a2"]),
    ],
    ids=["a string", "a list of strings", "splits", "a split of several globs", "a recursive glob"],
)
def test_data_files_may_be_a_glob_a_list_of_globs_or_splits_with_their_globs(
    tmp_path: Path, data_files: Any, split: str, expected: list[str]
) -> None:
    _subsets(tmp_path)
    _readme(tmp_path, [_config("default", data_files)])
    assert _tags(tmp_path, split) == expected


def test_a_split_the_default_config_lacks_fails_naming_the_splits_it_has(tmp_path: Path) -> None:
    _subsets(tmp_path)
    _readme(tmp_path, [_config("all", [{"split": "train", "path": "data/all/*"}])])
    with pytest.raises(TrainerError, match=r"no split 'validation' \(dataset.split\); its splits: train"):
        _tags(tmp_path, "validation")
    _readme(tmp_path, [_config("all", "data/none/*.parquet")])
    with pytest.raises(TrainerError, match=r"'data/none/\*\.parquet', of split 'train'.* matches no"):
        _tags(tmp_path)


def test_a_configs_data_dir_holds_its_files_and_its_globs(tmp_path: Path) -> None:
    _subsets(tmp_path)
    _readme(tmp_path, [{"config_name": "a", "data_dir": "data/a"}])
    assert _tags(tmp_path) == ["a1", "a2"]
    _readme(tmp_path, [_config("b", "*.parquet", data_dir="data/b")])
    ((where, _),) = read_rows(DatasetSource(path=str(tmp_path)))
    assert where == "data/b/train-00000-of-00001.parquet:row 1"  # located in the dataset folder


def test_a_readme_without_configs_leaves_the_file_name_rules_to_choose(tmp_path: Path) -> None:
    _jsonl(tmp_path / "train.jsonl", ["train"])
    _jsonl(tmp_path / "test.jsonl", ["test"])
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# A card\n")
    assert _tags(tmp_path) == ["train"]
    (tmp_path / "README.md").write_text("# A card without front matter\n")
    assert _tags(tmp_path, "test") == ["test"]


@pytest.mark.parametrize("dict_of_splits", [False, True], ids=["a Dataset", "a DatasetDict"])
def test_an_arrow_folder_written_by_save_to_disk_is_refused_saying_how_to_export_it(
    tmp_path: Path, dict_of_splits: bool
) -> None:
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": ["a", "b"]})
    (datasets.DatasetDict({"train": dataset}) if dict_of_splits else dataset).save_to_disk(str(tmp_path))
    with pytest.raises(TrainerError, match="Arrow folder written by save_to_disk") as raised:
        _tags(tmp_path)
    assert raised.value.code == ExitCode.DATA_ERROR
    assert "export it with to_json (JSON Lines) or to_parquet" in str(raised.value)


def test_a_state_json_beside_no_arrow_file_is_not_read_as_rows(tmp_path: Path) -> None:
    _jsonl(tmp_path / "part-0.jsonl", ["row"])
    (tmp_path / "state.json").write_text(json.dumps({"_data_files": [], "_fingerprint": "f"}))
    assert _tags(tmp_path) == ["row"]
