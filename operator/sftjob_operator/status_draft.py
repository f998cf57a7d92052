"""The status one reconcile pass builds, and the events its transitions post.

A pass starts from the status the job had and changes it step by step: conditions (Kubernetes API
conventions, via :func:`~sftjob_operator.conditions.set_condition`), the phase, the attempt records and
the trainer's progress and checkpoint reports. Events are derived from what changed between the old
and the new status, never from event history, so a repeated pass posts nothing new.
``reconcile._Pass`` builds on :class:`StatusDraft`; pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sftjob.attempts import AttemptRecord
from sftjob.failures import FailureClass
from sftjob.job_status import ProgressStatus, SFTJobStatus, TrackingUrls
from sftjob_operator import observe
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason, set_condition
from sftjob_operator.conditions import get as get_condition

CONDITION_MESSAGE_MAX = 4096
# Phases whose transition is a Warning event named after the reason (others: a Normal event named
# after the phase). Pending posts nothing: a new attempt announces itself with PodsCreated.
WARNING_PHASES = frozenset({"Failed", "Restarting"})


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


class StatusDraft:
    """The new status of a job, built from its old one; ``events`` collects the transitions."""

    def __init__(self, old: SFTJobStatus, *, generation: int, now: datetime) -> None:
        self.old, self.generation, self.now = old, generation, now
        self.status = old.model_copy(update={"observed_generation": generation})
        self.events: list[Event] = []

    def update(self, **fields: Any) -> None:
        self.status = self.status.model_copy(update=fields)

    def record_of(self, attempt: int) -> AttemptRecord | None:
        return next((r for r in reversed(self.status.attempts) if r.attempt == attempt), None)

    def replace_record(self, new: AttemptRecord) -> None:
        self.update(attempts=[new if r.attempt == new.attempt else r for r in self.status.attempts])

    def cond(self, type: T, status: bool | None, reason: str, message: str) -> None:
        conditions = set_condition(
            self.status.conditions,
            type=type,
            status=status,
            reason=reason,
            message=message[:CONDITION_MESSAGE_MAX],
            generation=self.generation,
            now=self.now,
        )
        self.update(conditions=conditions)

    def warn_once(self, type: T, reason: str, message: str) -> None:
        """Condition ``type`` False for ``reason``; a Warning event only when it newly says so."""
        before = get_condition(self.old.conditions, type)
        if before is None or (before.status, before.reason) != ("False", reason):
            self.events.append(Event("Warning", reason, message))
        self.cond(type, False, reason, message)

    def between_attempts(self, message: str) -> None:
        """No attempt runs and the next one starts later; ``message`` says when, or what it waits for.
        After a failure the job is Restarting; after a suspend it is Pending (a resume is no restart)."""
        last = self.status.attempts[-1] if self.status.attempts else None
        resuming = last is not None and last.ended and not last.failed
        reason = Reason.RESUMED if resuming else Reason.RESTARTING
        self.cond(T.RUNNING, False, reason, message)
        self.cond(T.SCHEDULED, False, reason, message)
        self.set_phase("Pending" if resuming else "Restarting", reason, message)

    def succeeded(self, attempt: int) -> None:
        """The trainer finished; the messages say so when early stopping ended it (the last report's
        ``plannedSteps``, spec.evaluation.earlyStopping)."""
        progress, early = self.status.progress, ""
        if progress is not None and progress.planned_steps:
            early = (
                f", stopped early at step {progress.step} of {progress.planned_steps}: the evaluation loss"
                " stopped improving"
            )
        self.cond(T.SUCCEEDED, True, Reason.COMPLETED, f"attempt {attempt} completed training{early}")
        self.cond(T.FAILED, False, Reason.COMPLETED, "")
        self.cond(T.RUNNING, False, Reason.COMPLETED, "finished")
        self.update(completion_time=self.now)
        self.set_phase("Succeeded", Reason.COMPLETED, f"training completed in attempt {attempt}{early}")

    def failed(self, attempt: int, reason: str, message: str, ended_as: FailureClass | None) -> None:
        """The job failed for ``reason``; a running ``attempt`` ends with ``ended_as`` as its class."""
        record = self.record_of(attempt)
        if record is not None and not record.ended:
            self.replace_record(
                record.model_copy(update={"end_time": self.now, "reason": ended_as, "message": message})
            )
        self.cond(T.FAILED, True, reason, message)
        self.cond(T.SUCCEEDED, False, reason, "")
        self.cond(T.RUNNING, False, reason, "failed")
        self.cond(T.SCHEDULED, False, reason, "no pods: the job failed")
        self.update(completion_time=self.status.completion_time or self.now)
        self.set_phase("Failed", reason, message)

    def set_phase(self, phase: str, reason: str, message: str) -> None:
        if phase != self.old.phase and phase != "Pending":
            warning = phase in WARNING_PHASES
            self.events.append(
                Event("Warning" if warning else "Normal", reason if warning else phase, message)
            )
        self.update(phase=phase)

    def fold_reports(self, pods: Sequence[Mapping[str, Any]]) -> None:
        """The trainer's latest progress and checkpoint annotations on ``pods`` into the status (the best
        checkpoint with the newest); an older checkpoint report (a pod of an earlier attempt) never
        replaces a newer one, and the last evaluation stays until a report carries a newer one (a
        restarted trainer's setup reports carry none); so do the trackers' run pages (one run per job:
        an attempt that has not started, or could not start, a tracker still has its page)."""
        progress = observe.progress_of(pods)
        before = self.status.progress
        if progress is not None and progress.eval_loss is None and before is not None:
            kept = {"eval_loss": before.eval_loss, "eval_step": before.eval_step}
            progress = progress.model_copy(update=kept)
        if progress is not None and before is not None and before.tracking_urls is not None:
            progress = progress.model_copy(update={"tracking_urls": _links(before, progress)})
        if progress is not None:
            self.update(progress=progress)
        checkpoint = observe.checkpoint_of(pods)
        old = self.status.last_checkpoint
        if checkpoint is not None and (old is None or checkpoint.step >= old.step):
            self.update(last_checkpoint=checkpoint)
            best = observe.best_checkpoint_of(pods)
            if best is not None:
                self.update(best_checkpoint=best)

    def transition_events(self) -> list[Event]:
        """The events of this pass: the phase transitions, and Unschedulable when the pods became so."""
        unschedulable_now = _false_reason(self.status, T.SCHEDULED) == Reason.UNSCHEDULABLE
        if unschedulable_now and _false_reason(self.old, T.SCHEDULED) != Reason.UNSCHEDULABLE:
            message = next(c.message for c in self.status.conditions if c.type == T.SCHEDULED)
            return [*self.events, Event("Warning", Reason.UNSCHEDULABLE, message)]
        return list(self.events)


def _false_reason(status: SFTJobStatus, type: str) -> str | None:
    return next((c.reason for c in status.conditions if c.type == type and c.status == "False"), None)


def _links(before: ProgressStatus, now: ProgressStatus) -> TrackingUrls:
    """The run pages of both reports, the newer one's where both have one."""
    old = before.tracking_urls.model_dump(exclude_none=True) if before.tracking_urls else {}
    new = now.tracking_urls.model_dump(exclude_none=True) if now.tracking_urls else {}
    return TrackingUrls(**(old | new))
