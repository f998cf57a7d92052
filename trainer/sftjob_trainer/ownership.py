"""One attempt at a time owns a job's checkpoint folder (the ``OWNER`` file).

A restart can begin while the previous attempt's pods still finish their SIGTERM save, or go on running
on a node cut off from the cluster. Each attempt writes its number into ``OWNER`` as it starts, before it
reads any checkpoint; an attempt that finds a later owner when it is about to commit a checkpoint or its
output stops (PREEMPTED) and commits nothing. A job recreated under the same name (a new uid, resuming a
kept folder) takes over.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_OWNER_FILE, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.durable import TMP_PREFIX, fsync_dir, write_text


def take_over(root: Path, job: JobRef, ctx: DistContext) -> None:
    """Collective: make this attempt of ``job`` the owner of the checkpoint folder, before anything is
    read from it. An attempt that finds a later attempt of the same job owning it was superseded and
    stops; a job recreated under the same name (a new uid, resuming a kept folder) takes over."""
    owner = ctx.broadcast(_owner(root) if ctx.is_main else None)
    if owner is not None and owner[0] == job.uid and owner[1] > job.attempt:
        raise _superseded(root, job, owner, "as it starts")
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{CHECKPOINT_OWNER_FILE}-{job.attempt}"
        write_text(tmp, json.dumps({"job": job.uid, "attempt": job.attempt}) + "\n")
        os.replace(tmp, root / CHECKPOINT_OWNER_FILE)
        fsync_dir(root)
        for leftover in root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*"):  # saves no attempt can commit now
            shutil.rmtree(leftover, ignore_errors=True)
    ctx.barrier()


def check_owner(root: Path, job: JobRef, ctx: DistContext, when: str, discard: Path | None = None) -> None:
    """Collective: stop (PREEMPTED) when another attempt owns the folder now, removing ``discard`` (this
    attempt's unfinished save) first. A folder without an owner is anyone's."""
    owner = ctx.broadcast(_owner(root) if ctx.is_main else None)
    if owner is None or owner == (job.uid, job.attempt):
        return
    if discard is not None and ctx.is_main:
        shutil.rmtree(discard, ignore_errors=True)
    raise _superseded(root, job, owner, when)


def _owner(root: Path) -> tuple[str, int] | None:
    try:
        owner = json.loads((root / CHECKPOINT_OWNER_FILE).read_text())
        return str(owner["job"]), int(owner["attempt"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _superseded(root: Path, job: JobRef, owner: tuple[str, int], when: str) -> TrainerError:
    by = f"attempt {owner[1]}" if owner[0] == job.uid else f"job {owner[0] or '(local)'}"
    return TrainerError(
        ExitCode.PREEMPTED,
        f"attempt {job.attempt} was superseded by {by}, which owns {root}: stopping {when}",
    )
