"""The one level-based reconcile: an SFTJob and the pods and nodes it can see in, what to do out.

``reconcile`` is pure. It reads the desired state (the spec), the observed state (the job's status,
its pods and their nodes from the operator's indexes) and the time, and returns the new status plus
the children to create and the pods to delete. It never looks at events or remembers anything, so a
pass after an operator crash decides what the lost pass would have. A status it cannot fully read
(another operator version's, or edited by hand) is read as far as it can be (``status.read_status``)
and attempt numbers never go backwards, so a damaged history never starts a second trainer beside the
running one. The steps, in order:

0. a finished job only waits for its TTL: its spec is not judged again;
1. parse the spec, complete it with the operator's defaults (kept in ``status.effective``) and plan it
   for every candidate GPU (``job_lifecycle``): before the first attempt, an invalid spec or a job no
   card can run fails; after it, either is said in ``Admitted``/``Planned`` and the running attempt
   is kept and judged, but no new attempt starts (an invalid spec, which can no longer change, fails the
   job when its attempt ends without success or misses a pod it never had; without a plan it waits);
2. ``spec.suspend``: delete the pods, keep everything else;
3. no attempt under way: ask the attempt policy for the next one and start it (status first, so the
   attempt number is recorded before its pods exist), or wait for its backoff, or for an earlier
   attempt's pods to stop (a trainer saving its SIGTERM checkpoint), or fail (also a multi-node job with
   a claim no two nodes can mount, read before its first attempt);
4. an attempt under way: fold in its pods' progress reports, classify its pods; when it is over, record
   how it ended (the pods left of a failed one go with a short grace: ``actions``) and go to 3;
   otherwise create whatever pod is missing and report scheduling, GPU, plan and progress.
   ``activeDeadlineSeconds`` exceeded fails the job, in 3 or 4, once the pods have been judged: an
   attempt whose pods have ended keeps its outcome (a success stays one) however late the pass that sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, timedelta

from sftjob.attempts import AttemptRecord, trimmed
from sftjob.config import JobRef
from sftjob.failures import FailureClass
from sftjob.job_status import GpuStatus, ProgressStatus
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator import builders, observe, pod_lifecycle, pods
from sftjob_operator.attempt_end import (
    classify_attempt,
    cut_short,
    describe_failure,
    end_record,
    peers_settling,
)
from sftjob_operator.attempt_policy import GiveUp, NextAttempt, numbered
from sftjob_operator.classify import Classification, Outcome, classify_pod, running_since
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason
from sftjob_operator.conditions import get as get_condition
from sftjob_operator.job_lifecycle import JobPass
from sftjob_operator.not_started import MOUNT_GIVE_UP_SECONDS
from sftjob_operator.planning import CandidatePlans, PlanningError, plan_status
from sftjob_operator.reconcile_io import Actions, Context, Manifest, Obj, Observed
from sftjob_operator.restarts import ADVICE
from sftjob_operator.scheduling import node_affinity
from sftjob_operator.status import gpu_status, node_of_rank
from sftjob_operator.status_draft import Event

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
# While an earlier attempt's pods stop (a trainer saving its SIGTERM checkpoint), the next attempt
# looks again this often (their deletion also wakes the job).
STOPPING_POLL = timedelta(seconds=5)
# Plans of a job that cannot be planned now (a started job under a newer planner): no card has one.
UNPLANNED = CandidatePlans(plans={}, profile_by_product={})


def reconcile(obs: Observed, ctx: Context) -> Actions:
    run = _Pass(obs, ctx)
    run.run()
    return run.actions()


class _Pass(JobPass):
    """One reconcile pass: the job-level steps of :class:`JobPass` and the attempts; no I/O."""

    read_claims: tuple[str, ...] = ()  # claims to read before the pass can decide (``Actions.read_claims``)

    # --- the steps ------------------------------------------------------------------------------

    def run(self) -> None:
        if self.status.finished:
            return self.finished()
        spec = self.admit()
        if spec is None:
            return None
        try:
            plans: CandidatePlans | None = None if self.held else self.plan(spec)
        except PlanningError as err:
            if not self.status.attempts:
                self.cond(T.PLANNED, False, err.reason, err.message)
                return self.fail(err.reason, err.message)
            plans, self.unplanned = None, err.message
            kept = "the running attempt is kept; no new attempt starts until the job can be planned"
            self.warn_once(T.PLANNED, err.reason, f"{err.message} ({kept})")
        self.deletes += [observe.name(p) for p in self.obs.pods if observe.attempt_of(p) < self.attempt]

        if spec.suspend:
            if self.ended_unseen(spec):
                return None
            return self.suspend()
        self.cond(T.SUSPENDED, False, Reason.NOT_SUSPENDED, "")
        # activeDeadlineSeconds is judged after the attempt's pods: an attempt that ended before the
        # pass saw it ended as it did (a success stays one), and only what would come next is refused.
        record = self.record()
        if record is None or record.ended:
            return self.next_attempt(spec, plans)
        return self.under_way(spec, plans, record)

    def next_attempt(self, spec: SFTJobSpec, plans: CandidatePlans | None) -> None:
        # The ended attempt's pods may still be saving a checkpoint (SIGTERM after a suspend): the
        # next attempt records the newest one it knows as where it resumes from.
        self.fold_reports(self.current)
        # The ended attempt's pods go in every pass until they have (older ones: ``run``): a delete lost
        # with the pass that ended it would leave a surviving rank holding its GPUs through the wait below.
        # A current attempt without a record is taken over instead (``numbered``): its pods stay.
        record = self.record()
        if record is not None and record.ended:
            self.deletes += [observe.name(p) for p in self.current if observe.is_active(p)]
        if self.held:
            return self.fail_held()
        if plans is None:
            if (final := self.ctx.final_failure(spec, self.status.attempts)) is not None:
                return self.fail(final.reason, final.message)
            if self.deadline_passed(spec):
                return self.deadline_exceeded(spec)
            return self.between_attempts(
                f"no new attempt starts until the job can be planned: {self.unplanned}"
            )
        decision = self.ctx.attempt_policy(
            spec, self.status.attempts, plans, nodes=self.obs.nodes, now=self.now
        )
        if isinstance(decision, GiveUp):
            return self.fail(decision.reason, decision.message)
        if self.deadline_passed(spec):
            return self.deadline_exceeded(spec)
        decision = numbered(decision, self.status.attempts, current=self.attempt)
        if decision.not_before is not None and decision.not_before > self.now:
            self.requeue.append((decision.not_before - self.now).total_seconds())
            # The start time, not a countdown: the condition stays the same from pass to pass.
            at = decision.not_before.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return self.between_attempts(
                f"attempt {decision.attempt} starts at {at}. {decision.message}".strip()
            )
        # The new attempt starts once no older pod may still run its trainer: it takes over the
        # checkpoint volume, which would throw away the old trainer's SIGTERM save.
        older = [p for p in self.obs.pods if observe.attempt_of(p) < decision.attempt]
        stopping = pod_lifecycle.stopping_attempt(older, self.obs.nodes, now=self.now)
        if stopping is not None:
            self.requeue.append(STOPPING_POLL.total_seconds())
            return self.between_attempts(f"waiting for attempt {stopping}'s pods to stop")
        if not self.status.attempts:  # a multi-node job's claims are read and judged before its first attempt
            self.read_claims = pods.unread_claims(spec, self.obs.name, self.obs.claims)
            unshared = None if self.read_claims else pods.unshared_claim(spec, self.obs.name, self.obs.claims)
            if unshared is not None:
                return self.fail(Reason.INVALID_SPEC, unshared, admitted=False)
            if self.read_claims:
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
            attempts=[*trimmed(self.status.attempts), record],
            restarts=self.status.restarts + (1 if restarted else 0),
            # activeDeadlineSeconds counts from here; for a queued job from its admission (observe_running).
            start_time=self.status.start_time or (None if spec.queue_name else self.now),
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

    def under_way(self, spec: SFTJobSpec, plans: CandidatePlans | None, record: AttemptRecord) -> None:
        rendering = None  # the attempt's own plans and pods, as its start rendered them
        if plans is not None:
            history = [r for r in self.status.attempts if r.attempt < record.attempt]
            decision = self.ctx.attempt_policy(spec, history, plans, nodes=self.obs.nodes, now=self.now)
            if isinstance(decision, GiveUp):  # e.g. a newer planner's OOM ladder has no such rung
                kept = f"{decision.message} (the running attempt is kept)"
                self.warn_once(T.PLANNED, decision.reason, kept)
            else:  # its pods' names, whatever history was lost
                rendering = replace(decision, attempt=record.attempt)
        attempt_plans = rendering.plans if rendering else UNPLANNED
        by_rank = {observe.rank_of(p): p for p in self.current}
        missing = [r for r in range(spec.gpu.nodes) if r not in by_rank]
        # A pod whose create the API server refused (FailedCreate) was never there, nor one the status
        # never showed bound (an operator stopped before creating it): retry, never judge it. A held job
        # cannot create one: once the API server confirms it is missing, the job fails.
        created = self.all_bound_once(spec) and not self.failed_create()
        grace_over = (created or bool(self.held)) and (
            record.start_time is None or self.now - record.start_time > POD_APPEARANCE_GRACE
        )
        names = {r: builders.pod_name(self.obs.name, record.attempt, r) for r in missing}
        if grace_over:
            self.check = [names[r] for r in missing if names[r] not in self.obs.gone]
            if self.check:  # the index may be behind: decide once the API server has been asked
                return None
            if missing and not created:
                ranks = ", ".join(str(r) for r in missing)
                return self.fail_held(f"attempt {record.attempt} has no pod for rank(s) {ranks}")
        # The reports first: the stall clock reads the progress they carry (an operator that was down
        # longer than the stall timeout finds fresh reports, not its own stale status).
        self.fold_reports(self.current)
        verdicts = [
            self.classify(spec, by_rank.get(r), r)
            for r in range(spec.gpu.nodes)
            if r in by_rank or grace_over
        ]
        outcome = classify_attempt(verdicts)
        settling = None if missing else peers_settling(outcome, verdicts, by_rank, now=self.now)
        if settling is not None:  # a peer still stopping may say what really happened
            self.requeue.append(settling)
        elif outcome.over and (outcome.outcome is Outcome.FAILED or not missing):
            # Where it ran, even when no pass saw it running: the OOM ladder steps down that card.
            _, _, landed = self.landed(spec, attempt_plans, record)
            return self.attempt_over(spec, plans, landed, outcome)
        first = len(self.status.attempts) == 1 and self.status.start_time == record.start_time
        if first and observe.gated_message(self.current) is not None:  # Kueue queued it without queueName
            self.update(start_time=None)  # (a default LocalQueue): its clock too starts at the admission
        if self.deadline_passed(spec):
            return self.deadline_exceeded(spec)
        age = self.now - record.start_time if record.start_time else POD_INDEX_SETTLE
        if missing and rendering is not None and age >= POD_INDEX_SETTLE:
            self.children = self.render(spec, rendering, ranks=missing)
        elif missing and age < POD_INDEX_SETTLE:
            self.requeue.append((POD_INDEX_SETTLE - age).total_seconds())
        self.observe_running(spec, attempt_plans, record)

    def deadline_exceeded(self, spec: SFTJobSpec) -> None:
        ran = f"the job ran longer than activeDeadlineSeconds {spec.active_deadline_seconds}"
        message = f"{ran}; {ADVICE[FailureClass.DEADLINE_EXCEEDED]}"
        return self.fail(Reason.DEADLINE_EXCEEDED, message, ended_as=FailureClass.DEADLINE_EXCEEDED)

    def own_progress(self, record: AttemptRecord) -> ProgressStatus | None:
        """This attempt's last progress report, never an earlier one's: on its pods, or (its pods gone with
        their node) in the status when reported since the attempt started."""
        reported = observe.progress_of(self.current)
        if reported is not None:
            return reported
        kept = self.status.progress
        started = record.start_time
        if kept is None or kept.updated is None or started is None or kept.updated < started:
            return None
        return kept

    def classify(self, spec: SFTJobSpec, pod: Obj | None, rank: int) -> Classification:
        """One pod's verdict; a pod that is gone is judged by the node its rank was last seen on."""
        node_name = observe.node_of(pod) if pod is not None else node_of_rank(self.old.gpu, spec, rank)
        # The stall clock runs once every rank runs, from the last one's start: until then the ranks
        # running wait in torchrun's rendezvous for the others (Pending for GPUs, pulling the image).
        started = [running_since(p.get("status") or {}) for p in self.current]
        everyone = len(started) == spec.gpu.nodes and None not in started
        last = max([t for t in started if t is not None], default=None) if everyone else None
        reported = observe.progress_of(self.current)
        progress = reported.updated if reported else None
        verdict = classify_pod(
            pod,
            self.obs.nodes.get(node_name) if node_name else None,
            now=self.now,
            node_name=node_name if pod is None else None,
            last_progress=max([t for t in (progress, last) if t is not None], default=None),
            stall_timeout_seconds=spec.restart_policy.stall_timeout if everyone else None,
            own_image=spec.image is not None,
            mount_give_up_seconds=MOUNT_GIVE_UP_SECONDS if spec.gpu.nodes > 1 else None,
        )
        return replace(verdict, node_rank=rank)

    def ended_unseen(self, spec: SFTJobSpec) -> bool:
        """Before a suspend: an attempt whose pods had all ended before any pass saw it is recorded as it
        ended (a CUDA OOM re-plans at the resume, a success finishes the job), not as suspended. True when
        that finished the job."""
        record = self.record()
        if record is None or record.ended or len(self.current) != spec.gpu.nodes:
            return False
        if not all(observe.phase_of(p) in ("Succeeded", "Failed") for p in self.current):
            return False  # a pod still there goes with the suspend (a stall is not judged now)
        self.fold_reports(self.current)
        verdicts = [self.classify(spec, p, observe.rank_of(p)) for p in self.current]
        return self.end_attempt(record, classify_attempt(verdicts))

    def attempt_over(
        self, spec: SFTJobSpec, plans: CandidatePlans | None, record: AttemptRecord, outcome: Classification
    ) -> None:
        if not self.end_attempt(record, outcome):
            self.next_attempt(spec, plans)

    def end_attempt(self, record: AttemptRecord, outcome: Classification) -> bool:
        """Records how the attempt ended and deletes what is left of it; True when the job succeeded."""
        reported = self.own_progress(record)
        ended = end_record(
            record,
            outcome,
            end_time=self.now,
            progress_step=reported.step if reported else None,
            checkpoint_step=self.status.last_checkpoint.step if self.status.last_checkpoint else None,
        )
        self.replace_record(ended)
        self.deletes += [observe.name(p) for p in self.current if observe.is_active(p)]
        if outcome.outcome is Outcome.SUCCEEDED:
            self.succeeded(self.attempt)
            return True
        reason = str(ended.reason or FailureClass.UNKNOWN)
        self.events.append(Event("Warning", reason, describe_failure(ended)))
        return False

    def landed(
        self, spec: SFTJobSpec, plans: CandidatePlans, record: AttemptRecord
    ) -> tuple[GpuStatus, Plan | None, AttemptRecord]:
        """Where the attempt's pods landed, that card's plan, and ``record`` (replaced in the status)
        with the card and plan it runs with once it landed."""
        gpu, plan = gpu_status(spec, self.current, self.obs.nodes, self.ctx.products, plans)
        if plan is not None:
            ladder_step = plan.ladder[-1] if plan.ladder else None
            record = record.model_copy(
                update={"gpu": plan.gpu, "plan": plan.summary(), "ladder_step": ladder_step}
            )
            self.replace_record(record)
        return gpu, plan, record

    def observe_running(self, spec: SFTJobSpec, plans: CandidatePlans, record: AttemptRecord) -> None:
        pods = self.current
        gpu, plan, record = self.landed(spec, plans, record)
        nodes = gpu.nodes
        self.update(gpu=gpu, plan=plan_status(plan) if plan is not None else self.status.plan)
        self.replace_record(record.model_copy(update={"node": nodes[0] if nodes else None}))
        everyone = len(pods) == spec.gpu.nodes
        unschedulable = observe.unschedulable_message(
            pods,
            nodes=self.obs.nodes.values(),
            products=plans.allowed_products(),
            min_driver_major=None if spec.image else self.ctx.image_min_driver_major,
        )
        queued = observe.gated_message(pods)
        if queued is not None and self.obs.queue_reason:
            queued = f"{queued}: {self.obs.queue_reason}"
        if self.status.start_time is None and pods and queued is None:  # admitted: the deadline starts
            self.update(start_time=self.now)
        if everyone and len(nodes) == len(pods):
            self.cond(
                T.SCHEDULED,
                True,
                Reason.BOUND,
                f"on {', '.join(nodes)}{observe.queue_ignored(spec.queue_name, pods)}",
            )
        elif not everyone and self.failed_create():
            pass  # the refused create's message stays until a create succeeds
        elif unschedulable is not None:
            self.cond(T.SCHEDULED, False, Reason.UNSCHEDULABLE, unschedulable)
        elif queued is not None:
            self.cond(T.SCHEDULED, False, Reason.QUEUED, queued)
        else:
            self.cond(T.SCHEDULED, False, Reason.WAITING_FOR_PODS, "waiting for the scheduler")
        if everyone and all(observe.phase_of(p) == "Running" for p in pods):
            self.cond(T.RUNNING, True, Reason.TRAINING, f"attempt {record.attempt} on {', '.join(nodes)}")
            self.set_phase(
                "Running", Reason.TRAINING, f"training on {self.status.gpu.summary} ({', '.join(nodes)})"
            )
        else:
            reason = Reason.UNSCHEDULABLE if unschedulable else Reason.QUEUED if queued else Reason.STARTING
            # Why a bound pod waits: ContainerCreating for long is often a claim still attached elsewhere.
            waiting = pod_lifecycle.waiting_reasons([p for p in pods if observe.phase_of(p) != "Running"])
            starting = "waiting for the trainer containers" + (f": {waiting}" if waiting else "")
            self.cond(T.RUNNING, False, reason, unschedulable or queued or starting)
            self.set_phase("Pending", reason, unschedulable or queued or "waiting for the pods to start")
        self.cond(T.SUCCEEDED, False, Reason.NOT_FINISHED, "")
        self.cond(T.FAILED, False, Reason.NOT_FINISHED, "")
        if record.start_time is not None and len(pods) < spec.gpu.nodes:
            self.requeue.append(POD_APPEARANCE_GRACE.total_seconds())

    # --- helpers --------------------------------------------------------------------------------

    def actions(self) -> Actions:
        """The pass's actions; the pods of an attempt that failed other than by preemption or its deadline
        are deleted with a short grace (``Actions.quick_delete_pods``): a rank that died, vanished or hung
        takes their collective SIGTERM save with it."""
        if self.read_claims:
            return Actions(status=self.old, status_changed=False, read_claims=list(self.read_claims))
        out = super().actions()
        quick = {observe.name(p) for p in self.obs.pods if cut_short(self.record_of(observe.attempt_of(p)))}
        out.quick_delete_pods = [n for n in out.delete_pods if n in quick]
        out.delete_pods = [n for n in out.delete_pods if n not in quick]
        return out

    def render(self, spec: SFTJobSpec, attempt: NextAttempt, *, ranks: Sequence[int]) -> list[Manifest]:
        """The children of ``attempt`` (only the pods of ``ranks``), in creation order."""
        obs, ctx = self.obs, self.ctx
        job = JobRef(namespace=obs.namespace, name=obs.name, uid=obs.uid, attempt=attempt.attempt)
        floor = None if spec.image else ctx.image_min_driver_major
        affinity = node_affinity(
            spec.gpu.candidates(), ctx.products, allowed_products=attempt.plans.allowed_products(),
            avoid_nodes=attempt.avoid_nodes, min_driver_major=floor,
        )  # fmt: skip
        return pods.attempt_children(
            job, spec, attempt.plans, affinity=affinity, image=spec.image or ctx.image, ranks=ranks,
            image_pull_secrets=ctx.trainer_image_pull_secrets, isolated=ctx.trainer_network_policy,
        )  # fmt: skip

    def all_bound_once(self, spec: SFTJobSpec) -> bool:
        """The status shows every pod of the current attempt bound to a node (``gpu`` is reset when an
        attempt starts): they were all created, so one that is missing now was deleted."""
        return len(self.old.gpu.nodes) == spec.gpu.nodes

    def failed_create(self) -> bool:
        """The API server refused to create one of this attempt's children (see ``status.failed_create``)."""
        scheduled = get_condition(self.status.conditions, T.SCHEDULED)
        return scheduled is not None and scheduled.reason == Reason.FAILED_CREATE
