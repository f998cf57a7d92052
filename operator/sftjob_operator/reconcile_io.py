"""What a reconcile pass reads and what it returns: the boundary between the pure decision
(``reconcile.reconcile``) and the handlers that do the I/O (``handlers.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sftjob.job_status import SFTJobStatus
from sftjob_operator import restarts
from sftjob_operator.attempt_policy import AttemptPolicy, FinalFailure
from sftjob_operator.defaults import JobDefaults
from sftjob_operator.planning import PlanFn, planner_plan
from sftjob_operator.scheduling import ProductMap
from sftjob_operator.status_draft import Event

Obj = Mapping[str, Any]
Manifest = dict[str, Any]
# The grace of ``Actions.quick_delete_pods``: time for torchrun to pass SIGTERM on and its workers to exit.
SURVIVOR_GRACE_SECONDS = 30


@dataclass(frozen=True)
class Observed:
    """Everything a pass reads: the job (as the API returned it), its pods, the nodes, the time."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Obj
    status: Obj
    pods: Sequence[Obj]
    nodes: Mapping[str, Obj]
    now: datetime
    # Pods of the current attempt a direct read (asked for by ``Actions.check_pods``) found absent.
    gone: frozenset[str] = frozenset()
    # Kueue's reason for holding the attempt's pod group at its gate (``workloads.pending_reason``).
    queue_reason: str | None = None
    # The PersistentVolumeClaims a direct read (asked for by ``Actions.read_claims``) found, by name; None
    # for one it could not read (absent, or the operator may not get it).
    claims: Mapping[str, Obj | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    """Operator configuration the decision depends on."""

    products: ProductMap
    image: str
    # The driver major the operator's image needs (None: no constraint); jobs naming an image get none.
    image_min_driver_major: int | None = None
    # Secrets every trainer pod pulls its image with (its ServiceAccount's imagePullSecrets).
    trainer_image_pull_secrets: tuple[str, ...] = ()
    # Each job's trainers reachable only from its own pods (and on the metrics port): a NetworkPolicy.
    trainer_network_policy: bool = True
    plan_fn: PlanFn = planner_plan
    attempt_policy: AttemptPolicy = restarts.next_attempt
    final_failure: FinalFailure = restarts.final_failure
    defaults: JobDefaults = field(default_factory=JobDefaults)


@dataclass
class Actions:
    """The pass's verdict, applied in this order: status, pod deletions, children, job deletion. The
    deletions go before the children, so a create refused (a quota, a webhook) never holds them back: a
    lost node's pod may hold the very quota the next attempt's pod waits for."""

    status: SFTJobStatus
    status_changed: bool
    children: list[Manifest] = field(default_factory=list)  # created if missing (ConfigMap/Role: replaced)
    delete_pods: list[str] = field(default_factory=list)
    # Pods on a lost node, deleted with ``gracePeriodSeconds: 0``: their kubelet can never confirm a
    # graceful delete, so they would stay Terminating, holding the checkpoint claim, until deleted so.
    force_delete_pods: list[str] = field(default_factory=list)
    # Pods of an attempt that failed with a rank dead, gone or hung, deleted with ``SURVIVOR_GRACE_SECONDS``
    # rather than their own grace: their collective SIGTERM save cannot complete without that rank, and
    # torchrun would otherwise hold the GPUs for its whole --shutdown-timeout.
    quick_delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    # Posted once the job's delete went through: never for a delete refused and retried, nor for the 404
    # of a pass that ran again before the job's DELETED event.
    job_deleted: Event | None = None
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    # Pods the index lacks past their grace: read them directly and decide again with the answer
    # (found: add them to ``Observed.pods``; 404: ``Observed.gone``). Nothing else is applied.
    check_pods: list[str] = field(default_factory=list)
    # Claims to read before deciding (``Observed.claims``); nothing else is applied.
    read_claims: list[str] = field(default_factory=list)
