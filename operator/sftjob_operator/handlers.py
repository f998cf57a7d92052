"""The kopf wiring: indexes of SFTJobs, trainer pods and GPU nodes, and workers that reconcile jobs.

How the kopf handler kinds map onto a level-based operator:

- ``@kopf.index`` keeps every SFTJob (compact: :class:`~sftjob_operator.observe.JobView`), every
  trainer pod (trimmed, by job) and every node in memory, fed by watches, so a pass reads its job and
  children without asking the API server; kopf processes no event before the indexes are complete,
  which is what keeps an operator restarted mid-creation from duplicating pods.
- ``@kopf.on.event`` for jobs and their pods puts the job's key on the :class:`WorkQueue`; kopf updates
  the indexes before it calls the event handlers, so the pass sees what the event brought.
- ``WORKERS`` workers, started with the operator, take keys off the queue and run one pass each (a
  key is never in two passes at once). A pass asks to be run again after its requeue delay, at the
  latest after ``RESYNC_SECONDS``; an API error backs the key off; a job gone from the index is
  forgotten; so is a ghost the index kept after a watch gap once its status write answers 404, or
  once a list of the jobs' uids, every ``GHOST_SWEEP_SECONDS``, lacks it (a quiet job writes nothing),
  and a pass takes the newest entry of a key, not a ghost beside it; a ghost pod, one whose delete
  finds no pod of its uid, is left out of its job's pods (:mod:`~sftjob_operator.ghosts`).
  There is no task per job and no finalizer: deleting a job needs nothing from the operator (the
  garbage collector removes its children by ownerReference), and a finalizer an older version added
  is removed by kopf.

Each pass calls :func:`sftjob_operator.reconcile.reconcile` with a snapshot and applies its actions.
Children created by this process are remembered (:mod:`~sftjob_operator.expectations`) so a pass that
runs before the watch shows them does not send them again. The metrics and events of a status
transition are given right after the status write, before any child is created: a create that fails
afterwards (a quota, a 5xx) makes the pass retry the create, but the next pass sees no transition left
to count or post.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, ClassVar

import kopf

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob.job_status import SFTJobStatus
from sftjob_operator import builders, lookups, metrics, observe, pod_lifecycle, workloads
from sftjob_operator.conditions import Reason
from sftjob_operator.expectations import Expectations
from sftjob_operator.ghosts import Tombstones, is_gone
from sftjob_operator.kube import Conflict, CreateFailed, Kube, Rejected
from sftjob_operator.observe import JobView, trim_node, trim_pod
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import SURVIVOR_GRACE_SECONDS, Actions, Context, Observed
from sftjob_operator.status import failed_create, parse_status, reject
from sftjob_operator.status_draft import Event
from sftjob_operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

FINALIZER = f"{c.API_GROUP}/finalizer"  # no longer added; kopf removes it from jobs an older version made
# Passes that run at once (each spends most of its time waiting for the API server).
WORKERS = 16
# A pass with nothing to wait for still runs this often (a safety net; pod changes wake it at once).
RESYNC_SECONDS = 30.0
# After an API error, the next pass waits this long, doubling up to the cap.
ERROR_BACKOFF = (1.0, 30.0)
# After our own status write (or a 409), the job's next pass waits until the index shows a newer version
# than the one that pass decided from, at most this long: deciding again from the older one would only
# lose its status write with a 409. Under load the watch is seconds behind.
CONSISTENCY_TIMEOUT = 30.0
# A job deleted during a watch gap stays in the index (ghosts.py); a pass finds it gone only when it
# writes, and a quiet job (finished without a TTL, suspended) writes nothing. This often, the index's
# jobs are checked against the uids the API server lists: one list of metadata per namespace.
GHOST_SWEEP_SECONDS = 600.0

# A pod's create refused because something it refers to is missing (the ServiceAccount admission's
# 'serviceaccount "job-trainer" not found'): the attempt's other children are not watched, so one
# deleted since this process created it is known gone only from this.
REFERENCE_MISSING = re.compile(r"\bnot found\b", re.IGNORECASE)

JobKey = tuple[str, str]  # (namespace, name)


class Runtime:
    """Operator-wide state the handlers share, set once by ``main`` before kopf starts."""

    context: Context
    kube: Kube
    resync_seconds: float = RESYNC_SECONDS
    expectations = Expectations()
    queue: WorkQueue[JobKey] = WorkQueue()
    # Per key, only while it applies: the version a pass wrote over (and until when to wait for a
    # newer one), and the current error backoff.
    outdated: ClassVar[dict[JobKey, tuple[str, float]]] = {}
    backoff: ClassVar[dict[JobKey, float]] = {}
    gone = Tombstones()  # index entries of jobs the API server said are gone
    gone_pods = Tombstones()  # index entries of trainer pods (by job key) the API server said are gone
    queue_reasons: ClassVar[lookups.QueueReasons] = {}  # per queued job, Kueue's reason (lookups)
    workers: ClassVar[list[asyncio.Task[None]]] = []


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's "essence" of an object is what its on.create/update handlers diff against; this operator
    has none (a work queue reconciles from the indexes), yet kopf builds one for every watch event, a
    deep copy of the whole pod, node or job body (28 instead of 33 ms of operator CPU per job at 1,000
    jobs). An empty essence keeps kopf's flow and costs nothing; kopf stores nothing on the objects."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        return None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    settings.posting.level = logging.WARNING  # transitions are posted explicitly, once each
    settings.posting.reporting_component = "sftjob-operator"
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.API_GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = 300
    # Only trainer pods are watched and listed: the labels= of the pod handlers filter in the operator,
    # this selector in the API server (a cluster's other pods never reach the operator).
    settings.watching.label_selectors["v1", "pods"] = c.LABEL_JOB
    # kopf hands its indexes (empty until the first listings) to handlers as keyword arguments.
    indexes = kwargs["sftjobs"], kwargs["trainer_pods"], kwargs["gpu_nodes"]
    Runtime.workers = [asyncio.create_task(_work(*indexes)) for _ in range(WORKERS)]
    Runtime.workers.append(asyncio.create_task(_sweep(indexes[0])))


@kopf.on.cleanup()
async def stop_workers(**_: Any) -> None:
    for task in Runtime.workers:
        task.cancel()
    await asyncio.gather(*Runtime.workers, return_exceptions=True)


@kopf.index(c.API_GROUP, c.API_VERSION, c.PLURAL)
async def sftjobs(namespace: str | None, name: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): JobView.of(body)}


@kopf.index("pods", labels={c.LABEL_JOB: kopf.PRESENT})
async def trainer_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {(namespace, labels[c.LABEL_JOB]): trim_pod(body)}


@kopf.index("nodes")
async def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {name: trim_node(body)}


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.PLURAL)
async def job_changed(namespace: str | None, name: str | None, **_: Any) -> None:
    metrics.WATCH_EVENTS.labels(kind=c.KIND).inc()
    Runtime.queue.add((namespace or "", name or ""))


@kopf.on.event("pods", labels={c.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    metrics.WATCH_EVENTS.labels(kind="Pod").inc()
    Runtime.queue.add((namespace or "", labels.get(c.LABEL_JOB) or ""))


async def _work(jobs: kopf.Index[Any, Any], pods: kopf.Index[Any, Any], nodes: kopf.Index[Any, Any]) -> None:
    """One worker: take a key, run its pass, say when it is due again."""
    queue = Runtime.queue
    while True:
        key = await queue.get()
        try:
            await _reconcile(key, jobs, pods, nodes)
        except Exception:  # _reconcile backs off its own failures: this is a bug, and the worker goes on
            log.exception("reconcile of %s/%s failed outside its pass", *key)
            _back_off(key, result="error")
        finally:
            queue.done(key)


async def _sweep(jobs: kopf.Index[Any, Any]) -> None:
    """Every ``GHOST_SWEEP_SECONDS``, bury the index's ghost jobs (:func:`_bury_ghosts`)."""
    while True:
        await asyncio.sleep(GHOST_SWEEP_SECONDS)
        try:
            await _bury_ghosts(jobs)
        except Exception:  # a bug: said, and the sweeps go on
            log.exception("looking for jobs deleted during a watch gap failed")


