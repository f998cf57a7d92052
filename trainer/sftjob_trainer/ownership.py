"""One attempt at a time owns a job's checkpoint folder (the ``OWNER`` file).

A restart can begin while the previous attempt's pods still finish their SIGTERM save, or go on running
on a node cut off from the cluster. Each attempt writes its job (namespace, name, uid) and number into
``OWNER`` as it starts, before it reads any checkpoint; an attempt that finds a later owner when it is
about to commit a checkpoint or its output stops (PREEMPTED) and commits nothing. A job recreated under
the same name (a new uid, resuming a kept folder) takes over; another job's folder (two jobs given the
same ``checkpoints.volume``) is refused, else each would resume the other's checkpoints and supersede it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sftjob.config import JobRef
from sftjob.constants import CHECKPOINT_OWNER_FILE, CHECKPOINT_PREFIX
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.durable import TMP_PREFIX, fsync_dir, write_text
from sftjob_trainer.failures import storage_failure


@dataclass(frozen=True)
class Owner:
    """What ``OWNER`` says; ``namespace`` and ``name`` are None in a file written before they were."""

    uid: str
    attempt: int
    namespace: str | None = None
    name: str | None = None

    def is_job(self, job: JobRef) -> bool:
        """Whether this is ``job`` or a job recreated under its name (an old file names no job: it may be)."""
        return self.name is None or (self.namespace, self.name) == (job.namespace, job.name)


def take_over(root: Path, job: JobRef, ctx: DistContext) -> None:
    """Collective: make this attempt of ``job`` the owner of the checkpoint folder, before anything is
    read from it. An attempt that finds a later attempt of the same job owning it was superseded and
    stops; a job recreated under the same name (a new uid, resuming a kept folder) takes over; another
    job's folder is a configuration error."""
    owner = _read_owner(root, ctx)
    if owner is not None and not owner.is_job(job):
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"checkpoint folder {root} belongs to job {owner.namespace}/{owner.name}: give each job its own"
            " checkpoints.volume, or delete that job's checkpoints from this one",
        )
    if owner is not None and owner.uid == job.uid and owner.attempt > job.attempt:
        raise _superseded(root, job, owner, "as it starts")
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{CHECKPOINT_OWNER_FILE}-{job.attempt}"
        record = {"namespace": job.namespace, "name": job.name, "job": job.uid, "attempt": job.attempt}
        write_text(tmp, json.dumps(record) + "\n")
        os.replace(tmp, root / CHECKPOINT_OWNER_FILE)
        fsync_dir(root)
        for leftover in root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*"):  # saves no attempt can commit now
            shutil.rmtree(leftover, ignore_errors=True)
    ctx.barrier()


def check_owner(root: Path, job: JobRef, ctx: DistContext, when: str, discard: Path | None = None) -> None:
    """Collective: stop (PREEMPTED) when another attempt owns the folder now, removing ``discard`` (this
    attempt's unfinished save) first. A folder without an owner is anyone's; an ``OWNER`` that cannot be
    read (EIO, a stale NFS handle) stops the attempt as the storage's failure, committing nothing: it may
    name a later attempt."""
    owner = _read_owner(root, ctx)
    if owner is None or (owner.uid, owner.attempt) == (job.uid, job.attempt):
        return
    if discard is not None and ctx.is_main:
        shutil.rmtree(discard, ignore_errors=True)
    raise _superseded(root, job, owner, when)


def _read_owner(root: Path, ctx: DistContext) -> Owner | None:
    """Collective: rank 0's :func:`_owner`, on every rank; the error it stopped with raised on every rank."""
    found: Owner | tuple[ExitCode, str] | None = None
    if ctx.is_main:
        try:
            found = _owner(root)
        except TrainerError as exc:
            found = (exc.code, exc.reason)
    found = ctx.broadcast(found)
    if isinstance(found, tuple):
        raise TrainerError(*found)
    return found


def _owner(root: Path) -> Owner | None:
    """What ``OWNER`` says; None when there is none, or none a trainer could have written (its content
    unreadable as an owner). Any other failure to read it raises the storage's TrainerError
    (:func:`~sftjob_trainer.failures.storage_failure`): only a missing file means no owner."""
    path = root / CHECKPOINT_OWNER_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise storage_failure(exc, f"could not read {path} (which attempt owns the folder)", root) from exc
    try:
        owner = json.loads(text)
        namespace, name = owner.get("namespace"), owner.get("name")
        return Owner(
            str(owner["job"]),
            int(owner["attempt"]),
            None if namespace is None else str(namespace),
            None if name is None else str(name),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _superseded(root: Path, job: JobRef, owner: Owner, when: str) -> TrainerError:
    by = f"attempt {owner.attempt}" if owner.uid == job.uid else f"job {owner.uid or '(local)'}"
    return TrainerError(
        ExitCode.PREEMPTED,
        f"attempt {job.attempt} was superseded by {by}, which owns {root}: stopping {when}",
    )
