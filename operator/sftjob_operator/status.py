"""Pieces of an SFTJob's status computed from what the operator observes: pure helpers the reconcile
(and the handlers, for a child the API server rejects) build the status with."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from sftjob.job_status import GpuStatus, SFTJobStatus
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator import observe
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason, set_condition
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.scheduling import ProductMap, profile_of, type_of

Obj = Mapping[str, Any]


def parse_status(raw: Obj) -> SFTJobStatus:
    try:
        return SFTJobStatus.model_validate(raw or {})
    except ValidationError:  # a status we cannot read is rebuilt from what we observe
        return SFTJobStatus()


def gpu_status(
    spec: SFTJobSpec,
    pods: Sequence[Obj],
    nodes: Mapping[str, Obj],
    products: ProductMap,
    plans: CandidatePlans,
) -> tuple[GpuStatus, Plan | None]:
    """Where the attempt's pods landed (by rank) and the plan for that card (None before they land)."""
    bound = [observe.node_of(p) for p in pods]
    landed = next((p for p in (observe.product_of(nodes.get(n or "")) for n in bound) if p), None)
    gpu_type = type_of(landed, products) if landed else None
    profile = profile_of(landed, gpu_type) if landed else None
    status = GpuStatus(
        summary=gpu_summary(spec, gpu_type),
        type=gpu_type,
        product=landed,
        profile=profile.key if profile else None,
        count=spec.gpu.count,
        nodes=[n for n in bound if n],
    )
    return status, plans.for_product(landed) if landed else None


def gpu_summary(spec: SFTJobSpec, gpu_type: str | None) -> str:
    """``8xA800`` (``2x8xA800`` for two nodes) once landed; the request (``1xL40S|A40``) before."""
    if gpu_type is None:
        return spec.gpu.describe()
    per_node = f"{spec.gpu.count}x{gpu_type}"
    return per_node if spec.gpu.nodes == 1 else f"{spec.gpu.nodes}x{per_node}"


def validation_message(err: ValidationError) -> str:
    """The first few problems of a spec the model rejects, each naming its field (``spec.gpu.count``)."""
    parts = []
    for e in err.errors()[:5]:
        where = ".".join(str(x) for x in ("spec", *e["loc"]))
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


def reject(status: SFTJobStatus, message: str, *, generation: int, now: datetime) -> SFTJobStatus:
    """The status after the API server refused one of the job's children as invalid: retrying the same
    manifest cannot help, so the job fails (reason ChildRejected) and its next pass cleans up."""
    conditions = status.conditions
    for type, value, text in (
        (T.FAILED, True, message),
        (T.SUCCEEDED, False, ""),
        (T.RUNNING, False, "failed"),
    ):
        conditions = set_condition(
            conditions, type=type, status=value, reason=Reason.CHILD_REJECTED, message=text[:4096],
            generation=generation, now=now,
        )  # fmt: skip
    return status.model_copy(
        update={"conditions": conditions, "phase": "Failed", "completion_time": status.completion_time or now}
    )


def failed_create(status: SFTJobStatus, message: str, *, generation: int, now: datetime) -> SFTJobStatus:
    """The status after the API server refused to create one of the attempt's children for now (HTTP 403:
    a ResourceQuota, Pod Security admission, a webhook). ``Scheduled`` says why no pod exists; the
    reconcile keeps that condition and retries the create instead of judging the pod deleted."""
    conditions = set_condition(
        status.conditions, type=T.SCHEDULED, status=False, reason=Reason.FAILED_CREATE,
        message=message[:4096], generation=generation, now=now,
    )  # fmt: skip
    return status.model_copy(update={"conditions": conditions})