async def _bury_ghosts(jobs: kopf.Index[Any, Any]) -> None:
    """Tombstone the index entries of jobs the API server no longer has, and queue their keys: the pass
    finds no job left (or the one created again under the name), releases what Kueue held and forgets
    it. Only entries already indexed before the list are judged: a job created since may be missing from
    it. A namespace whose list fails is looked at again at the next sweep."""
    indexed: list[tuple[JobKey, str]] = []
    for key, entries in jobs.items():
        views = list(entries)
        buried = Runtime.gone.buried(key, (view.uid for view in views))
        indexed += [(key, view.uid) for view in views if view.uid not in buried]
    for namespace in sorted({key[0] for key, _ in indexed}):
        try:
            live = await Runtime.kube.run(Runtime.kube.job_uids, namespace)
        except Exception as err:
            log.warning("listing the SFTJobs of %s to find those deleted unseen failed: %s", namespace, err)
            continue
        for key, uid in indexed:
            if key[0] == namespace and uid not in live:
                log.info("%s/%s (uid %s) no longer exists: its index entry is ignored", *key, uid)
                Runtime.gone.bury(key, uid)
                Runtime.queue.add(key)


async def _reconcile(
    key: JobKey, jobs: kopf.Index[Any, Any], pods: kopf.Index[Any, Any], nodes: kopf.Index[Any, Any]
) -> None:
    job = Runtime.gone.select(key, jobs.get(key, ()))
    if job is None:  # deleted: its children go by ownerReference; forget what this process kept
        try:
            await _release_held(key, _live_pods(key, pods))  # but pods Kueue still held would not go
        except Exception as err:
            log.warning("releasing %s/%s's pods from Kueue failed: %s", *key, err)
            _back_off(key, result="error")
            return
        _forget(key)
        return
    queue = Runtime.queue
    outdated = Runtime.outdated.get(key)
    if outdated is not None:
        version, until = outdated
        left = until - time.monotonic()
        if job.resource_version == version and left > 0:
            queue.add_after(key, left)  # the job's next watch event runs it sooner
            return
        del Runtime.outdated[key]
    started = time.monotonic()
    try:
        delay = await _pass(job, pods, nodes)
        Runtime.backoff.pop(key, None)
    except Conflict as stale:
        _wait_for_newer(key, stale.resource_version)
        return
    except CreateFailed as err:  # said in the job's status and events by _apply; retried like an error
        log.warning("creating a child of %s/%s failed: %s", *key, err)
        _back_off(key, result="refused")
        return
    except Exception as err:  # an API or programming error: say so, back off, try again
        if is_gone(err, job):
            _bury(job)
            return
        log.exception("reconcile of %s/%s failed; retrying in %.0f s", *key, _back_off(key, result="error"))
        return
    finally:  # every pass, failed ones too: those are the slow ones
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    queue.add_after(key, delay)


