"""What a job's checkpoint volume must hold at its fullest, so a claim too small fails at admission time
instead of at the first save that fills it, hours into the run.

The volume holds ``spec.checkpoints.keep`` complete checkpoints plus the one being written (a save
writes a temporary folder before the oldest is deleted), one more with ``spec.evaluation.finalModel``
Best (the best checkpoint is kept out of the rotation), the final model when ``spec.output`` has no
volume of its own (with ``mergeAdapter``, the merged model too), and the hub download of the model
(``HF_HOME`` lives on it, so a restart does not download again). Checkpoint sizes are the plan's
(:attr:`~sftjob.plan.Plan.checkpoint_gib`, what the trainer writes); the dataset's cache is not counted,
so the figure is a floor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from sftjob.kube_names import POSITIVE_QUANTITY, QUANTITY_RULE
from sftjob.memory import BF16_BYTES, FULL_STATE_BYTES, GIB
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec, to_plan_request

# The suffixes the spec's quantity pattern admits (CPU and memory alike), as multiples of one unit.
QUANTITY_SCALE = {
    "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}  # fmt: skip
# How an unset spec.checkpoints.size is named: the operator filled it with its own default ({size}).
OPERATOR_DEFAULT_CLAIM = (
    "the default checkpoint claim ({size}, the operator's default: status.effective shows it)"
)


@dataclass(frozen=True)
class VolumeNeed:
    checkpoints: int  # keep + 1 (+ 1: the best one, kept apart)
    checkpoints_gib: float
    final_model_gib: float  # 0 when spec.output has its own volume
    download_gib: float  # the model from the hub (0 for a model on a volume)

    @property
    def total_gib(self) -> float:
        return self.checkpoints_gib + self.final_model_gib + self.download_gib

    def describe(self, keep: int, checkpoint_gib: float) -> str:
        best = " + 1 (the best)" if self.checkpoints > keep + 1 else ""
        parts = [f"{keep} + 1{best} checkpoints of {checkpoint_gib:.1f} GiB"]
        if self.final_model_gib:
            parts.append(f"the final model {self.final_model_gib:.1f} GiB")
        if self.download_gib:
            parts.append(f"the model download {self.download_gib:.1f} GiB")
        return ", ".join(parts)


def volume_need(spec: SFTJobSpec, plan: Plan) -> VolumeNeed:
    architecture = to_plan_request(spec, spec.gpu.count, spec.gpu.nodes).architecture
    n = architecture.parameters
    if spec.output.volume is not None:
        final = 0.0
    elif spec.method == "full":
        # Written in the precision it trained in (trainer/sftjob_trainer/output.py ``save_output``).
        trained_in = FULL_STATE_BYTES["weights"] if plan.training.precision == "fp32" else BF16_BYTES
        final = n * trained_in / GIB
    else:
        lora = spec.lora
        final = architecture.lora_parameters(lora.r, lora.target_modules) * FULL_STATE_BYTES["weights"] / GIB
        if spec.output.merge_adapter:  # the base beside it, the adapter merged in, as it computed
            final += (
                n * (FULL_STATE_BYTES["weights"] if plan.training.precision == "fp32" else BF16_BYTES) / GIB
            )
    download = n * BF16_BYTES / GIB if spec.model.name else 0.0  # hub checkpoints ship in bf16
    best = spec.evaluation is not None and spec.evaluation.final_model == "Best"
    count = spec.checkpoints.keep + 1 + int(best)
    return VolumeNeed(count, count * plan.checkpoint_gib, final, download)


def too_small(spec: SFTJobSpec, plan: Plan, default_claim: str = OPERATOR_DEFAULT_CLAIM) -> str | None:
    """Why the claim the operator will make (``spec.checkpoints.size``) cannot hold the run, or None
    (also when the spec brings its own volume, whose size the operator cannot know). ``default_claim``
    names a size the spec leaves unset ({size}: the default it was filled with) as the asker knows it."""
    if spec.checkpoints.volume is not None:
        return None
    need = volume_need(spec, plan)
    size = quantity_gib(spec.checkpoints.size)
    if size >= need.total_gib:
        return None
    suggest = 10 * math.ceil(need.total_gib * 1.1 / 10)
    claim = (
        f"spec.checkpoints.size {spec.checkpoints.size}"
        if "size" in spec.checkpoints.model_fields_set
        else default_claim.format(size=spec.checkpoints.size)
    )
    return (
        f"{claim} cannot hold the run: it needs about"
        f" {need.total_gib:.0f} GiB ({need.describe(spec.checkpoints.keep, plan.checkpoint_gib)});"
        f" set spec.checkpoints.size to {suggest}Gi or more, or keep fewer checkpoints"
    )


def quantity_value(quantity: str) -> float:
    """A quantity the spec's pattern admits (``8``, ``500m``, ``100Gi``, ``1.5Ti``, ``67108864Ki``) as a
    number of units: cores for a CPU, bytes for memory. Raises ValueError for any other text."""
    match = re.match(POSITIVE_QUANTITY, quantity)  # the pattern the CRD and the spec model check
    if match is None:
        raise ValueError(f"{quantity!r} is not {QUANTITY_RULE}")
    number, *_, suffix = match.groups()
    return float(number) * QUANTITY_SCALE[suffix or ""]


def quantity_gib(quantity: str) -> float:
    """A memory quantity (``100Gi``, ``1.5Ti``, ``500G``) in GiB."""
    return quantity_value(quantity) / GIB
