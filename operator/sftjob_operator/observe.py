"""What the operator reads off the objects it watches, as plain data: compact jobs and trimmed pods and
nodes for the in-memory indexes, and the trainer's progress and checkpoint reports from pod annotations.

Pure functions over API dicts; the indexes in ``handlers.py`` store what :meth:`JobView.of`,
:func:`trim_pod` and :func:`trim_node` return so a job's reconcile never lists anything.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from sftjob import constants as c
from sftjob.job_status import CheckpointStatus, ProgressStatus, TrackingUrls
from sftjob_operator.driver_floor import driver_too_old

Obj = Mapping[str, Any]
ACTIVE_PHASES = frozenset({"Pending", "Running", "Unknown"})
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A tracker's run page as the status may show it (status.progress.trackingUrls; the CRD's bound).
WEB_ADDRESS, MAX_TRACKING_URL = r"https?://[^\s]+", 2048
# The pod conditions the reconcile and the failure classifier read, and the fields they read of them.
# The kubelet's PodReadyToStartContainers: False while it cannot set the pod up (e.g. mount its volumes).
SANDBOX_CONDITION = "PodReadyToStartContainers"
POD_CONDITIONS = frozenset({"PodScheduled", "DisruptionTarget", "TerminationTarget", SANDBOX_CONDITION})
CONDITION_FIELDS = ("type", "status", "reason", "message")
# PodScheduled's reason while a pod still has scheduling gates (e.g. Kueue's, until admission).
SCHEDULING_GATED = "SchedulingGated"
KUEUE_MANAGED = "kueue.x-k8s.io/managed"  # the label Kueue's webhook puts on the pods it manages
# The taint an admin puts on a node that is shut down (non-graceful node shutdown).
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
# The scheduler's words for nodes whose labels the pod's node affinity (the driver floor included) rejects.
AFFINITY_MISMATCH = "didn't match Pod's node affinity/selector"


@dataclass(frozen=True, slots=True)
class JobView:
    """An SFTJob as the index keeps it: its identity, and its spec and status as compact JSON text.

    Text because thousands of jobs stay in memory between their passes: as Python dicts and strings a
    job costs several times its JSON (a 14 KiB SFTJob decodes to 38 KiB of objects), and a pass parses
    the spec into a model anyway."""

    namespace: str
    name: str
    uid: str
    generation: int
    resource_version: str
    created: str | None
    deleting: bool
    spec_json: str
    status_json: str

    @classmethod
    def of(cls, body: Obj) -> JobView:
        meta = body.get("metadata") or {}
        return cls(
            namespace=str(meta.get("namespace") or ""),
            name=str(meta.get("name") or ""),
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
            resource_version=str(meta.get("resourceVersion") or ""),
            created=meta.get("creationTimestamp"),
            deleting=bool(meta.get("deletionTimestamp")),
            spec_json=json.dumps(body.get("spec") or {}, separators=(",", ":")),
            status_json=json.dumps(body.get("status") or {}, separators=(",", ":")),
        )

    def spec(self) -> dict[str, Any]:
        return dict(json.loads(self.spec_json))

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self.status_json))


class FirstOfEach(Mapping[str, Any]):
    """An index (key → the objects filed under it; the operator's node index holds one per name) as key →
    its first object, read on demand: a pass looks up the one or two nodes its pods are on, so it does
    not copy an entry per node of the cluster."""

    def __init__(self, index: Mapping[str, Iterable[Any]]) -> None:
        self.index = index

    def __getitem__(self, name: str) -> Any:
        for node in self.index[name]:
            return node
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def trim_pod(body: Obj) -> dict[str, Any]:
    """The parts of a trainer pod the reconcile and the failure classifier read, and its identity: its
    uid (deletes are conditioned on it) and its controller's (the job it belongs to)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    return {
        "metadata": {
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            "ownerReferences": [
                {"uid": ref.get("uid"), "controller": True}
                for ref in meta.get("ownerReferences") or []
                if ref.get("controller")
            ],
            "labels": dict(meta.get("labels") or {}),
            "annotations": {
                k: v
                for k, v in (meta.get("annotations") or {}).items()
                if k in (c.ANNOTATION_PROGRESS, c.ANNOTATION_CHECKPOINT)
            },
            "creationTimestamp": meta.get("creationTimestamp"),
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "finalizers": [f for f in meta.get("finalizers") or [] if f == c.KUEUE_FINALIZER],
        },
        "spec": {"nodeName": spec.get("nodeName")},
        "status": _trim_pod_status(body.get("status") or {}),
    }


