"""Which files of a dataset folder hold a split, read the way the datasets library reads a hub snapshot.

The default config of the ``configs:`` in the folder's README.md front matter (the only one, the one with
``default: true`` or the one named ``default``) names the split's files: ``data_files`` globs, under its
``data_dir``. Without them the library's rules are followed here in order: hidden files and folders,
folders starting with ``__`` and the library's metadata files are skipped; files named
``data/{split}-00000-of-00001...`` give the splits' exact names; otherwise split names in folder names,
then in file names (``train.jsonl``, ``validation/part-0.json``); every file when no name carries one.
Arrow folders of ``save_to_disk`` are refused (the library reads them with ``load_from_disk`` alone).
Kept apart from sources.py, which reads the rows of the files chosen here.
"""

from __future__ import annotations

import glob
import logging
import re
from pathlib import Path
from typing import Any

import yaml

from sftjob.failures import ExitCode, TrainerError

log = logging.getLogger(__name__)

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# How the datasets library (datasets/data_files.py) finds a folder's splits. First the hub's sharded names,
# whose split part is the split's exact name: ``data/train_sft-00000-of-00003-abc.parquet``.
_SHARDED = re.compile(r"data/(?P<split>[^/]+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*")
# Then these words, between separators (``_`` is one: ``train_1.jsonl`` is of split train), in a folder's
# name (``validation/part-0.json``) or, when no folder name has one, in a file's (``test.jsonl``).
SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SPLIT_SEPARATOR = r"[-._ 0-9]"
# Files the datasets library never reads as data (those a dataset folder could hold as .json), and the
# state.json of a save_to_disk folder.
_NOT_DATA = frozenset(
    {"config.json", "dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
)
_README = "README.md"
_FRONT_MATTER = "---"
_DEFAULT_SPLIT = "train"  # the split of data_files given as a string or a list of them
_SHOWN_FILES = 20


def files_of(path: Path, split: str, field: str = "dataset.split") -> list[Path]:
    """The data files ``dataset.path`` holds for ``split`` (the spec's ``field``): the file itself, or the
    folder's files of it."""
    if path.is_dir():
        _refuse_arrow_folder(path)
        config = _default_config(path)
        folder = path / str(config.get("data_dir") or "") if config else path
        if config and config.get("data_files") is not None:
            return _config_files(folder, config, split, field)
        files = sorted(p for p in folder.rglob("*") if _is_data(p.relative_to(folder)) and p.is_file())
        if not files:
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"dataset folder {folder} has no .jsonl/.json/.parquet files (hidden files and folders, and"
                " folders starting with __, are skipped)",
            )
        files = split_files(folder, files, split, field)
    elif path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise TrainerError(ExitCode.DATA_ERROR, f"dataset file {path} is not .jsonl, .json or .parquet")
        files = [path]
    else:
        raise TrainerError(ExitCode.DATA_ERROR, f"dataset path {path} does not exist")
    return files


def _refuse_arrow_folder(path: Path) -> None:
    """A ``save_to_disk`` folder (``dataset_dict.json``, or ``state.json`` beside ``*.arrow`` files in it or
    in a split folder) holds no file the trainer reads."""
    states = [path / "state.json", *path.glob("*/state.json")]
    if (path / "dataset_dict.json").is_file() or any(
        s.is_file() and any(s.parent.glob("*.arrow")) for s in states
    ):
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"dataset folder {path} is an Arrow folder written by save_to_disk, which the trainer does not"
            " read: export it with to_json (JSON Lines) or to_parquet",
        )


def _default_config(folder: Path) -> dict[str, Any] | None:
    """The default config of the ``configs:`` list in README.md's YAML front matter; None without one."""
    readme = folder / _README
    lines = readme.read_text(encoding="utf-8", errors="replace").splitlines() if readme.is_file() else []
    if not lines or lines[0] != _FRONT_MATTER or _FRONT_MATTER not in lines[1:]:
        return None
    try:
        card = yaml.safe_load("\n".join(lines[1 : lines.index(_FRONT_MATTER, 1)]))
    except yaml.YAMLError as exc:
        raise TrainerError(ExitCode.DATA_ERROR, f"{readme}: its front matter is not YAML: {exc}") from exc
    configs = card.get("configs") if isinstance(card, dict) else None
    if not configs:
        return None
    if not isinstance(configs, list) or not all(isinstance(c, dict) and "config_name" in c for c in configs):
        raise TrainerError(
            ExitCode.DATA_ERROR, f"{readme}: configs must be a list of mappings, each with a config_name"
        )
    defaults = [c for c in configs if len(configs) == 1 or c["config_name"] == "default" or c.get("default")]
    if len(defaults) != 1:
        names = ", ".join(str(c["config_name"]) for c in configs)
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"{readme} names configs {names} but {'more than one' if defaults else 'none'} of them is the"
            " default (default: true, or named default): the trainer reads the default config; to train"
            " another, point dataset.path at its folder",
        )
    return dict(defaults[0])


