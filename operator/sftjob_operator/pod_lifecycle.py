"""Where trainer pods stand between created and gone, beyond the classifier's verdicts.

Three questions the reconcile asks of its pods, each a pure function of the pods and nodes it observes:

- why a pod that does not run yet waits (its containers' waiting reason, such as ``ContainerCreating``
  while a volume still attached to a lost node cannot attach here), for the ``Running`` condition;
- whether an earlier attempt's pod may still be running its trainer, e.g. saving the checkpoint it
  writes on SIGTERM: the next attempt starts only once none may, since it takes over the checkpoint
  volume (``OWNER``) and the old trainer's save would be thrown away;
- which pods may be deleted with force: those on a node that is gone, or that its admin marked out of
  service (``node.kubernetes.io/out-of-service``, as Kubernetes' own non-graceful node shutdown does).
  Their kubelet can never confirm a graceful delete, so they would stay ``Terminating`` (holding a
  ReadWriteOnce claim). A node that is only NotReady may still run its containers (a kubelet restart, a
  network partition, a control-plane outage): its pods get a graceful delete, as Kubernetes gives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sftjob import constants as c
from sftjob_operator import observe
from sftjob_operator.classify import node_lost, parse_time

Obj = Mapping[str, Any]

# A pod still there this long past its deletion deadline (``deletionTimestamp``: when the kubelet kills
# what is left of it) runs nothing more: only a finalizer or a slow kubelet keeps the object.
STOP_OVERDUE = timedelta(seconds=60)


def waiting_reasons(pods: Sequence[Obj]) -> str:
    """Why the pods that do not run yet wait: ``job-2-0: ContainerCreating``, one per pod whose
    containers say (init containers first), ``; ``-separated; empty when none says."""
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        containers = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        waiting = next((w for cs in containers if (w := (cs.get("state") or {}).get("waiting"))), None)
        if waiting and waiting.get("reason"):
            message = f" ({waiting['message']})" if waiting.get("message") else ""
            found.append(f"{observe.name(pod)}: {waiting['reason']}{message}")
    return "; ".join(found)


def stopping_attempt(pods: Sequence[Obj], nodes: Mapping[str, Obj], *, now: datetime) -> int | None:
    """The newest attempt of ``pods`` with a pod that may still run its trainer (None: none may).

    Such a pod is Pending, Running or Unknown (being deleted or not) on a node that is not lost, and not
    :data:`STOP_OVERDUE` past its deletion deadline. A pod never bound to a node ran nothing, and one on
    a lost node can neither run on nor be waited for (it is deleted with force)."""
    return max((observe.attempt_of(p) for p in pods if _may_still_run(p, nodes, now)), default=None)


def on_gone_nodes(pods: Sequence[Obj], nodes: Mapping[str, Obj]) -> set[str]:
    """The names of the pods bound to a node that is gone or out of service: nothing runs them any more."""
    return {
        observe.name(p)
        for p in pods
        if (node := observe.node_of(p)) is not None and observe.out_of_service(nodes.get(node))
    }


def held_by_kueue(pods: Sequence[Obj]) -> list[Obj]:
    """The pods deleted before Kueue admitted them (spec.queueName). Kueue takes its finalizer off a pod
    once the pod has stopped, and one never bound never stops: it and its group's Workload would stay for
    good (kubernetes-sigs/kueue#5130), holding the pod names of the attempt. The operator takes the
    finalizer off these itself."""
    return [
        p
        for p in pods
        if p["metadata"].get("deletionTimestamp")
        and observe.node_of(p) is None
        and c.KUEUE_FINALIZER in (p["metadata"].get("finalizers") or [])
    ]


def _may_still_run(pod: Obj, nodes: Mapping[str, Obj], now: datetime) -> bool:
    node = observe.node_of(pod)
    if observe.phase_of(pod) not in observe.ACTIVE_PHASES or node is None or node_lost(nodes.get(node), now):
        return False
    deadline = parse_time(pod["metadata"].get("deletionTimestamp"))
    return deadline is None or now < deadline + STOP_OVERDUE