def _back_off(key: JobKey, *, result: str) -> float:
    """Requeue ``key`` after its current backoff, doubled for the next failure; returns the delay."""
    backoff = Runtime.backoff.get(key, ERROR_BACKOFF[0])
    metrics.RECONCILES.labels(result=result).inc()
    Runtime.backoff[key] = min(backoff * 2, ERROR_BACKOFF[1])
    Runtime.queue.add_after(key, backoff)
    return backoff


def _wait_for_newer(key: JobKey, version: str) -> None:
    Runtime.outdated[key] = (version, time.monotonic() + CONSISTENCY_TIMEOUT)
    Runtime.queue.add_after(key, CONSISTENCY_TIMEOUT)


def _bury(job: JobView) -> None:
    """The job is gone though the index holds it (a DELETED event lost in a watch gap): forget it and
    never pass over this entry again. A job created under its name later is queued by its own event."""
    key = (job.namespace, job.name)
    log.info("%s/%s (uid %s) no longer exists: forgotten, its index entry is ignored", *key, job.uid)
    Runtime.gone.bury(key, job.uid)
    _forget(key)


def _forget(key: JobKey) -> None:
    Runtime.queue.forget(key)
    Runtime.expectations.forget(key)
    Runtime.outdated.pop(key, None)
    Runtime.backoff.pop(key, None)
    Runtime.gone_pods.forget(key)
    Runtime.queue_reasons.pop(key, None)
    metrics.track_job(*key, None)


