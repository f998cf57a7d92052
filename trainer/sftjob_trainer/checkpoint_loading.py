"""Reading a checkpoint's tensors into a model without harm: whether they fit it, whether they load, and
whose fault it is when they do not.

Loading writes into the model in place, so every tensor is first checked against the model's (another
shape or a missing one: :class:`OtherShapes`, raised before anything is written) and, where the model
must be left as it was when they fail part-way (:func:`load_weights`), read without being written. A
failure is then the checkpoint's (skip it) or the storage's (stop, the checkpoint kept for the restart):
:func:`read_failure`, :func:`tensors_failure`. Kept apart from resume.py, which picks the checkpoint to
start from and sets the others aside: how torch.distributed.checkpoint is driven is no part of that.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from sftjob.failures import ExitCode, OomPhase, TrainerError
from sftjob_trainer.checkpoints import (
    TENSORS_DIR,
    TRAINABLE,
    Trainables,
    describe_failures,
    persistent_buffers,
    single_process_is_meant,
    trainable_weights,
)
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.failures import causes, oom_among, permission_denied, storage_failure

_MISFITS_SHOWN = 3  # tensors named in the error of checkpoints that do not fit the model


class OtherShapes(ValueError):
    """A checkpoint lacks tensors the model has, or holds them in another shape (:class:`Loading`): it is
    of another model, method or adapter."""


def load_weights(path: Path, parts: Trainables, ctx: DistContext) -> str | None:
    """Collective: the trainable weights of the checkpoint at ``path`` into the model (the optimizer is
    left alone: this is for writing the output from an earlier checkpoint, not for training on); None
    once they are in, else why they do not load (the checkpoint at fault), the model left as it was.

    Every tensor is read first without being written anywhere, then loaded: a checkpoint whose files
    fail part-way would otherwise leave the model half overwritten, and a full fine-tune's last weights
    are in no checkpoint. The storage failing, or permission denied, raises its TrainerError."""
    weights = {"model": trainable_weights(parts.model)}
    buffers = persistent_buffers(parts.model, weights["model"])
    try:
        load_tensors(weights, path, ctx, Reading(buffers))
        load_tensors(weights, path, ctx, Loading(buffers))
    except CheckpointException as exc:
        stop = tensors_failure(exc, path)
        if stop is not None:
            raise stop from exc
        return describe_failures(exc)
    set_model_state_dict(parts.model, weights["model"], options=TRAINABLE)
    return None


def load_tensors(tensors: dict[str, Any], path: Path, ctx: DistContext, planner: DefaultLoadPlanner) -> None:
    """Collective: the checkpoint at ``path`` into ``tensors``, as ``planner`` plans it."""
    with single_process_is_meant():
        dcp.load(
            tensors,
            storage_reader=FileSystemReader(path / TENSORS_DIR),
            planner=planner,
            no_dist=not ctx.active,
        )


class Loading(DefaultLoadPlanner):
    """torch.distributed.checkpoint's planner, which first checks that the checkpoint holds every tensor
    asked for, in its shape: :class:`OtherShapes` otherwise, raised before anything is written. Buffers it
    does not hold (of ``optional``, the model's persistent ones: an older trainer saved none) are left out
    of the load and of ``tensors["model"]``, and listed in ``absent``."""

    def __init__(self, optional: Collection[str] = ()) -> None:
        super().__init__()
        self.optional = set(optional)
        self.absent: list[str] = []

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is not None:
            model, saved = state_dict["model"], metadata.state_dict_metadata
            self.absent = sorted(n for n in self.optional if n in model and f"model.{n}" not in saved)
            for name in self.absent:
                del model[name]
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        misfits = [m for key, value in self.state_dict.items() if (m := _misfit(key, value, saved.get(key)))]
        if misfits:
            more = len(misfits) - _MISFITS_SHOWN
            raise OtherShapes(
                f"{len(misfits)} tensor(s) do not fit the model: {'; '.join(misfits[:_MISFITS_SHOWN])}"
                + (f"; {more} more" if more > 0 else "")
            )
        return super().create_local_plan()


def _misfit(key: str, value: Any, held: Any) -> str | None:
    """How the checkpoint's ``held`` (its index's entry, None when it has none) does not fit ``value``."""
    if held is None:
        return f"{key} is not in it"
    fits = not isinstance(held, TensorStorageMetadata) or not isinstance(value, torch.Tensor)
    if fits or held.size == value.size():
        return None
    return f"{key} is {list(held.size)} in it, {list(value.size())} here"


class Reading(Loading):
    """:class:`Loading` that reads every tensor into a scratch one of its size and writes none: whether
    the checkpoint's files load, the model left as it is (one tensor at a time in memory)."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return torch.empty(tuple(read_item.lengths))

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        pass


def read_failure(exc: BaseException, doing: str, folder: Path) -> TrainerError | None:
    """The error to stop on when ``doing`` failed with ``exc``: CONFIG_ERROR naming the owner when permission
    was denied anywhere in its causes, STORAGE_ERROR when the storage failed (:func:`_is_storage_failure`);
    None when the checkpoint itself is at fault."""
    denied = permission_denied(exc)
    if denied is not None:
        return storage_failure(denied, doing, folder)
    return storage_error(f"{doing}: {exc}") if _is_storage_failure(exc) else None


def tensors_failure(exc: CheckpointException, path: Path) -> TrainerError | None:
    """What to stop on when the tensors of ``path`` did not load on some rank (``exc`` holds every rank's
    failure): a CUDA OOM first, then a permission denied on any of them, then a storage failure; None to
    skip it."""
    errors = [error for error, _ in exc.failures.values()]
    oom = oom_among(errors, f"{OomPhase.LOADING} the weights to start from")
    if oom is not None:
        return oom
    denied = next((d for d in map(permission_denied, errors) if d is not None), None)
    if denied is not None:
        return storage_failure(denied, f"could not read checkpoint {path}", path)
    if any(_is_storage_failure(error) for error in errors):
        return storage_error(f"could not read {path}: {describe_failures(exc)}")
    return None


def _is_storage_failure(exc: BaseException) -> bool:
    """The storage failing (EIO, a stale NFS handle, a timeout), not the checkpoint: no reason to skip it.
    A missing file is the checkpoint's fault (a lost rank's file, a node's copy of an unshared folder)."""
    return any(
        isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError) for cause in causes(exc)
    )


def storage_error(detail: str) -> TrainerError:
    """The STORAGE_ERROR to stop on when reading the checkpoints failed for the storage's sake, ``detail``
    saying how."""
    return TrainerError(
        ExitCode.STORAGE_ERROR,
        f"storage error reading the checkpoints: {detail} (kept as they are: the restart tries again)",
    )
