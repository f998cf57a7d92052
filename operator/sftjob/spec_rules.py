"""The spec's cross-field rules the CRD's CEL applies at admission, in Python for ``sftjob plan``.

The spec model does not apply them: a job admitted before a rule existed must keep running (the
operator plans it as it was planned then).
"""

from __future__ import annotations

import re

from sftjob.constants import TENSORBOARD_FOLDER_PATH
from sftjob.spec import SFTJobSpec


def packing_problem(spec: SFTJobSpec) -> str | None:
    """Packed rows longer than the sequence length, or a packed-row length with packing off: refused at
    admission by the CRD's rules, and by the CLI, but not by this model: a job admitted before the rules
    existed keeps running, its rows planned at ``maxSeqLength`` (:func:`sftjob.spec.to_plan_request`)."""
    length = spec.training.packing_length
    if length is not None and spec.training.packing is False:
        return (
            f"spec.training.packingLength {length} needs packing: with spec.training.packing false every row"
            " is padded to spec.dataset.maxSeqLength; remove packingLength or turn packing on"
        )
    if length is not None and length > spec.dataset.max_seq_length:
        return (
            f"spec.training.packingLength {length} exceeds spec.dataset.maxSeqLength"
            f" {spec.dataset.max_seq_length}: packed rows hold at most maxSeqLength tokens"
        )
    return None


def batch_problem(spec: SFTJobSpec) -> str | None:
    """A global batch the GPUs cannot split evenly, or a micro-batch that does not divide a GPU's share:
    refused at admission by the CRD's rules, and by the CLI (the planner would call it DoesNotFit)."""
    t, gpus = spec.training, spec.gpu.count * spec.gpu.nodes
    if t.global_batch_size is None:
        return None
    if t.global_batch_size % gpus:
        return (
            f"spec.training.globalBatchSize {t.global_batch_size} is not divisible by the job's {gpus} GPUs"
            " (spec.gpu.count x spec.gpu.nodes)"
        )
    if t.micro_batch_size is not None and (t.global_batch_size // gpus) % t.micro_batch_size:
        return (
            f"spec.training.microBatchSize {t.micro_batch_size} does not divide each GPU's share"
            f" {t.global_batch_size // gpus} of globalBatchSize {t.global_batch_size}"
        )
    return None


def tensorboard_problem(spec: SFTJobSpec) -> str | None:
    """An output in the checkpoint volume's tensorboard folder while TensorBoard writes there: refused at
    admission by the CRD's rules, and by the CLI."""
    path = spec.output.path
    if spec.tracking.tensorboard and spec.output.volume is None and re.match(TENSORBOARD_FOLDER_PATH, path):
        return (
            f"spec.output.path {path!r} is the checkpoint volume's tensorboard folder, where"
            " tracking.tensorboard writes: choose another folder, or give output a volume"
        )
    return None