async def _pass(job: JobView, pods: kopf.Index[Any, Any], nodes: kopf.Index[Any, Any]) -> float:
    """One reconcile pass over ``job`` as the index holds it; returns how long until the next is due."""
    key, now = (job.namespace, job.name), _now()
    observed = Observed(
        name=job.name,
        namespace=job.namespace,
        uid=job.uid,
        generation=job.generation,
        spec=job.spec(),
        status=job.status(),
        pods=observe.owned(_live_pods(key, pods), job.uid),  # not an earlier job's of this name
        nodes=observe.FirstOfEach(nodes),
        now=now,
    )
    group = workloads.queued_group(observed.pods)
    if group is not None:  # Kueue holds the attempt: its Workload says why
        reason = await lookups.queue_reason(Runtime.kube, Runtime.queue_reasons, key, group)
        observed = dataclasses.replace(observed, queue_reason=reason)
    actions = reconcile(observed, Runtime.context)
    if actions.read_claims:  # a multi-node job's claims, before its first attempt: read, then decide
        claims = await lookups.read_claims(Runtime.kube, job.namespace, actions.read_claims)
        observed = dataclasses.replace(observed, claims=claims)
        actions = reconcile(observed, Runtime.context)
    if actions.check_pods:  # the index lacks pods long after their attempt started: ask, then decide
        found, gone = await lookups.look_up(Runtime.kube, job, actions.check_pods)
        observed = dataclasses.replace(observed, pods=[*observed.pods, *found], gone=gone)
        actions = reconcile(observed, Runtime.context)
    log.debug(
        "pass over %s/%s at version %s: attempt %d, %s, %d children, %d deletions",
        job.namespace, job.name, job.resource_version, actions.status.attempt, actions.status.phase,
        len(actions.children), len(actions.delete_pods),
    )  # fmt: skip
    # Every pod of the name, an earlier job's too (deleted, then created again while its pods went).
    await _release_held(key, _live_pods(key, pods))
    if job.deleting:
        return Runtime.resync_seconds  # being deleted (another finalizer holds it): create nothing more
    written, version = await _apply(job, observed, actions, now=now)
    metrics.track_job(job.namespace, job.name, written)
    metrics.RECONCILES.labels(result="success").inc()
    if version != job.resource_version:  # decide again only from a version that shows this write
        _wait_for_newer(key, job.resource_version)
    due = Runtime.resync_seconds if actions.requeue_after is None else actions.requeue_after
    return min(due, Runtime.resync_seconds)


async def _release_held(key: JobKey, pods: Sequence[observe.Obj]) -> None:
    """Take Kueue's finalizer off the pods deleted while it held them (pod_lifecycle.held_by_kueue)."""
    for pod in pod_lifecycle.held_by_kueue(pods):
        await Runtime.kube.run(Runtime.kube.release_pod, key[0], observe.name(pod), observe.uid_of(pod))


def _live_pods(key: JobKey, pods: kopf.Index[Any, Any]) -> list[observe.Obj]:
    """The job's pods in the index, less those whose delete found them gone."""
    indexed = list(pods.get(key, []))
    gone = Runtime.gone_pods.buried(key, (observe.uid_of(p) for p in indexed))
    return [p for p in indexed if observe.uid_of(p) not in gone]


async def _apply(
    job: JobView, observed: Observed, actions: Actions, *, now: datetime
) -> tuple[SFTJobStatus, str]:
    """Write the status, say what changed, delete pods, create the children (and delete the job); returns
    the status the job has now and its resourceVersion after the status write (unchanged when there was
    none, or when it changed nothing)."""
    namespace, name, kube = job.namespace, job.name, Runtime.kube
    version = job.resource_version
    if actions.status_changed:
        version = await kube.run(kube.write_status, namespace, name, version, observed.status, actions.status)
    await _announce(job, parse_status(observed.status), actions.status, actions.events, now=now)
    # Deletes first: a create that keeps being refused (a quota the lost node's old pod still holds)
    # must not hold them back. Each is conditioned on its pod's uid, so it needs nothing from the creates.
    await _delete_pods(job, observed, actions)
    rejected = await _create(job, actions, version, now=now)
    if rejected is not None:
        return rejected, version
    if actions.delete_job:
        if not await kube.run(kube.delete_job, namespace, name, job.uid):
            _bury(job)  # a finished job deleted meanwhile, its DELETED event lost: never passed over again
        elif (deleted := actions.job_deleted) is not None:  # said once, when it happened
            await _post(job, deleted.type, deleted.reason, deleted.message)
    return actions.status, version


