"""The attempt history (``status.attempts``) and the restart policy (``spec.restartPolicy``).

Every pod generation of a job is one attempt. The operator appends a record when it starts an
attempt and fills in how it ended; restart decisions are derived from this history alone, which
lives in the API server, so an operator restarted mid-backoff or mid-re-plan decides exactly as
before. Both models read and write camelCase, like the rest of the SFTJob.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from sftjob.failures import FREE_RESTART, NODE_FAULT, FailureClass

OnOOM = Literal["Replan", "Retry", "Fail"]

# The CRD's maxItems on status.attempts: the API server refuses every status write with more records.
ATTEMPTS_MAX_ITEMS = 1200
# The newest records stay whatever they say; older ones only when a restart decision reads them.
ATTEMPTS_KEPT_NEWEST = 100
# A GPU or driver fault class that ended attempts on this many distinct nodes follows the job, not a node.
NODE_FAULTS_FOLLOW_THE_JOB = 2
GPU_FAULT = frozenset({FailureClass.GPU_UNAVAILABLE, FailureClass.DRIVER_MISMATCH})
# The largest restartPolicy.maxBackoffSeconds a job may set.
MAX_BACKOFF_LIMIT = 86400


def _utc(value: datetime) -> datetime:
    """A time without a zone (a trainer of the user's own image reporting ``utcnow()``, a hand-edited
    status) is read as UTC: compared with the operator's own times it would otherwise raise."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


Timestamp = Annotated[datetime, AfterValidator(_utc)]


