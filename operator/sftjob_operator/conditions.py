"""The SFTJob's condition vocabulary and the one helper that updates a condition list.

Conditions follow the Kubernetes API conventions: a list keyed by ``type``, each entry with a CamelCase
``reason``, a message, the ``observedGeneration`` it was computed for, and a ``lastTransitionTime`` that
moves only when ``status`` flips. ``status.phase`` is a summary of these for printer columns.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sftjob.job_status import Condition


class ConditionType(StrEnum):
    ADMITTED = "Admitted"  # the spec parsed and passed the operator's checks
    PLANNED = "Planned"  # a training configuration fits at least one candidate GPU
    SCHEDULED = "Scheduled"  # every pod of the current attempt is bound to a node
    RUNNING = "Running"  # every pod of the current attempt is running
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class Reason(StrEnum):
    """Condition and event reasons the operator itself sets (failure classes are reasons too)."""

    VALID_SPEC = "ValidSpec"
    INVALID_SPEC = "InvalidSpec"
    PLAN_FITS = "PlanFits"
    DOES_NOT_FIT = "DoesNotFit"
    UNKNOWN_MODEL_SIZE = "UnknownModelSize"
    CHECKPOINT_VOLUME_TOO_SMALL = "CheckpointVolumeTooSmall"
    UNKNOWN_GPU_PRODUCT = "UnknownGpuProduct"
    PODS_CREATED = "PodsCreated"
    WAITING_FOR_PODS = "WaitingForPods"
    UNSCHEDULABLE = "Unschedulable"
    QUEUED = "Queued"  # held by scheduling gates: Kueue has not admitted the pods yet (spec.queueName)
    BOUND = "PodsBound"
    STARTING = "ContainersStarting"
    TRAINING = "Training"
    RESTARTING = "Restarting"
    COMPLETED = "Completed"
    NOT_FINISHED = "NotFinished"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "SuspendedBySpec"
    RESUMED = "Resumed"
    NOT_SUSPENDED = "NotSuspended"
    FINISHED = "Finished"
    CHILD_REJECTED = "ChildRejected"  # the API server refused a pod or other child as invalid
    FAILED_CREATE = "FailedCreate"  # the API server refused a child for now (quota, Pod Security): retried
    STATUS_REPAIRED = "StatusRepaired"  # parts of the status this operator cannot read were left out


def set_condition(
    conditions: list[Condition],
    *,
    type: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[Condition]:
    """``conditions`` with ``type`` upserted; ``lastTransitionTime`` is kept unless the status changes.

    ``status`` None means Unknown. The list keeps its order (new types go last) so repeated passes
    produce identical status and the operator writes nothing when nothing changed.
    """
    value = "Unknown" if status is None else ("True" if status else "False")
    old = next((c for c in conditions if c.type == type), None)
    since = old.last_transition_time if old is not None and old.status == value else now
    new = Condition(
        type=type,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type else c for c in conditions]


def is_true(conditions: list[Condition], type: str) -> bool:
    return any(c.type == type and c.status == "True" for c in conditions)


def get(conditions: list[Condition], type: str) -> Condition | None:
    return next((c for c in conditions if c.type == type), None)
