"""The job-level steps of a reconcile pass, around its attempts: what the pass holds, admission and
planning, suspend, the deadline, failing, a finished job's TTL, and the actions the pass returns.

:class:`JobPass` builds the new status (:class:`~sftjob_operator.status_draft.StatusDraft`) and the
actions; ``reconcile._Pass`` adds the attempts (start, judge, restart) and runs the steps in order. An
invalid spec or a job no card can run fails the job only before its first attempt: once an attempt
started, a newer operator's stricter rule or planner (or other ``--gpu-products``) never kills it;
``Admitted`` or ``Planned`` says what is wrong, with one Warning event. A started job whose spec is now
invalid is *held*: the spec can no longer change (the CRD allows only suspend, the deadline and the TTL),
so its running attempt is observed to its end with the plan and ConfigMap it runs with (:func:`held_spec`)
while the deadline still applies, and no new attempt starts: suspending it ends it (it fails when
resumed), and so does a pod it never had (it cannot create one). Pure, no I/O.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from sftjob.attempts import AttemptRecord, trimmed
from sftjob.failures import FailureClass
from sftjob.gpu_products import selector_problem
from sftjob.spec import GpuSpec, RestartPolicySpec, SFTJobSpec, valid_job_name
from sftjob_operator import observe, pod_lifecycle
from sftjob_operator.attempt_end import describe_failure
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason
from sftjob_operator.defaults import JobDefaults, effective
from sftjob_operator.planning import CandidatePlans, check_checkpoint_volume, plan_candidates, plan_status
from sftjob_operator.reconcile_io import Actions, Context, Manifest, Obj, Observed
from sftjob_operator.status import read_status, validation_message
from sftjob_operator.status_draft import Event, StatusDraft

# What ``Admitted`` adds to the problem of a held job (see the module's docstring).
HELD = (
    "the spec can no longer change: the running attempt is observed to its end, activeDeadlineSeconds"
    " still applies, suspending it ends it (it fails when resumed), and no new attempt can start"
)


class JobPass(StatusDraft):
    """A reconcile pass's state (its observation, the status it builds, the actions it gathers) and
    its job-level steps; no I/O."""

    def __init__(self, obs: Observed, ctx: Context) -> None:
        old, self.repairs = read_status(obs.status)
        super().__init__(old, generation=obs.generation, now=obs.now)
        self.obs, self.ctx = obs, ctx
        if self.repairs:  # said once: the repaired status is written back (``actions``)
            self.events.append(Event("Warning", Reason.STATUS_REPAIRED, "; ".join(self.repairs)))
        self.children: list[Manifest] = []
        self.deletes: list[str] = []
        self.delete_job = False
        self.requeue: list[float] = []
        self.check: list[str] = []
        self.unplanned = ""  # why a started job cannot be planned now (its running attempt is kept)
        self.held = ""  # the rule a started job's spec now breaks (no new attempt can start)
        self.attempt = max([self.old.attempt, *(observe.attempt_of(p) for p in obs.pods)])
        self.current = sorted(
            (p for p in obs.pods if observe.attempt_of(p) == self.attempt), key=observe.rank_of
        )

    # --- admission and planning ----------------------------------------------------------------

    def admit(self) -> SFTJobSpec | None:
        """The spec completed with the operator's defaults, or None when it is invalid and the job fails:
        a job not started yet, or a started one whose running attempt cannot even be read (see
        :meth:`reject`)."""
        try:
            parsed = SFTJobSpec.model_validate(self.obs.spec)
        except ValidationError as err:
            return self.reject(validation_message(err))
        if not valid_job_name(self.obs.name):
            return self.reject("metadata.name must be a DNS label of at most 40 characters")
        spec = self.defaults().fill(parsed)
        self.update(effective=effective(spec))
        products = self.ctx.products  # an operator reconfigured later never fails a started job for it
        if not self.status.attempts and (
            problem := selector_problem(spec.node_selector, spec.gpu.candidates(), products)
        ):
            return self.reject(problem)
        self.cond(T.ADMITTED, True, Reason.VALID_SPEC, "the spec is valid")
        return spec

    def defaults(self) -> JobDefaults:
        """The operator's defaults as they were when the job was first seen, so upgrades change no job."""
        recorded = self.old.effective
        return JobDefaults.recorded(recorded) if recorded else self.ctx.defaults

    def reject(self, problem: str) -> SFTJobSpec | None:
        """Fails a job not started yet; holds a started one (``self.held``) and returns the spec its
        running attempt is observed with."""
        if not self.status.attempts:
            self.fail(Reason.INVALID_SPEC, problem, admitted=False)
            return None
        spec = held_spec(self.obs.spec)
        if spec is None:  # the fields saying how the attempt runs cannot even be read (held_spec)
            self.fail(
                Reason.INVALID_SPEC, f"{problem}; the running attempt cannot be observed", admitted=False
            )
            return None
        self.held = problem
        self.warn_once(T.ADMITTED, Reason.INVALID_SPEC, f"{problem} ({HELD})")
        return self.defaults().fill(spec)

    def fail_held(self, why: str = "") -> None:
        """A held job's attempt is over without success (or it was suspended and resumed), or cannot go on
        (``why``: a pod is missing that only a new attempt could create): the job fails."""
        last = self.status.attempts[-1] if self.status.attempts else None
        ended = why or (describe_failure(last) if last is not None and last.failed else "")
        message = f"{ended}; " if ended else ""
        message += f"no new attempt can start: this operator rejects the spec: {self.held}"
        self.fail(Reason.INVALID_SPEC, message, admitted=False)

    def plan(self, spec: SFTJobSpec) -> CandidatePlans:
        plans = plan_candidates(spec, self.ctx.products, self.ctx.plan_fn)
        if not self.status.attempts:  # checked before the first attempt, never under a running job
            check_checkpoint_volume(spec, plans)
        self.cond(T.PLANNED, True, Reason.PLAN_FITS, f"fits on {', '.join(plans.fitting)}")
        if self.status.plan is None:
            self.update(plan=plan_status(plans.first))
        return plans

    # --- job-level transitions -----------------------------------------------------------------

    def suspend(self) -> None:
        self.deletes += [observe.name(p) for p in self.current]
        # Until they are gone, the suspended attempt's pods report the checkpoint saved on SIGTERM.
        self.fold_reports(self.current)
        record = self.record()
        if record is not None and not record.ended:
            self.replace_record(record.model_copy(update={"end_time": self.now, "message": "suspended"}))
        # A suspended attempt's record weighs on no decision: without end, they would fill the status.
        self.update(attempts=trimmed(self.status.attempts))
        self.cond(T.SUSPENDED, True, Reason.SUSPENDED, "spec.suspend is true: pods deleted, checkpoints kept")
        self.cond(T.RUNNING, False, Reason.SUSPENDED, "suspended")
        self.cond(T.SCHEDULED, False, Reason.SUSPENDED, "no pods: the job is suspended")
        # Like a Job, a resumed SFTJob's activeDeadlineSeconds counts from the resume.
        self.update(start_time=None)
        self.set_phase("Suspended", Reason.SUSPENDED, "spec.suspend is true")

    def finished(self) -> None:
        """A finished job keeps only its last attempt's ended pods (their logs and exit codes); an
        operator killed after writing the final status may have left older or running ones. Its spec is
        not judged again (a newer operator's rules change no finished job): only its TTL is read."""
        self.deletes += [
            observe.name(p)
            for p in self.obs.pods
            if observe.is_active(p) or observe.attempt_of(p) < self.attempt
        ]
        ttl, done = ttl_seconds(self.obs.spec), self.status.completion_time
        if ttl is None or done is None:
            return
        left = (done + timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.delete_job = True
        else:
            self.requeue.append(left)

    def deadline_passed(self, spec: SFTJobSpec) -> bool:
        limit, since = spec.active_deadline_seconds, self.status.start_time
        if limit is None or since is None:
            return False
        left = (since + timedelta(seconds=limit) - self.now).total_seconds()
        if left > 0:
            self.requeue.append(left)
        return left <= 0

    def fail(
        self, reason: str, message: str, *, admitted: bool = True, ended_as: FailureClass | None = None
    ) -> None:
        if not admitted:
            self.cond(T.ADMITTED, False, reason, message)
        self.deletes += [observe.name(p) for p in self.obs.pods if observe.is_active(p)]
        self.failed(self.attempt, reason, message, ended_as)

    def job_deleted(self) -> Event | None:
        """The event of the TTL's delete, posted once that delete went through (``Actions.job_deleted``)."""
        if not self.delete_job:
            return None
        return Event(
            "Normal", Reason.FINISHED, f"deleted the job {ttl_seconds(self.obs.spec)} s after it finished"
        )

    def record(self) -> AttemptRecord | None:
        return self.record_of(self.attempt)

    def actions(self) -> Actions:
        """What the pass decided; pods to delete on a node that is gone or out of service are deleted with
        force. Every condition is said to hold at the pass's generation, the ones it did not touch too
        (a suspended job's Succeeded, a finished job's after its TTL changed): the pass judged them
        still true, and a client waiting for a condition at the job's generation must see it there."""
        if self.check:
            return Actions(status=self.old, status_changed=False, check_pods=self.check)
        observed = [
            c.model_copy(update={"observed_generation": self.generation}) for c in self.status.conditions
        ]
        self.update(conditions=observed)
        deleting = {observe.name(p) for p in self.obs.pods if p["metadata"].get("deletionTimestamp")}
        lost = pod_lifecycle.on_gone_nodes(self.obs.pods, self.obs.nodes)
        force = (set(self.deletes) | deleting) & lost  # a graceful delete there never completes
        return Actions(
            status=self.status,
            status_changed=self.status != self.old or bool(self.repairs),
            children=self.children,
            delete_pods=sorted(set(self.deletes) - deleting - force),
            force_delete_pods=sorted(force),
            delete_job=self.delete_job,
            job_deleted=self.job_deleted(),
            events=self.transition_events(),
            requeue_after=min(self.requeue) if self.requeue else None,
        )


def ttl_seconds(spec: Obj) -> int | None:
    """``spec.ttlSecondsAfterFinished`` read from the raw spec, which a finished job's need not pass
    this operator's validation; anything but a count of seconds is no TTL."""
    ttl = spec.get("ttlSecondsAfterFinished")
    return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 0 else None


class _GpuAsWritten(BaseModel):
    """``spec.gpu`` as written: its JSON types, counts of at least one, and no other rule."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    type: str | None = None
    types: list[str] | None = None
    count: int | None = Field(default=None, ge=1)
    nodes: int | None = Field(default=None, ge=1)


class _RestartAsWritten(BaseModel):
    """``spec.restartPolicy`` as written, as far as observing an attempt reads it (its stall timeout)."""

    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel, populate_by_name=True)

    stall_timeout_seconds: int | None = Field(default=None, ge=0)


class _AsWritten(BaseModel):
    """The spec fields that say how a started attempt runs and when it must stop, as written: their JSON
    types and the bounds without which a value means nothing, but none of this operator's other rules.
    The operator that started the attempt accepted them and the spec cannot have changed since (but for
    suspend and the deadline), so they are what the attempt runs with even where this one rejects them.
    Everything else (unknown keys included) is ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, alias_generator=to_camel, populate_by_name=True)

    gpu: _GpuAsWritten = _GpuAsWritten()
    restart_policy: _RestartAsWritten = _RestartAsWritten()
    image: str | None = None
    queue_name: str | None = None
    suspend: bool = False
    active_deadline_seconds: int | None = Field(default=None, ge=1)


def held_spec(raw: Obj) -> SFTJobSpec | None:
    """The spec a held job's running attempt is observed with: its pods' count and placement, the stall
    timeout, the image, the queue, suspend and the deadline (:class:`_AsWritten`), read from a spec the
    model rejects, even for a rule on these very fields. None when even their JSON types are wrong.
    ``model`` and ``dataset`` stay unset (nothing that observes an attempt reads them), so this spec is
    never planned or rendered."""
    try:
        held = _AsWritten.model_validate(raw)
    except ValidationError:
        return None
    running: dict[str, Any] = {
        "gpu": GpuSpec.model_construct(**held.gpu.model_dump(exclude_none=True)),
        # Set fields only: an explicit null stall timeout disables it; unset ones get the defaults.
        "restart_policy": RestartPolicySpec.model_construct(
            **held.restart_policy.model_dump(exclude_unset=True)
        ),
        **held.model_dump(include={"image", "queue_name", "suspend", "active_deadline_seconds"}),
    }
    return SFTJobSpec.model_construct(**running)