class RestartPolicy(BaseModel):
    """``spec.restartPolicy``: how many failed attempts a job gets and how long it waits between them."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    max_restarts: int = Field(
        default=3, ge=0, le=100, description="Restarts after failures that are the job's own."
    )
    backoff_seconds: int = Field(
        default=10, ge=0, le=3600, description="Wait before the first retry; doubles each retry."
    )
    max_backoff_seconds: int = Field(
        default=600, ge=1, le=MAX_BACKOFF_LIMIT, description="Upper bound on the wait."
    )
    on_oom: OnOOM = Field(
        default="Replan",
        description="After CUDA OOM: Replan down the memory ladder, Retry the same plan, or Fail the job.",
    )
    max_interruptions: int = Field(
        default=20,
        ge=0,
        le=1000,
        description="Restarts after preemption, node loss or a node's GPU or driver fault; they do not count"
        " against maxRestarts (once a GPU or driver fault is seen on two nodes it follows the job, and later"
        " ones count).",
    )
    stall_timeout_seconds: int | None = Field(
        default=1800,
        ge=0,
        le=86400,
        description="End an attempt that reports no progress for this long while Running (at least 60);"
        " 0 or null disables.",
    )

    @property
    def stall_timeout(self) -> int | None:
        """Seconds without progress that end an attempt; None when disabled (0 or null)."""
        return self.stall_timeout_seconds or None

    @model_validator(mode="after")
    def _backoff_within_cap(self) -> RestartPolicy:
        if self.stall_timeout_seconds is not None and 0 < self.stall_timeout_seconds < 60:
            seconds = self.stall_timeout_seconds
            raise ValueError(f"restartPolicy.stallTimeoutSeconds {seconds}: at least 60, or 0 to disable")
        # Only a backoff the user set is an error; the operator caps its own default (defaults.py).
        if "backoff_seconds" in self.model_fields_set and self.backoff_seconds > self.max_backoff_seconds:
            raise ValueError(
                f"restartPolicy.backoffSeconds {self.backoff_seconds} exceeds"
                f" restartPolicy.maxBackoffSeconds {self.max_backoff_seconds}"
            )
        return self


class AttemptRecord(BaseModel):
    """One entry of ``status.attempts``: one pod generation, from creation to its classified end."""

    model_config = ConfigDict(frozen=True, alias_generator=to_camel, populate_by_name=True)

    attempt: int = Field(ge=1)  # 1 for the first pods
    node: str | None = None  # the node whose pod ended the attempt (rank 0 while it runs)
    node_rank: int | None = Field(default=None, ge=0)  # that pod's node rank, once the attempt ended
    gpu: str | None = None  # GPU profile key the attempt was planned for (the OOM ladder is per GPU)
    start_time: Timestamp | None = None
    end_time: Timestamp | None = None
    succeeded: bool = False
    reason: FailureClass | None = None  # set when the attempt failed
    exit_code: int | None = None
    message: str = ""
    resumed_from_step: int | None = None  # checkpoint step the attempt started from
    lost_steps: int | None = None  # steps done since the last complete checkpoint when it ended
    plan: str = ""  # Plan.summary() of what the attempt ran with
    ladder_step: str | None = None  # the OOM re-plan step this attempt ran with, if any

    @property
    def ended(self) -> bool:
        return self.end_time is not None

    @property
    def failed(self) -> bool:
        return self.ended and self.reason is not None

    @property
    def interrupted(self) -> bool:
        """Ended by preemption or node loss: restarted at once."""
        return self.reason in FREE_RESTART


def not_the_jobs_fault(history: Sequence[AttemptRecord]) -> list[bool]:
    """For each record: ended by preemption, node loss, or a node whose GPUs or driver failed, and so
    counted against ``maxInterruptions``, never against ``maxRestarts``.

    A GPU or driver fault follows the job rather than a node once its class has ended attempts on
    :data:`NODE_FAULTS_FOLLOW_THE_JOB` distinct nodes: an image built for a newer CUDA than the drivers
    have, a PyTorch without CUDA, a driver requirement no node meets. Every later failure of that class
    is then the job's own. Derived from the history alone, so the verdict is the same on every pass.
    """
    seen: dict[FailureClass, set[str]] = {cls: set() for cls in GPU_FAULT}
    verdicts = []
    for record in history:
        nodes = seen.get(record.reason) if record.reason else None
        on_enough = nodes is not None and len(nodes) >= NODE_FAULTS_FOLLOW_THE_JOB
        verdicts.append(record.reason in FREE_RESTART or (record.reason in NODE_FAULT and not on_enough))
        if nodes is not None and record.node:
            nodes.add(record.node)
    return verdicts


def follows_the_job(history: Sequence[AttemptRecord]) -> tuple[FailureClass, list[str]] | None:
    """The GPU or driver fault class that ended the last attempt and the nodes it ended attempts on, when
    it follows the job (:func:`not_the_jobs_fault`); None otherwise."""
    cls = history[-1].reason if history else None
    if cls is None or cls not in GPU_FAULT or not_the_jobs_fault(history)[-1]:
        return None
    return cls, sorted({r.node for r in history if r.reason is cls and r.node})


def trimmed(records: Sequence[AttemptRecord]) -> list[AttemptRecord]:
    """``status.attempts`` without the records no restart decision reads, so that suspending and
    resuming a job without end never fills it up.

    Those are the attempts that ended without failing (suspended), except the first record and the
    newest :data:`ATTEMPTS_KEPT_NEWEST`. Every failed record stays: each counts toward a budget, the OOM
    ladder, the memory raised or the nodes avoided, and the budgets bound how many there are
    (``maxRestarts`` + ``maxInterruptions`` + 2 and the ladders' rungs, fewer than
    :data:`ATTEMPTS_MAX_ITEMS`). Should they leave too little room (one below the limit: the attempt
    started next appends its record), suspended records among the newest go as well, oldest first, but
    never the newest two: the last attempt and the one before it, which the decisions read. Decisions on
    the trimmed history are the ones on the whole history.
    """
    newest = len(records) - ATTEMPTS_KEPT_NEWEST
    droppable = [i for i, r in enumerate(records[:-2]) if i > 0 and r.ended and not r.failed]
    drop = {i for i in droppable if i < newest}
    over = len(records) - len(drop) - (ATTEMPTS_MAX_ITEMS - 1)  # room for the resumed attempt's record
    drop.update([i for i in droppable if i >= newest][: max(0, over)])
    return [r for i, r in enumerate(records) if i not in drop]
