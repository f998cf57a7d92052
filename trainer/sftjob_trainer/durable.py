"""Files written so that a crash leaves the old state or the new one, never half of one: each file
fsynced as it is closed, folders fsynced after a rename, unfinished writes under ``TMP_PREFIX`` names
that no reader takes for finished ones (checkpoints, the checkpoint folder's owner, the output).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TMP_PREFIX = ".tmp-"


def save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_text(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