def _trim_pod_status(status: Obj) -> dict[str, Any]:
    """Phase, reason and message, the conditions the classifier reads, and each container's state."""
    out: dict[str, Any] = {k: status[k] for k in ("phase", "reason", "message", "startTime") if status.get(k)}
    conditions = [
        {k: x.get(k) for k in CONDITION_FIELDS}
        for x in status.get("conditions") or []
        if x.get("type") in POD_CONDITIONS
    ]
    if conditions:
        out["conditions"] = conditions
    for key in ("initContainerStatuses", "containerStatuses"):
        if status.get(key):
            out[key] = [
                {"name": cs.get("name"), "image": cs.get("image"), "state": _plain(cs.get("state") or {})}
                for cs in status[key]
            ]
    return out


def _plain(value: Any) -> Any:
    """A deep copy of JSON data (the watch's decoded dicts are not kept alive by the index)."""
    return json.loads(json.dumps(value))


def trim_node(body: Obj) -> dict[str, Any]:
    """The parts of a node that matter: its GPU product and driver major, allocatable memory, readiness
    and whether it is out of service."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    taints = (body.get("spec") or {}).get("taints") or []
    return {
        "metadata": {
            "name": meta.get("name"),
            "labels": {k: (meta.get("labels") or {}).get(k) for k in (c.GFD_PRODUCT, c.GFD_DRIVER_MAJOR)},
        },
        "spec": {"taints": [dict(t) for t in taints if t.get("key") == OUT_OF_SERVICE_TAINT]},
        "status": {
            "allocatable": dict(status.get("allocatable") or {}),
            "conditions": [dict(x) for x in status.get("conditions") or [] if x.get("type") == "Ready"],
        },
    }


def out_of_service(node: Obj | None) -> bool:
    """A node that is gone, or that its admin tainted ``node.kubernetes.io/out-of-service`` (it is shut
    down: Kubernetes' non-graceful node shutdown): the pods bound to it run nothing any more."""
    if node is None:
        return True
    taints = (node.get("spec") or {}).get("taints") or []
    return any(t.get("key") == OUT_OF_SERVICE_TAINT for t in taints)


def controller_uid(obj: Obj) -> str | None:
    """The uid of the object's controller (its ``controller: true`` ownerReference), if it has one."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((str(ref.get("uid")) for ref in refs if ref.get("controller")), None)


def owned(pods: Iterable[Obj], uid: str) -> list[Obj]:
    """The pods whose controller is the job with ``uid``. Pods are indexed by the job's name, which a
    job deleted and created again shares with its predecessor, whose pods may take minutes to go."""
    return [p for p in pods if controller_uid(p) == uid]


def name(pod: Obj) -> str:
    return str(pod["metadata"]["name"])


def uid_of(pod: Obj) -> str:
    return str(pod["metadata"]["uid"])


def label_int(pod: Obj, key: str) -> int | None:
    value = (pod["metadata"].get("labels") or {}).get(key)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def attempt_of(pod: Obj) -> int:
    return label_int(pod, c.LABEL_ATTEMPT) or 0


def rank_of(pod: Obj) -> int:
    return label_int(pod, c.LABEL_RANK) or 0


def node_of(pod: Obj) -> str | None:
    return (pod.get("spec") or {}).get("nodeName")


def phase_of(pod: Obj) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def is_active(pod: Obj) -> bool:
    """Still holds (or may soon hold) GPUs: not finished and not already being deleted."""
    return phase_of(pod) in ACTIVE_PHASES and not pod["metadata"].get("deletionTimestamp")


def product_of(node: Obj | None) -> str | None:
    if node is None:
        return None
    return (node["metadata"].get("labels") or {}).get(c.GFD_PRODUCT)


def unschedulable_message(
    pods: Sequence[Obj],
    *,
    nodes: Iterable[Obj] = (),
    products: Collection[str] = (),
    min_driver_major: int | None = None,
) -> str | None:
    """The scheduler's explanation when a pod cannot be placed (PodScheduled=False, Unschedulable); a pod
    held by scheduling gates (:func:`gated_message`) is not looked at yet. When the scheduler found no
    node affinity matched and it is the driver floor of the operator's image (``min_driver_major``, none
    for a job's own image) that rules out every node with one of the job's GPU ``products``, it says so."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            waiting = cond.get("type") == "PodScheduled" and cond.get("status") == "False"
            if waiting and cond.get("reason") != SCHEDULING_GATED:
                message = str(cond.get("message") or cond.get("reason") or "unschedulable")
                old = AFFINITY_MISMATCH in message and driver_too_old(nodes, products, min_driver_major)
                return f"{message.rstrip('. ')}; {old}" if old else message
    return None


def gated_message(pods: Sequence[Obj]) -> str | None:
    """Why pods wait before the scheduler: scheduling gates (Kueue's admission gate while the job's queue
    has no quota for it: spec.queueName), or None when no pod is held by one."""
    gated = [p for p in pods if _pod_scheduled_reason(p) == SCHEDULING_GATED]
    if not gated:
        return None
    queue = next(
        (q for p in gated if (q := (p["metadata"].get("labels") or {}).get(c.KUEUE_QUEUE_LABEL))), None
    )
    waits = f"admission by Kueue's queue {queue}" if queue else "their gates are removed"
    return f"queued: {len(gated)} of {len(pods)} pod(s) held by scheduling gates until {waits}"


def queue_ignored(queue: str | None, pods: Sequence[Obj]) -> str:
    """A note for pods bound with ``spec.queueName`` set that Kueue does not manage (its webhook labels
    the pods it does): the namespace is outside Kueue's pod integration, so the queue has no effect."""
    if not queue or any((p["metadata"].get("labels") or {}).get(KUEUE_MANAGED) == "true" for p in pods):
        return ""
    return f" (spec.queueName {queue} has no effect: Kueue's pod integration does not manage these pods)"


def _pod_scheduled_reason(pod: Obj) -> str | None:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((x.get("reason") for x in conditions if x.get("type") == "PodScheduled"), None)


def progress_of(pods: Sequence[Obj]) -> ProgressStatus | None:
    """The freshest progress report on any of the pods (rank 0 writes it)."""
    reports = [r for r in (_progress(p) for p in pods) if r is not None]
    return max(reports, key=lambda r: (r.step, r.updated or EPOCH), default=None)


def checkpoint_of(pods: Sequence[Obj]) -> CheckpointStatus | None:
    found = [cp for cp in (_checkpoint(p) for p in pods) if cp is not None]
    return max(found, key=lambda cp: cp.step, default=None)


def best_checkpoint_of(pods: Sequence[Obj]) -> CheckpointStatus | None:
    """The checkpoint with the lowest evaluation loss, as the newest checkpoint report names it."""
    found = []
    for pod in pods:
        report = _annotation(pod, c.ANNOTATION_CHECKPOINT) or {}
        best = report.get("best")
        if not isinstance(best, dict) or _finite(best.get("evalLoss")) is None:
            continue
        try:
            found.append((int(report.get("step") or 0), CheckpointStatus.model_validate(best)))
        except (ValueError, TypeError, OverflowError, ValidationError):  # int(inf): OverflowError
            continue
    return max(found, key=lambda pair: pair[0], default=(0, None))[1]


def _annotation(pod: Obj, key: str) -> dict[str, Any] | None:
    raw = (pod["metadata"].get("annotations") or {}).get(key)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _progress(pod: Obj) -> ProgressStatus | None:
    report = _annotation(pod, c.ANNOTATION_PROGRESS)
    if report is None:
        return None
    try:
        step, total = int(report.get("step") or 0), int(report.get("totalSteps") or 0)
        eta = _finite(report.get("etaSeconds"))
        return ProgressStatus(
            step=step,
            total_steps=total,
            epoch=round(_finite(report.get("epoch")) or 0.0, 4),
            loss=_rounded(report.get("loss"), 4),
            learning_rate=_finite(report.get("learningRate")),
            tokens_per_second=_rounded(report.get("tokensPerSecond"), 1),
            eta_seconds=None if eta is None else int(eta),
            eval_loss=_rounded(report.get("evalLoss"), 4),
            eval_step=int(report["evalStep"]) if report.get("evalStep") is not None else None,
            planned_steps=int(report["plannedSteps"]) if report.get("plannedSteps") is not None else None,
            updated=report.get("updated"),
            summary=f"{step}/{total or '?'}",  # no total yet: a download heartbeat before the data is read
            tracking_urls=_tracking_urls(report.get("trackingUrls")),
        )
    except (
        ValueError,
        TypeError,
        OverflowError,
        ValidationError,
    ):  # a report that cannot be read is no report
        return None


def _tracking_urls(reported: Any) -> TrackingUrls | None:
    """The trackers' run pages of a report, each kept only when it is a web address (the status shows it as a
    link; the CRD's length bound holds)."""
    if not isinstance(reported, dict):
        return None
    urls = {
        tracker: url
        for tracker in ("mlflow", "wandb")
        if isinstance(url := reported.get(tracker), str)
        and len(url) <= MAX_TRACKING_URL
        and re.fullmatch(WEB_ADDRESS, url)
    }
    return TrackingUrls(**urls) if urls else None


def _rounded(value: Any, digits: int) -> float | None:
    number = _finite(value)
    return None if number is None else round(number, digits)


def _checkpoint(pod: Obj) -> CheckpointStatus | None:
    report = _annotation(pod, c.ANNOTATION_CHECKPOINT)
    if report is None:
        return None
    try:
        checkpoint = CheckpointStatus.model_validate(report)
    except ValidationError:
        return None
    if checkpoint.eval_loss is not None and not math.isfinite(checkpoint.eval_loss):
        return checkpoint.model_copy(update={"eval_loss": None})  # a JSON status holds no NaN
    return checkpoint
