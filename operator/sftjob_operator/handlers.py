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
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kopf

from sftjob import constants as c
from sftjob_operator import metrics
from sftjob_operator.conditions import Reason
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
# After our own status write, wait at most this long for the watch to deliver it before the next pass.
CONSISTENCY_TIMEOUT = 5.0

_wakeups: dict[tuple[str, str], asyncio.Event] = {}


class Runtime:
    """Operator-wide state the handlers share, set once by ``main`` before kopf starts."""

    context: Context
    kube: Kube
    resync_seconds: float = RESYNC_SECONDS


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
def trainer_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {(namespace, labels[c.LABEL_JOB]): trim_pod(body)}


@kopf.index("nodes")
def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {name: trim_node(body)}


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.PLURAL)
def job_changed(namespace: str | None, name: str | None, **_: Any) -> None:
    metrics.WATCH_EVENTS.labels(kind=c.KIND).inc()
    wake(namespace, name)


@kopf.on.event("pods", labels={c.LABEL_JOB: kopf.PRESENT})
def pod_changed(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
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
                delay = await _pass(body, trainer_pods, gpu_nodes)
                backoff = ERROR_BACKOFF[0]
            except Conflict as stale:
                delay = await _until_changed(body, stale.resource_version)
            except Exception:  # an API or programming error: say so, keep the loop alive, back off
                log.exception("reconcile of %s/%s failed; retrying in %.0f s", namespace, name, backoff)
                metrics.RECONCILES.labels(result="error").inc()
                delay, backoff = backoff, min(backoff * 2, ERROR_BACKOFF[1])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
    finally:
        _wakeups.pop(key, None)
        metrics.track_job(*key, None)


async def _pass(body: kopf.Body, pods: kopf.Index[Any, Any], nodes: kopf.Index[Any, Any]) -> float:
    """One reconcile pass; returns how long until the next one is due."""
    started = time.monotonic()
    snapshot = copy.deepcopy(dict(body))
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
        pods=[copy.deepcopy(p) for p in pods.get((namespace, name), [])],
        nodes={node_name: next(iter(store)) for node_name, store in nodes.items()},
        now=now,
    )
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
        await _until_changed(body, str(meta.get("resourceVersion")))
    due = Runtime.resync_seconds if actions.requeue_after is None else actions.requeue_after
    return min(due, Runtime.resync_seconds)


async def _apply(job: dict[str, Any], body: kopf.Body, actions: Actions) -> None:
    meta = job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    kube = Runtime.kube
    version, old = str(meta["resourceVersion"]), job.get("status") or {}
    if actions.status_changed:
        version = await asyncio.to_thread(kube.write_status, namespace, name, version, old, actions.status)
    for manifest in actions.children:
        try:
            created = await asyncio.to_thread(kube.ensure, manifest)
        except Rejected as err:
            failed = reject(actions.status, str(err), generation=int(meta.get("generation") or 0), now=_now())
            await asyncio.to_thread(
                kube.write_status, namespace, name, version, actions.status.to_patch(), failed
            )
            kopf.event(body, type="Warning", reason=Reason.CHILD_REJECTED, message=str(err)[:1024])
            return
        if created and manifest["kind"] == "Pod":
            metrics.PODS_CREATED.inc()
    for pod in actions.delete_pods:
        await asyncio.to_thread(kube.delete_pod, namespace, pod)
    for event in actions.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])
    if actions.delete_job:
        await asyncio.to_thread(kube.delete_job, namespace, name)


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


async def _until_changed(body: kopf.Body, resource_version: str) -> float:
    """Wait (briefly) until the live body shows a newer version than the one a pass decided from."""
    deadline = time.monotonic() + CONSISTENCY_TIMEOUT
    while body.metadata.get("resourceVersion") == resource_version and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return 0.0


def _created(meta: Mapping[str, Any], now: datetime) -> datetime:
    raw = meta.get("creationTimestamp")
    return datetime.fromisoformat(raw.replace("Z", "+00:00")) if isinstance(raw, str) else now
