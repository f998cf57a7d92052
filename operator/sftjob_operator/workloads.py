"""What the operator reads of Kueue's Workload for a queued attempt: why Kueue has not admitted it yet.

Kueue makes one Workload per pod group, named after the group (`pods.queue_labels`), and says in its
`QuotaReserved` condition why the group waits: the quota it lacks ("insufficient unused quota for
nvidia.com/gpu in flavor a800, 4 more needed"), a LocalQueue that does not exist, an inactive
ClusterQueue. Put in the job's `Queued` condition, that answers the question a user asks of a job that
does not start, without `kubectl describe workload`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sftjob import constants as c
from sftjob_operator.observe import SCHEDULING_GATED

Obj = Mapping[str, Any]
MAX_MESSAGE = 300  # Kueue lists every pod set and flavor it tried: enough for the first reason or two


def queued_group(pods: Sequence[Obj]) -> str | None:
    """The pod group (= Workload name) of the pods still held by a scheduling gate (Kueue's, until it
    admits the group), if any."""
    for pod in pods:
        conditions = (pod.get("status") or {}).get("conditions") or []
        gated = any(
            x.get("type") == "PodScheduled" and x.get("reason") == SCHEDULING_GATED for x in conditions
        )
        group = (pod["metadata"].get("labels") or {}).get(c.KUEUE_POD_GROUP_LABEL)
        if gated and group:
            return str(group)
    return None


def pending_reason(workload: Obj | None) -> str | None:
    """Kueue's own words for why the Workload waits (its QuotaReserved condition while False), or None
    when it has no such condition yet or has reserved quota."""
    conditions = ((workload or {}).get("status") or {}).get("conditions") or []
    reserved = next((x for x in conditions if x.get("type") == "QuotaReserved"), None)
    if reserved is None or reserved.get("status") != "False" or not reserved.get("message"):
        return None
    message = " ".join(str(reserved["message"]).split())
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."
