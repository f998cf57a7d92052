"""The reads a reconcile pass asks for beyond the watch indexes, each done in the thin I/O layer and
handed back to the pure decision: pods the index lacks long after their attempt started, a multi-node
job's claims before its first attempt, and the Workload of an attempt Kueue holds at its gate."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from sftjob_operator import observe, workloads
from sftjob_operator.kube import Kube
from sftjob_operator.observe import JobView, trim_pod

log = logging.getLogger(__name__)

JobKey = tuple[str, str]
# Per queued job: the pod group whose Workload was read, Kueue's reason then, and when to read again.
QueueReasons = dict[JobKey, tuple[str, str | None, float]]
# A queued attempt's Workload is read again at most this often: it only words a message, and a thousand
# queued jobs would otherwise cost a read each every pass...
WORKLOAD_READ_SECONDS = 120.0
# ... and sooner while it has no reason to give: Kueue has not made it, or not tried to admit it yet.
WORKLOAD_RETRY_SECONDS = 10.0


async def look_up(kube: Kube, job: JobView, names: Sequence[str]) -> tuple[list[observe.Obj], frozenset[str]]:
    """Read the job's pods directly: the trimmed ones that exist, and the names it has no pod of (the API
    server answers 404, or the pod of that name is another job's, an earlier one of this name)."""
    bodies = await asyncio.gather(*(kube.run(kube.read_pod, job.namespace, n) for n in names))
    found = observe.owned((trim_pod(b) for b in bodies if b is not None), job.uid)
    there = {observe.name(p) for p in found}
    return found, frozenset(n for n in names if n not in there)


async def read_claims(kube: Kube, namespace: str, names: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """The PersistentVolumeClaims ``names`` (None for one that cannot be read)."""
    read = await asyncio.gather(*(kube.run(kube.read_claim, namespace, n) for n in names))
    return dict(zip(names, read, strict=True))


async def queue_reason(kube: Kube, cache: QueueReasons, key: JobKey, group: str) -> str | None:
    """Kueue's reason for holding pod group ``group`` of job ``key``, read at most every
    WORKLOAD_READ_SECONDS (WORKLOAD_RETRY_SECONDS while the Workload gives none). Best effort: a failed
    read keeps the reason the last one gave (none before the first), and is tried again soon."""
    now = time.monotonic()
    cached = cache.get(key)
    if cached is not None and cached[0] == group and cached[2] > now:
        return cached[1]
    try:
        workload = await kube.run(kube.read_workload, key[0], group)
    except Exception as err:
        log.warning("reading Kueue's Workload %s/%s failed: %s", key[0], group, err)
        kept = cached[1] if cached is not None and cached[0] == group else None  # no flapping message
        cache[key] = (group, kept, now + WORKLOAD_RETRY_SECONDS)
        return kept
    reason = workloads.pending_reason(workload)
    again = WORKLOAD_READ_SECONDS if reason is not None else WORKLOAD_RETRY_SECONDS
    cache[key] = (group, reason, now + again)
    return reason
