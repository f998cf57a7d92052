"""The job-level steps of a reconcile pass, around its attempts: what the pass holds, admission and
planning, suspend, the deadline, failing, a finished job's TTL, and the actions the pass returns.

:class:`JobPass` builds the new status (:class:`~sftjob_operator.status_draft.StatusDraft`) and the
actions; ``reconcile._Pass`` adds the attempts (start, judge, restart) and runs the steps in order. An
invalid spec or a job no card can run fails the job only before its first attempt: once an attempt
started, a newer operator's stricter rule or planner (or other ``--gpu-products``) never kills it;
``Admitted`` or ``Planned`` says what is wrong, with one Warning event. Pure, no I/O.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import ValidationError

from sftjob.attempts import AttemptRecord, trimmed
from sftjob.failures import FailureClass
from sftjob.spec import SFTJobSpec, valid_job_name
from sftjob_operator import observe, pod_lifecycle
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason
from sftjob_operator.defaults import JobDefaults, effective
from sftjob_operator.planning import CandidatePlans, check_checkpoint_volume, plan_candidates, plan_status
from sftjob_operator.reconcile_io import Actions, Context, Manifest, Obj, Observed
from sftjob_operator.scheduling import selector_problem
from sftjob_operator.status import read_status, validation_message
from sftjob_operator.status_draft import Event, StatusDraft


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
        self.attempt = max([self.old.attempt, *(observe.attempt_of(p) for p in obs.pods)])
        self.current = sorted(
            (p for p in obs.pods if observe.attempt_of(p) == self.attempt), key=observe.rank_of
        )

    # --- admission and planning ----------------------------------------------------------------

    def admit(self) -> SFTJobSpec | None:
        """The spec completed with the operator's defaults, or None when it is invalid: then a job not
        started yet fails, and a started one is held as it is (``Admitted`` False says why)."""
        try:
            parsed = SFTJobSpec.model_validate(self.obs.spec)
        except ValidationError as err:
            self.reject(validation_message(err))
            return None
        if not valid_job_name(self.obs.name):
            self.reject("metadata.name must be a DNS label of at most 40 characters")
            return None
        # The operator's defaults as they were when the job was first seen, so upgrades change no job.
        recorded = self.old.effective
        spec = (JobDefaults.recorded(recorded) if recorded else self.ctx.defaults).fill(parsed)
        self.update(effective=effective(spec))
        products = self.ctx.products  # an operator reconfigured later never fails a started job for it
        if not self.status.attempts and (
            problem := selector_problem(spec.node_selector, spec.gpu.candidates(), products)
        ):
            self.reject(problem)
            return None
        self.cond(T.ADMITTED, True, Reason.VALID_SPEC, "the spec is valid")
        return spec

    def reject(self, problem: str) -> None:
        if not self.status.attempts:
            return self.fail(Reason.INVALID_SPEC, problem, admitted=False)
        # A newer operator's stricter rule: the running attempt is not killed for a spec it admitted.
        kept = "the running attempt is kept; nothing more is decided until the spec is valid"
        self.warn_once(T.ADMITTED, Reason.INVALID_SPEC, f"{problem} ({kept})")
        self.fold_reports(self.current)

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
            self.events.append(
                Event("Normal", Reason.FINISHED, f"deleting the job {ttl} s after it finished")
            )
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

    def record(self) -> AttemptRecord | None:
        return self.record_of(self.attempt)

    def actions(self) -> Actions:
        """What the pass decided; pods to delete on a node that is gone or out of service are deleted with
        force."""
        if self.check:
            return Actions(status=self.old, status_changed=False, check_pods=self.check)
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
            events=self.transition_events(),
            requeue_after=min(self.requeue) if self.requeue else None,
        )


def ttl_seconds(spec: Obj) -> int | None:
    """``spec.ttlSecondsAfterFinished`` read from the raw spec, which a finished job's need not pass
    this operator's validation; anything but a count of seconds is no TTL."""
    ttl = spec.get("ttlSecondsAfterFinished")
    return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 0 else None
