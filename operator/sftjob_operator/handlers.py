"""The kopf wiring: indexes of trainer pods and GPU nodes, and one reconcile loop per SFTJob.

How the kopf handler kinds map onto a level-based operator:

- ``@kopf.index`` keeps every trainer pod (by job) and every node in memory, fed by watches, so a
  pass reads its children without listing anything; kopf processes no object before the indexes
  are complete, which is what keeps an operator restarted mid-creation from duplicating pods.
- ``@kopf.daemon`` runs one reconcile loop per SFTJob. kopf starts it when the job appears (create)
  and for every existing job when the operator starts (resume), and stops it before the job's
  finalizer is removed (delete: the garbage collector removes the children by ownerReference).
- ``@kopf.on.event`` for jobs (update, including ``suspend``) and their pods wakes that job's loop.

Each pass calls :func:`sftjob_operator.reconcile.reconcile` with a snapshot and applies its actions.
The index and event handlers are coroutines so kopf runs them on the event loop instead of handing
each watch event to a thread. The pass reads the job's body and the indexed pods without copying them:
kopf replaces a body wholesale on every event and the index holds fresh trimmed dicts per event, and
nothing here mutates either. Children created by this process are remembered
(:mod:`~sftjob_operator.expectations`) so a pass that runs before the watch shows them does not send
them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from sftjob import constants as c
from sftjob_operator import metrics
from sftjob_operator.conditions import Reason
from sftjob_operator.expectations import Expectations
from sftjob_operator.kube import Conflict, Kube, Rejected
from sftjob_operator.observe import trim_node, trim_pod
from sftjob_operator.reconcile import Actions, Context, Observed, reconcile
from sftjob_operator.status import parse_status, reject

log = logging.getLogger(__name__)

FINALIZER = f"{c.API_GROUP}/finalizer"
# A pass with nothing to wait for still runs this often (a safety net; pod changes wake it at once).
RESYNC_SECONDS = 30.0
# After an API error, the next pass waits this long, doubling up to the cap.
ERROR_BACKOFF = (1.0, 30.0)
# After our own status write, wait at most this long for the watch to deliver it before the next pass
# (a pass from the older body would only lose its status write with a 409). Under load the watch is
# seconds behind; pod events that arrive meanwhile run the pass as soon as the body has caught up.
CONSISTENCY_TIMEOUT = 30.0

_wakeups: dict[tuple[str, str], asyncio.Event] = {}


class Runtime:
    """Operator-wide state the handlers share, set once by ``main`` before kopf starts."""

    context: Context
    kube: Kube
    resync_seconds: float = RESYNC_SECONDS
    expectations = Expectations()


def wake(namespace: str | None, name: str | None) -> None:
    event = _wakeups.get((namespace or "", name or ""))
    if event is not None:
        event.set()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # transitions are posted explicitly, once each
    settings.posting.reporting_component = "sftjob-operator"
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.API_GROUP)
    settings.watching.server_timeout = 300


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
    wake(namespace, name)


@kopf.on.event("pods", labels={c.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    metrics.WATCH_EVENTS.labels(kind="Pod").inc()
    wake(namespace, labels.get(c.LABEL_JOB))


@kopf.daemon(c.API_GROUP, c.API_VERSION, c.PLURAL, cancellation_timeout=5.0)
async def job_loop(body: kopf.Body, namespace: str | None, name: str | None, **kwargs: Any) -> None:
    """Reconcile one SFTJob whenever it or its pods change, or when a pass asked to be requeued.

    kopf passes the indexes as keyword arguments named after the index functions."""
    trainer_pods: kopf.Index[Any, Any] = kwargs["trainer_pods"]
    gpu_nodes: kopf.Index[Any, Any] = kwargs["gpu_nodes"]
    key = (namespace or "", name or "")
    wakeup = _wakeups[key] = asyncio.Event()
    backoff = ERROR_BACKOFF[0]
    try:
        while True:
            wakeup.clear()
            try:
                delay = await _pass(body, trainer_pods, gpu_nodes, wakeup)
                backoff = ERROR_BACKOFF[0]
            except Conflict as stale:
                await _until_changed(body, stale.resource_version, wakeup)
                delay = 0.0
            except Exception:  # an API or programming error: say so, keep the loop alive, back off
                log.exception("reconcile of %s/%s failed; retrying in %.0f s", namespace, name, backoff)
                metrics.RECONCILES.labels(result="error").inc()
                delay, backoff = backoff, min(backoff * 2, ERROR_BACKOFF[1])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
    finally:
        _wakeups.pop(key, None)
        Runtime.expectations.forget(str(body.metadata.get("uid")))
        metrics.track_job(*key, None)


async def _pass(
    body: kopf.Body, pods: kopf.Index[Any, Any], nodes: kopf.Index[Any, Any], wakeup: asyncio.Event
) -> float:
    """One reconcile pass; returns how long until the next one is due."""
    started = time.monotonic()
    snapshot = dict(body)  # one version of the body: kopf replaces it whole, never edits it
    meta = snapshot["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    now = _now()
    observed = Observed(
        name=name,
        namespace=namespace,
        uid=meta["uid"],
        generation=int(meta.get("generation") or 0),
        spec=snapshot.get("spec") or {},
        status=snapshot.get("status") or {},
        pods=list(pods.get((namespace, name), [])),
        nodes=_NodeView(nodes),
        now=now,
    )
    actions = reconcile(observed, Runtime.context)
    if actions.check_pods:  # the index lacks pods long after their attempt started: ask, then decide
        found, gone = await _look_up(namespace, actions.check_pods)
        observed = dataclasses.replace(observed, pods=[*observed.pods, *found], gone=gone)
        actions = reconcile(observed, Runtime.context)
    log.debug(
        "pass over %s/%s at version %s: attempt %d, %s, %d children, %d deletions",
        namespace, name, meta.get("resourceVersion"), actions.status.attempt, actions.status.phase,
        len(actions.children), len(actions.delete_pods),
    )  # fmt: skip
    if meta.get("deletionTimestamp"):
        return Runtime.resync_seconds  # kopf is about to stop this loop; create nothing more
    await _apply(snapshot, body, actions)
    old = parse_status(observed.status)
    metrics.observe_pass(old=old, new=actions.status, created=_created(meta, now), now=now)
    metrics.track_job(namespace, name, actions.status)
    metrics.RECONCILES.labels(result="success").inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    if actions.status_changed:
        # Let the watch deliver our own write before deciding again from the body.
        await _until_changed(body, str(meta.get("resourceVersion")), wakeup)
    due = Runtime.resync_seconds if actions.requeue_after is None else actions.requeue_after
    return min(due, Runtime.resync_seconds)


async def _apply(job: dict[str, Any], body: kopf.Body, actions: Actions) -> None:
    meta = job["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], str(meta["uid"])
    kube, expected, attempt = Runtime.kube, Runtime.expectations, actions.status.attempt
    version, old = str(meta["resourceVersion"]), job.get("status") or {}
    if actions.status_changed:
        version = await kube.run(kube.write_status, namespace, name, version, old, actions.status)
    for manifest in actions.children:
        if expected.pending(uid, attempt, manifest):
            continue  # this process created it moments ago; the watch has not shown it yet
        try:
            created = await kube.run(kube.ensure, manifest)
        except Rejected as err:
            failed = reject(actions.status, str(err), generation=int(meta.get("generation") or 0), now=_now())
            await kube.run(kube.write_status, namespace, name, version, actions.status.to_patch(), failed)
            kopf.event(body, type="Warning", reason=Reason.CHILD_REJECTED, message=str(err)[:1024])
            return
        expected.created(uid, attempt, manifest)
        if created and manifest["kind"] == "Pod":
            metrics.PODS_CREATED.inc()
    for pod in actions.delete_pods:
        await kube.run(kube.delete_pod, namespace, pod)
    for event in actions.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])
    if actions.delete_job:
        await kube.run(kube.delete_job, namespace, name)


async def _look_up(namespace: str, names: list[str]) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """Read pods directly: the trimmed ones that exist, and the names the API server answers 404 for."""
    kube = Runtime.kube
    bodies = await asyncio.gather(*(kube.run(kube.read_pod, namespace, n) for n in names))
    found = [trim_pod(b) for b in bodies if b is not None]
    return found, frozenset(n for n, b in zip(names, bodies, strict=True) if b is None)


class _NodeView(Mapping[str, Any]):
    """The node index as name → trimmed node, read on demand: a pass looks up the one or two nodes
    its pods are on, so it does not copy an entry per node of the cluster."""

    def __init__(self, index: kopf.Index[Any, Any]) -> None:
        self.index = index

    def __getitem__(self, name: str) -> Any:
        for node in self.index[name]:
            return node
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


async def _until_changed(body: kopf.Body, resource_version: str, wakeup: asyncio.Event) -> None:
    """Wait (briefly) until the live body shows a newer version than the one a pass decided from.

    kopf replaces the body before ``job_changed`` sets ``wakeup``, so this sleeps until an event; a
    wake-up meant for something else (a pod) is kept for the loop."""
    deadline = time.monotonic() + CONSISTENCY_TIMEOUT
    kept = False
    while body.metadata.get("resourceVersion") == resource_version:
        if wakeup.is_set():
            kept = True
            wakeup.clear()
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wakeup.wait(), timeout=left)
    if kept:
        wakeup.set()


def _created(meta: Mapping[str, Any], now: datetime) -> datetime:
    raw = meta.get("creationTimestamp")
    return datetime.fromisoformat(raw.replace("Z", "+00:00")) if isinstance(raw, str) else now