def _config_files(folder: Path, config: dict[str, Any], split: str, field: str) -> list[Path]:
    """The files of ``split`` that a config's ``data_files`` names, globs relative to ``folder`` (its
    ``data_dir``): a string or a list of them (split train), or a list of ``{split, path}``."""
    data_files, name = config["data_files"], config["config_name"]
    if isinstance(data_files, list) and any(isinstance(entry, dict) for entry in data_files):
        patterns = {str(e.get("split")): e.get("path") for e in data_files if isinstance(e, dict)}
    else:
        patterns = {_DEFAULT_SPLIT: data_files}
    chosen = patterns.get(split)
    if chosen is None:
        raise TrainerError(
            ExitCode.DATA_ERROR,
            f"the default config {name!r} of {folder}'s {_README} has no split {split!r} ({field}); its"
            f" splits: {', '.join(patterns)}",
        )
    names: dict[str, None] = {}  # in the patterns' order, each file once
    for pattern in chosen if isinstance(chosen, list) else [chosen]:
        matched = sorted(glob.glob(str(pattern), root_dir=folder, recursive=True))
        found = [m for m in matched if _is_requested(Path(m), str(pattern)) and (folder / m).is_file()]
        if not found:
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"{pattern!r}, of split {split!r} in the default config {name!r} of {folder}'s {_README},"
                " matches no .jsonl/.json/.parquet file in the folder",
            )
        names.update(dict.fromkeys(found))
    log.info("dataset folder %s, config %s, split %s: reading %s", folder, name, split, _shown(list(names)))
    return [folder / n for n in names]


def _is_requested(relative: Path, pattern: str) -> bool:
    """Whether a file a config's glob matched is read: a data file inside the folder, in no folder
    starting with ``__`` that the pattern does not name (glob itself skips the hidden ones)."""
    specials = sum(part.startswith("__") for part in relative.parent.parts)
    return (
        relative.suffix in DATA_SUFFIXES
        and relative.name not in _NOT_DATA
        and not relative.is_absolute()
        and ".." not in relative.parts
        and specials == sum(part.startswith("__") for part in Path(pattern).parent.parts)
    )


def _is_data(relative: Path) -> bool:
    """Whether the datasets library would read the file at ``relative`` in a dataset folder: a data suffix,
    not hidden nor in a hidden folder (``.ipynb_checkpoints/``), nor in a folder starting with ``__``
    (``__MACOSX/``), nor one of its metadata files."""
    *folders, name = relative.parts
    return (
        relative.suffix in DATA_SUFFIXES
        and name not in _NOT_DATA
        and not any(part.startswith(".") for part in relative.parts)
        and not any(part.startswith("__") for part in folders)
    )


def split_files(folder: Path, files: list[Path], split: str, field: str = "dataset.split") -> list[Path]:
    """The files of ``split`` in a dataset folder, found as the datasets library finds them
    (:func:`folder_splits`); all of them when no name carries a split."""
    names = [p.relative_to(folder).as_posix() for p in files]
    splits = folder_splits(names, split)
    if splits is None:
        chosen = names
    else:
        chosen = splits.get(split, [])
        if not chosen:
            found = "; ".join(f"{name} ({_shown(of)})" for name, of in splits.items())
            raise TrainerError(
                ExitCode.DATA_ERROR,
                f"dataset folder {folder} names splits in its files but none is split {split!r} ({field});"
                f" the splits it has: {found}",
            )
    log.info(
        "dataset folder %s, split %s: reading %d file(s): %s", folder, split, len(chosen), _shown(chosen)
    )
    return [folder / name for name in chosen]


def folder_splits(names: list[str], split: str) -> dict[str, list[str]] | None:
    """The splits of a dataset folder's files (paths relative to it) and the files of each, in the order of
    the datasets library's rules; None when no name carries a split. ``split``, the one asked for, is a
    word of its own when it is no key of :data:`SPLIT_NAMES` (``val`` reads the files that name ``val``)."""
    sharded: dict[str, list[str]] = {}
    for name in names:
        if match := _SHARDED.fullmatch(name):
            sharded.setdefault(match["split"], []).append(name)
    if sharded:
        return sharded
    words = dict(SPLIT_NAMES)
    words.setdefault(split, (split,))
    for where in (_in_folder_name, _in_file_name):
        found = {s: [n for n in names if where(n, of)] for s, of in words.items()}
        found = {s: of for s, of in found.items() if of}
        if found:
            return found
    return None


def _in_folder_name(relative: str, words: tuple[str, ...]) -> bool:
    *folders, _ = relative.split("/")
    pattern = _word_pattern(words, rf"(?:{_SPLIT_SEPARATOR}.*)?")
    return any(pattern.fullmatch(part) for part in folders)


def _in_file_name(relative: str, words: tuple[str, ...]) -> bool:
    return _word_pattern(words, rf"{_SPLIT_SEPARATOR}.*").fullmatch(relative.rsplit("/", 1)[-1]) is not None


def _word_pattern(words: tuple[str, ...], after: str) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(w) for w in sorted(words))
    return re.compile(rf"(?:.*{_SPLIT_SEPARATOR})?(?:{alternatives}){after}", flags=re.IGNORECASE)


def _shown(names: list[str]) -> str:
    more = len(names) - _SHOWN_FILES
    return ", ".join(names[:_SHOWN_FILES]) + (f" and {more} more" if more > 0 else "")
