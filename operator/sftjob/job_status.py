"""The SFTJob API's ``status`` as typed models: what the operator saw and decided, written by it alone.

Read leniently (``extra="ignore"``) so an older or newer operator's status still parses; written whole
by :meth:`SFTJobStatus.to_patch`. ``status.attempts`` holds :class:`~sftjob.attempts.AttemptRecord`, the
history every restart decision is derived from. A unit test keeps the CRD and these models in step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sftjob.attempts import AttemptRecord, OnOOM, Timestamp
from sftjob.spec import DEFAULT_CHECKPOINT_SIZE

Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed"})


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel, populate_by_name=True)


class Condition(_Status):
    """One entry of ``status.conditions`` in Kubernetes API conventions form."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: Timestamp
    observed_generation: int = 0


class GpuStatus(_Status):
    summary: str = ""  # printer column: "8xA800" once landed, the request before
    type: str | None = None  # A800 | A40 | L40S, once the pods are bound
    product: str | None = None  # the node's nvidia.com/gpu.product label
    profile: str | None = None  # the GPU profile key the plan in use was made for
    count: int = 0  # GPUs per node
    nodes: list[str] = []  # nodes the current attempt's pods are bound to, by rank


class PlanStatus(_Status):
    gpu: str = ""
    summary: str = ""
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    global_batch_size: int = 0
    gradient_checkpointing: bool = False
    precision: str = ""
    estimated_peak_gib: float = Field(default=0.0, alias="estimatedPeakGiB")
    capacity_gib: float = Field(default=0.0, alias="capacityGiB")
    fits: bool = False


class TrackingUrls(_Status):
    """The pages of the job's runs in its experiment trackers (spec.tracking), as the trainer reports them."""

    mlflow: str | None = None
    wandb: str | None = None


class ProgressStatus(_Status):
    step: int = 0
    total_steps: int = 0
    planned_steps: int | None = None  # early stopping ended the run at total_steps of these
    epoch: float = 0.0
    loss: float | None = None
    learning_rate: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: int | None = None
    eval_loss: float | None = None  # spec.evaluation's loss, measured at eval_step
    eval_step: int | None = None
    updated: Timestamp | None = None
    summary: str = ""  # printer column: "120/1000"
    tracking_urls: TrackingUrls | None = None


class CheckpointStatus(_Status):
    step: int
    path: str
    eval_loss: float | None = None
    time: Timestamp | None = None


class EffectiveCheckpoints(_Status):
    storage_class_name: str | None = None  # None: the cluster's default StorageClass
    size: str = DEFAULT_CHECKPOINT_SIZE


class EffectiveRestartPolicy(_Status):
    max_restarts: int = 0
    backoff_seconds: int = 0
    on_oom: OnOOM = Field(default="Replan", alias="onOOM")


class EffectiveSettings(_Status):
    """``status.effective``: the settings the operator's defaults may fill, as they apply to this job."""

    checkpoints: EffectiveCheckpoints = EffectiveCheckpoints()
    restart_policy: EffectiveRestartPolicy = EffectiveRestartPolicy()


class SFTJobStatus(_Status):
    phase: Phase = "Pending"
    conditions: list[Condition] = []
    observed_generation: int = 0
    attempt: int = 0  # the current attempt (pod generation); 0 before the first pods
    restarts: int = 0
    gpu: GpuStatus = GpuStatus()
    plan: PlanStatus | None = None
    progress: ProgressStatus | None = None
    last_checkpoint: CheckpointStatus | None = None
    best_checkpoint: CheckpointStatus | None = None  # finalModel Best: the lowest eval loss saved so far
    attempts: list[AttemptRecord] = []
    effective: EffectiveSettings | None = None
    start_time: Timestamp | None = None
    completion_time: Timestamp | None = None

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def to_patch(self) -> dict[str, object]:
        """The JSON the operator writes to the status subresource."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