async def _delete_pods(job: JobView, observed: Observed, actions: Actions) -> None:
    """Delete the pods the pass asks to, each with its grace; one found gone is left out of the job's."""
    namespace, name, kube = job.namespace, job.name, Runtime.kube
    uids = {observe.name(p): observe.uid_of(p) for p in observed.pods}  # every pod it deletes is one of them
    deletes = [(pod, None) for pod in actions.delete_pods] + [(pod, 0) for pod in actions.force_delete_pods]
    deletes += [(pod, SURVIVOR_GRACE_SECONDS) for pod in actions.quick_delete_pods]
    for pod, grace_period_seconds in deletes:
        if not await kube.run(kube.delete_pod, namespace, pod, uids[pod], grace_period_seconds):
            log.info(
                "pod %s/%s (uid %s) no longer exists: left out of its job's pods", namespace, pod, uids[pod]
            )
            Runtime.gone_pods.bury((namespace, name), uids[pod])
            Runtime.queue.add((namespace, name))  # decide again at once, without it


async def _create(job: JobView, actions: Actions, version: str, *, now: datetime) -> SFTJobStatus | None:
    """Create the children the pass asks for that this process has not just created; returns the failed
    status when the API server rejected one as invalid. Any other failure to create one is said in the
    status (Scheduled=False, FailedCreate: the pods it is missing are created again, never judged
    deleted) and raised, for the pass to be retried after a backoff."""
    key, uid, attempt = (job.namespace, job.name), job.uid, actions.status.attempt
    kube, expected = Runtime.kube, Runtime.expectations
    children = [m for m in actions.children if not expected.pending(key, uid, attempt, m)]
    for batch in builders.creation_batches(children):
        results = await asyncio.gather(*(kube.run(kube.ensure, m) for m in batch), return_exceptions=True)
        for manifest, result in zip(batch, results, strict=True):
            if isinstance(result, bool):
                expected.created(key, uid, attempt, manifest)
                if result and manifest["kind"] == "Pod":
                    metrics.PODS_CREATED.inc()
            elif (
                isinstance(result, CreateFailed)
                and manifest["kind"] == "Pod"
                and REFERENCE_MISSING.search(str(result))
            ):
                expected.forget(key)  # e.g. its ServiceAccount, deleted since: the retry sends them all
        errors = [r for r in results if isinstance(r, BaseException)]
        # An invalid child fails the job whatever else failed beside it: retrying would never mend it.
        error = next((e for e in errors if isinstance(e, Rejected)), errors[0] if errors else None)
        if isinstance(error, Rejected):
            failed = reject(actions.status, str(error), generation=job.generation, now=_now())
            await kube.run(kube.write_status, *key, version, actions.status.to_patch(), failed)
            rejected = Event("Warning", Reason.CHILD_REJECTED, str(error))
            await _announce(job, actions.status, failed, [rejected], now=now)
            return failed
        if isinstance(error, CreateFailed):
            refused = failed_create(actions.status, str(error), generation=job.generation, now=_now())
            if refused != actions.status:  # said once per new refusal, not on every retry
                await kube.run(kube.write_status, *key, version, actions.status.to_patch(), refused)
                await _post(job, "Warning", Reason.FAILED_CREATE, str(error))
        if error is not None:
            raise error
    return None


async def _announce(
    job: JobView, old: SFTJobStatus, new: SFTJobStatus, events: Sequence[Event], *, now: datetime
) -> None:
    """The metrics and events of the transition from ``old`` to ``new``, once ``new`` is written."""
    metrics.observe_pass(old=old, new=new, created=_created(job, now), now=now)
    for event in events:
        await _post(job, event.type, event.reason, event.message)


async def _post(job: JobView, type: str, reason: str, message: str) -> None:
    ref = JobRef(namespace=job.namespace, name=job.name, uid=job.uid, attempt=0)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    manifest = builders.event(ref, type=type, reason=reason, message=message, time=stamp)
    await Runtime.kube.run(Runtime.kube.post_event, manifest)


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def _created(job: JobView, now: datetime) -> datetime:
    raw = job.created
    return datetime.fromisoformat(raw.replace("Z", "+00:00")) if raw else now
