"""Pieces of an SFTJob's status computed from what the operator observes: pure helpers the reconcile
(and the handlers, for a child the API server rejects) build the status with, and the lenient reading
of a status written by another operator version or by hand."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from sftjob.failures import FailureClass
from sftjob.gpu_products import profile_of
from sftjob.job_status import GpuStatus, SFTJobStatus
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator import observe
from sftjob_operator.conditions import ConditionType as T
from sftjob_operator.conditions import Reason, set_condition
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.scheduling import ProductMap, type_of
from sftjob_operator.status_draft import CONDITION_MESSAGE_MAX, StatusDraft

Obj = Mapping[str, Any]
# Rounds of repairs before a status is given up as unreadable; each round removes what the previous
# validation named, so one round is all a JSON status ever needs.
REPAIR_ROUNDS = 3


def parse_status(raw: Obj) -> SFTJobStatus:
    return read_status(raw)[0]


def read_status(raw: Obj) -> tuple[SFTJobStatus, list[str]]:
    """The status as far as this operator can read it, and what it had to repair (empty: nothing).

    The status is the job's history (attempt numbers, restart budgets, checkpoints), so it is never
    dropped whole for one bad part: an attempt whose ``reason`` is a failure class this operator does
    not know (a downgrade past a newer class) reads as ``Unknown``; an unreadable attempt or condition
    is left out; any other unreadable field takes its default.
    """
    data = copy.deepcopy(dict(raw or {}))
    repairs: list[str] = []
    for _ in range(REPAIR_ROUNDS):
        try:
            return SFTJobStatus.model_validate(data), repairs
        except ValidationError as err:
            repairs += _repair(data, err)
    return SFTJobStatus(), [*repairs, "status unreadable: rebuilt from what the operator observes"]


def _repair(data: dict[str, Any], err: ValidationError) -> list[str]:
    """Fix ``data`` in place where ``err`` points; says what was done, field by field."""
    unknown_reasons: dict[int, object] = {}
    dropped_items: dict[tuple[str, int], str] = {}  # (field, index) -> why
    dropped_fields: dict[str, str] = {}
    for e in err.errors():
        loc = e["loc"]
        field, rest = (str(loc[0]), loc[1:]) if loc else ("status", ())
        why = f"{'.'.join(str(x) for x in loc)}: {e['msg']}"
        if field == "attempts" and len(rest) == 2 and rest[1] == "reason" and isinstance(rest[0], int):
            unknown_reasons[rest[0]] = e["input"]
        elif rest and isinstance(rest[0], int) and isinstance(data.get(field), list):
            dropped_items.setdefault((field, rest[0]), why)
        else:
            dropped_fields.setdefault(field, why)
    repairs: list[str] = []
    for index, reason in sorted(unknown_reasons.items()):
        if ("attempts", index) not in dropped_items:
            data["attempts"][index]["reason"] = FailureClass.UNKNOWN.value
            repairs.append(f"status.attempts[{index}].reason {reason!r} is unknown here: read as Unknown")
    for (field, index), why in sorted(dropped_items.items()):
        repairs.append(f"status.{field}[{index}] left out ({why})")
    for field, index in sorted(dropped_items, reverse=True):  # from the end: the indexes stay valid
        del data[field][index]
    for field, why in sorted(dropped_fields.items()):
        data.pop(field, None)
        repairs.append(f"status.{field} reset ({why})")
    return repairs


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


def node_of_rank(gpu: GpuStatus, spec: SFTJobSpec, rank: int) -> str | None:
    """The node the pod of ``rank`` was bound to when ``gpu`` was written. ``gpu.nodes`` lists the bound
    pods' nodes in rank order, so it names each rank's node once every pod was bound; a pod that
    vanished before that has no node to blame."""
    return gpu.nodes[rank] if len(gpu.nodes) == spec.gpu.nodes else None


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
    manifest cannot help, so the job fails (reason ChildRejected) as any job fails (its attempt ends
    with the message, ``Scheduled`` says no pods), and its next pass cleans up."""
    draft = StatusDraft(status, generation=generation, now=now)
    # The record's message has the CRD's bound of a condition's; the API server's may be longer.
    draft.failed(status.attempt, Reason.CHILD_REJECTED, message[:CONDITION_MESSAGE_MAX], ended_as=None)
    return draft.status


def failed_create(status: SFTJobStatus, message: str, *, generation: int, now: datetime) -> SFTJobStatus:
    """The status after one of the attempt's children could not be created for now (a ResourceQuota,
    Pod Security admission or a webhook refused it, the API server was overloaded or unreachable, an
    earlier job's object still holds its name). ``Scheduled`` says why no pod exists; the reconcile
    keeps that condition and retries the create instead of judging the pod deleted."""
    conditions = set_condition(
        status.conditions, type=T.SCHEDULED, status=False, reason=Reason.FAILED_CREATE,
        message=message[:4096], generation=generation, now=now,
    )  # fmt: skip
    return status.model_copy(update={"conditions": conditions})
