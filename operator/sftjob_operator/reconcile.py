"""The one level-based reconcile: an SFTJob and the pods and nodes it can see in, what to do out.

``reconcile`` is pure. It reads the desired state (the spec), the observed state (the job's status,
its pods and their nodes from the operator's indexes) and the time, and returns the new status plus
the children to create and the pods to delete. It never looks at events or remembers anything, so a
pass after an operator crash decides what the lost pass would have. A status it cannot fully read
(another operator version's, or edited by hand) is read as far as it can be (``status.read_status``)
and attempt numbers never go backwards, so a damaged history never starts a second trainer beside the
running one. The steps, in order:

1. parse the spec (invalid: Failed/InvalidSpec), complete it with the operator's defaults (kept in
   ``status.effective``) and plan it for every candidate GPU (nothing fits: Failed/DoesNotFit);
   finished jobs only wait for their TTL;
2. ``spec.suspend``: delete the pods, keep everything else; ``activeDeadlineSeconds`` exceeded: Failed;
3. no attempt under way: ask the attempt policy for the next one and start it (status first, so the
   attempt number is recorded before its pods exist), or wait for its backoff, or fail;
4. an attempt under way: classify its pods; when it is over, record how it ended and go to 3;
   otherwise create whatever pod is missing and report scheduling, GPU, plan and progress.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, timedelta

from pydantic import ValidationError

from sftjob.attempts import AttemptRecord
from sftjob.config import JobRef
from sftjob.failures import FailureClass
from sftjob.spec import SFTJobSpec, valid_job_name
from sftjob_operator import builders, observe, pods
from sftjob_operator.attempt_policy import GiveUp, NextAttempt, numbered
from sftjob_operator.classify import (
    Classification,
    Outcome,
    classify_attempt,
    classify_pod,
    describe_failure,
    end_record,
    running_since,
)
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason
from sftjob_operator.conditions import get as get_condition
from sftjob_operator.defaults import JobDefaults, effective
from sftjob_operator.planning import (
    CandidatePlans,
    PlanningError,
    check_checkpoint_volume,
    plan_candidates,
    plan_status,
)
from sftjob_operator.reconcile_io import Actions, Context, Manifest, Obj, Observed
from sftjob_operator.scheduling import node_affinity, selector_problem
from sftjob_operator.status import gpu_status, node_of_rank, read_status, validation_message
from sftjob_operator.status_draft import Event, StatusDraft

# A pod of the current attempt that the index has not shown within this long after the attempt
# started is looked up directly (``Actions.check_pods``): only the API server's 404 (``Observed.gone``)
# says it was deleted behind the operator's back; the index alone may simply be behind under load.
# Only pods the status once showed bound are judged so: a pod missing before that may never have been
# created (its create failed, or the operator stopped between the status write and the creates) and
# is created again.
POD_APPEARANCE_GRACE = timedelta(seconds=60)
# Pods created by the pass that started the attempt take a moment to reach the index; only after this
# long is a missing pod re-created (after an operator crash between the status write and the pods).
POD_INDEX_SETTLE = timedelta(seconds=3)


def reconcile(obs: Observed, ctx: Context) -> Actions:
    run = _Pass(obs, ctx)
    run.run()
    return run.actions()


class _Pass(StatusDraft):
    """One reconcile pass: accumulates the new status (:class:`StatusDraft`) and actions; no I/O."""

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
        self.attempt = max([self.old.attempt, *(observe.attempt_of(p) for p in obs.pods)])
        self.current = sorted(
            (p for p in obs.pods if observe.attempt_of(p) == self.attempt), key=observe.rank_of
        )

    # --- the steps ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            parsed = SFTJobSpec.model_validate(self.obs.spec)
        except ValidationError as err:
            return self.fail(Reason.INVALID_SPEC, validation_message(err), admitted=False)
        # The operator's defaults as they were when the job was first seen, so upgrades change no job.
        recorded = self.old.effective
        spec = (JobDefaults.recorded(recorded) if recorded else self.ctx.defaults).fill(parsed)
        self.update(effective=effective(spec))
        if not valid_job_name(self.obs.name):
            return self.fail(
                Reason.INVALID_SPEC, "metadata.name must be a DNS label of at most 40 characters"
            )
        products = self.ctx.products  # an operator reconfigured later never fails a started job for it
        if not self.status.attempts and (
            problem := selector_problem(spec.node_selector, spec.gpu.candidates(), products)
        ):
            return self.fail(Reason.INVALID_SPEC, problem)
        self.cond(T.ADMITTED, True, Reason.VALID_SPEC, "the spec is valid")
        if self.status.finished:
            return self.finished(spec)
        try:
            plans = plan_candidates(spec, self.ctx.products, self.ctx.plan_fn)
            if not self.status.attempts:  # checked before the first attempt, never under a running job
                check_checkpoint_volume(spec, plans)
        except PlanningError as err:
            self.cond(T.PLANNED, False, err.reason, err.message)
            return self.fail(err.reason, err.message)
        self.cond(T.PLANNED, True, Reason.PLAN_FITS, f"fits on {', '.join(plans.fitting)}")
        if self.status.plan is None:
            self.update(plan=plan_status(plans.first))
        self.deletes += [observe.name(p) for p in self.obs.pods if observe.attempt_of(p) < self.attempt]

        if spec.suspend:
            return self.suspend(spec)
        self.cond(T.SUSPENDED, False, Reason.NOT_SUSPENDED, "")
        if self.deadline_passed(spec):
            return self.fail(
                Reason.DEADLINE_EXCEEDED,
                f"the job ran longer than activeDeadlineSeconds {spec.active_deadline_seconds}",
                ended_as=FailureClass.DEADLINE_EXCEEDED,
            )
        record = self.record()
        if record is None or record.ended:
            return self.next_attempt(spec, plans)
        return self.under_way(spec, plans, record)

    def next_attempt(self, spec: SFTJobSpec, plans: CandidatePlans) -> None:
        # The ended attempt's pods may still be saving a checkpoint (SIGTERM after a suspend): the
        # next attempt records the newest one it knows as where it resumes from.
        self.fold_reports(self.current)
        decision = self.ctx.attempt_policy(
            spec, self.status.attempts, plans, nodes=self.obs.nodes, now=self.now
        )
        if isinstance(decision, GiveUp):
            return self.fail(decision.reason, decision.message)
        decision = numbered(decision, self.status.attempts, current=self.attempt)
        if decision.not_before is not None and decision.not_before > self.now:
            self.requeue.append((decision.not_before - self.now).total_seconds())
            # The start time, not a countdown: the condition stays the same from pass to pass.
            at = decision.not_before.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            message = f"attempt {decision.attempt} starts at {at}. {decision.message}".strip()
            self.cond(T.RUNNING, False, Reason.RESTARTING, message)
            self.cond(T.SCHEDULED, False, Reason.RESTARTING, "no pods between attempts")
            self.set_phase("Restarting", Reason.RESTARTING, message)
            return None
        self.start(spec, decision)

    def start(self, spec: SFTJobSpec, decision: NextAttempt) -> None:
        """Record attempt N, then create its children; older attempts' pods go."""
        self.attempt = decision.attempt
        last_cp = self.status.last_checkpoint
        record = AttemptRecord(
            attempt=decision.attempt,
            gpu=decision.plans.first.gpu,
            start_time=self.now,
            resumed_from_step=last_cp.step if last_cp else None,
            plan=decision.plans.first.summary(),
            ladder_step=decision.ladder_step,
        )
        # A restart, unless it takes over the attempt ``status.attempt`` already counted (``numbered``).
        restarted = (
            decision.attempt > self.old.attempt
            and bool(self.status.attempts)
            and self.status.attempts[-1].failed
        )
        self.update(
            attempt=decision.attempt,
            attempts=[*self.status.attempts, record],
            restarts=self.status.restarts + (1 if restarted else 0),
            start_time=self.status.start_time or self.now,
            plan=plan_status(decision.plans.first),
        )
        self.deletes += [observe.name(p) for p in self.obs.pods if observe.attempt_of(p) < decision.attempt]
        self.children = self.render(spec, decision, ranks=list(range(spec.gpu.nodes)))
        what = f"attempt {decision.attempt}: creating {spec.gpu.nodes} pod(s) for {spec.gpu.describe()}"
        self.events.append(Event("Normal", Reason.PODS_CREATED, f"{what}. {decision.message}".strip()))
        # The status the next pass would write while the pods are on their way, written now in one go.
        self.current = [p for p in self.obs.pods if observe.attempt_of(p) == decision.attempt]
        self.cond(T.SCHEDULED, False, Reason.WAITING_FOR_PODS, "waiting for the scheduler")
        self.observe_running(spec, decision.plans, record)

    def under_way(self, spec: SFTJobSpec, plans: CandidatePlans, record: AttemptRecord) -> None:
        history = [r for r in self.status.attempts if r.attempt < record.attempt]
        rendering = self.ctx.attempt_policy(spec, history, plans, nodes=self.obs.nodes, now=self.now)
        if isinstance(rendering, GiveUp):  # the policy changed its mind about a running attempt
            return self.fail(rendering.reason, rendering.message)
        rendering = replace(rendering, attempt=record.attempt)  # its pods' names, whatever history was lost
        by_rank = {observe.rank_of(p): p for p in self.current}
        missing = [r for r in range(spec.gpu.nodes) if r not in by_rank]
        # A pod whose create the API server refused (FailedCreate) was never there, nor one the status
        # never showed bound (an operator stopped before creating it): retry, never judge it.
        grace_over = (
            self.all_bound_once(spec)
            and not self.failed_create()
            and (record.start_time is None or self.now - record.start_time > POD_APPEARANCE_GRACE)
        )
        names = {r: builders.pod_name(self.obs.name, record.attempt, r) for r in missing}
        if grace_over:
            self.check = [names[r] for r in missing if names[r] not in self.obs.gone]
            if self.check:  # the index may be behind: decide once the API server has been asked
                return None
        verdicts = [
            self.classify(spec, by_rank.get(r), r)
            for r in range(spec.gpu.nodes)
            if r in by_rank or grace_over
        ]
        self.fold_reports(self.current)
        outcome = classify_attempt(verdicts)
        if outcome.over and (outcome.outcome is Outcome.FAILED or not missing):
            return self.attempt_over(spec, plans, record, outcome)
        age = self.now - record.start_time if record.start_time else POD_INDEX_SETTLE
        if missing and age >= POD_INDEX_SETTLE:
            self.children = self.render(spec, rendering, ranks=missing)
        elif missing:
            self.requeue.append((POD_INDEX_SETTLE - age).total_seconds())
        self.observe_running(spec, rendering.plans, record)

    def classify(self, spec: SFTJobSpec, pod: Obj | None, rank: int) -> Classification:
        """One pod's verdict; a pod that is gone is judged by the node its rank was last seen on."""
        node_name = observe.node_of(pod) if pod is not None else node_of_rank(self.old.gpu, spec, rank)
        # The stall clock runs once every rank runs, from the last one's start: until then the ranks
        # running wait in torchrun's rendezvous for the others (Pending for GPUs, pulling the image).
        started = [running_since(p.get("status") or {}) for p in self.current]
        everyone = len(started) == spec.gpu.nodes and None not in started
        last = max([t for t in started if t is not None], default=None) if everyone else None
        progress = self.status.progress.updated if self.status.progress else None
        return classify_pod(
            pod,
            self.obs.nodes.get(node_name) if node_name else None,
            now=self.now,
            node_name=node_name if pod is None else None,
            last_progress=max([t for t in (progress, last) if t is not None], default=None),
            stall_timeout_seconds=spec.restart_policy.stall_timeout if everyone else None,
        )

    def attempt_over(
        self, spec: SFTJobSpec, plans: CandidatePlans, record: AttemptRecord, outcome: Classification
    ) -> None:
        ended = end_record(
            record,
            outcome,
            end_time=self.now,
            progress_step=self.status.progress.step if self.status.progress else None,
            checkpoint_step=self.status.last_checkpoint.step if self.status.last_checkpoint else None,
        )
        self.replace_record(ended)
        self.deletes += [observe.name(p) for p in self.current if observe.is_active(p)]
        if outcome.outcome is Outcome.SUCCEEDED:
            return self.succeed()
        reason = str(ended.reason or FailureClass.UNKNOWN)
        self.events.append(Event("Warning", reason, describe_failure(ended)))
        self.next_attempt(spec, plans)

    def observe_running(self, spec: SFTJobSpec, plans: CandidatePlans, record: AttemptRecord) -> None:
        pods = self.current
        gpu, plan = gpu_status(spec, pods, self.obs.nodes, self.ctx.products, plans)
        nodes = gpu.nodes
        self.update(gpu=gpu, plan=plan_status(plan) if plan is not None else self.status.plan)
        self.replace_record(
            record.model_copy(
                update={
                    "node": nodes[0] if nodes else None,
                    "gpu": plan.gpu if plan else record.gpu,
                    "plan": plan.summary() if plan else record.plan,
                    "ladder_step": (plan.ladder[-1] if plan.ladder else None) if plan else record.ladder_step,
                }
            )
        )
        everyone = len(pods) == spec.gpu.nodes
        unschedulable = observe.unschedulable_message(pods)
        if everyone and len(nodes) == len(pods):
            self.cond(T.SCHEDULED, True, Reason.BOUND, f"on {', '.join(nodes)}")
        elif not everyone and self.failed_create():
            pass  # the refused create's message stays until a create succeeds
        elif unschedulable is not None:
            self.cond(T.SCHEDULED, False, Reason.UNSCHEDULABLE, unschedulable)
        else:
            self.cond(T.SCHEDULED, False, Reason.WAITING_FOR_PODS, "waiting for the scheduler")
        if everyone and all(observe.phase_of(p) == "Running" for p in pods):
            self.cond(T.RUNNING, True, Reason.TRAINING, f"attempt {record.attempt} on {', '.join(nodes)}")
            self.set_phase(
                "Running", Reason.TRAINING, f"training on {self.status.gpu.summary} ({', '.join(nodes)})"
            )
        else:
            reason = Reason.UNSCHEDULABLE if unschedulable else Reason.STARTING
            self.cond(T.RUNNING, False, reason, unschedulable or "waiting for the trainer containers")
            self.set_phase("Pending", reason, unschedulable or "waiting for the pods to start")
        self.cond(T.SUCCEEDED, False, Reason.NOT_FINISHED, "")
        self.cond(T.FAILED, False, Reason.NOT_FINISHED, "")
        if record.start_time is not None and len(pods) < spec.gpu.nodes:
            self.requeue.append(POD_APPEARANCE_GRACE.total_seconds())

    def suspend(self, spec: SFTJobSpec) -> None:
        self.deletes += [observe.name(p) for p in self.current]
        # Until they are gone, the suspended attempt's pods report the checkpoint saved on SIGTERM.
        self.fold_reports(self.current)
        record = self.record()
        if record is not None and not record.ended:
            self.replace_record(record.model_copy(update={"end_time": self.now, "message": "suspended"}))
        self.cond(T.SUSPENDED, True, Reason.SUSPENDED, "spec.suspend is true: pods deleted, checkpoints kept")
        self.cond(T.RUNNING, False, Reason.SUSPENDED, "suspended")
        # Like a Job, a resumed SFTJob's activeDeadlineSeconds counts from the resume.
        self.update(start_time=None)
        self.set_phase("Suspended", Reason.SUSPENDED, "spec.suspend is true")

    def finished(self, spec: SFTJobSpec) -> None:
        """A finished job keeps only its last attempt's ended pods (their logs and exit codes); an
        operator killed after writing the final status may have left older or running ones."""
        self.deletes += [
            observe.name(p)
            for p in self.obs.pods
            if observe.is_active(p) or observe.attempt_of(p) < self.attempt
        ]
        ttl, done = spec.ttl_seconds_after_finished, self.status.completion_time
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

    def succeed(self) -> None:
        self.cond(T.SUCCEEDED, True, Reason.COMPLETED, f"attempt {self.attempt} completed training")
        self.cond(T.FAILED, False, Reason.COMPLETED, "")
        self.cond(T.RUNNING, False, Reason.COMPLETED, "finished")
        self.update(completion_time=self.now)
        self.set_phase("Succeeded", Reason.COMPLETED, f"training completed in attempt {self.attempt}")

    def fail(
        self, reason: str, message: str, *, admitted: bool = True, ended_as: FailureClass | None = None
    ) -> None:
        if not admitted:
            self.cond(T.ADMITTED, False, reason, message)
        record = self.record()
        if record is not None and not record.ended:
            self.replace_record(
                record.model_copy(update={"end_time": self.now, "reason": ended_as, "message": message})
            )
        self.deletes += [observe.name(p) for p in self.obs.pods if observe.is_active(p)]
        self.cond(T.FAILED, True, reason, message)
        self.cond(T.SUCCEEDED, False, reason, "")
        self.cond(T.RUNNING, False, reason, "failed")
        self.update(completion_time=self.status.completion_time or self.now)
        self.set_phase("Failed", reason, message)

    # --- helpers --------------------------------------------------------------------------------

    def render(self, spec: SFTJobSpec, attempt: NextAttempt, *, ranks: Sequence[int]) -> list[Manifest]:
        """The children of ``attempt`` (only the pods of ``ranks``), in creation order."""
        job = JobRef(
            namespace=self.obs.namespace, name=self.obs.name, uid=self.obs.uid, attempt=attempt.attempt
        )
        affinity = node_affinity(
            spec.gpu.candidates(),
            self.ctx.products,
            allowed_products=attempt.plans.allowed_products(),
            avoid_nodes=attempt.avoid_nodes,
            min_driver_major=None if spec.image else self.ctx.image_min_driver_major,
        )
        image = spec.image or self.ctx.image
        return pods.attempt_children(
            job,
            spec,
            attempt.plans,
            affinity=affinity,
            image=image,
            ranks=ranks,
            image_pull_secrets=self.ctx.trainer_image_pull_secrets,
        )

    def record(self) -> AttemptRecord | None:
        return self.record_of(self.attempt)

    def all_bound_once(self, spec: SFTJobSpec) -> bool:
        """The status shows every pod of the current attempt bound to a node (``gpu`` is reset when an
        attempt starts): they were all created, so one that is missing now was deleted."""
        return len(self.old.gpu.nodes) == spec.gpu.nodes

    def failed_create(self) -> bool:
        """The API server refused to create one of this attempt's children (see ``status.failed_create``)."""
        scheduled = get_condition(self.status.conditions, T.SCHEDULED)
        return scheduled is not None and scheduled.reason == Reason.FAILED_CREATE

    def actions(self) -> Actions:
        if self.check:
            return Actions(status=self.old, status_changed=False, check_pods=self.check)
        deleting = {observe.name(p) for p in self.obs.pods if p["metadata"].get("deletionTimestamp")}
        return Actions(
            status=self.status,
            status_changed=self.status != self.old or bool(self.repairs),
            children=self.children,
            delete_pods=sorted(set(self.deletes) - deleting),
            delete_job=self.delete_job,
            events=self.transition_events(),
            requeue_after=min(self.requeue) if self.requeue else None,
        )
