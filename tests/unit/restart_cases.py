"""Attempt histories and plans for the restart-policy tests: a stand-in re-planner, failed records,
and the decision with the default policy."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sftjob.attempts import AttemptRecord, RestartPolicy
from sftjob.config import DistributedSettings, TrainingSettings
from sftjob.constants import GFD_PRODUCT
from sftjob.failures import FailureClass
from sftjob.plan import MemoryEstimate, Plan, PodResources
from sftjob_operator.attempt_policy import GiveUp, NextAttempt
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.restarts import decide

T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
A800, L40S = "A800-SXM4-80GB", "L40S"
PRODUCTS = {"NVIDIA-A800-SXM4-80GB": A800, "NVIDIA-L40S": L40S}


def plan(
    gpu: str = A800, micro_batch: int = 4, accumulation: int = 8, memory: str = "64Gi", per_node: int = 1
) -> Plan:
    return Plan(
        gpu=gpu,
        fits=True,
        training=TrainingSettings(
            global_batch_size=micro_batch * accumulation,
            micro_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation,
        ),
        distributed=DistributedSettings(nproc_per_node=per_node),
        resources=PodResources(cpu="8", memory=memory, shm_size="16Gi"),
        memory=MemoryEstimate(terms=[], total_gib=60.0, budget_gib=70.0),
        predicted_tokens_per_second=1000.0,
        predicted_mfu=0.4,
    )


def candidates(*plans: Plan) -> CandidatePlans:
    return CandidatePlans({p.gpu: p for p in plans or (plan(),)}, PRODUCTS)


def halve_micro_batch(p: Plan) -> Plan:
    """A stand-in re-planner for policy tests: one rung (halve the micro-batch), then exhausted."""
    t = p.training
    if t.micro_batch_size == 1:
        return p.model_copy(update={"fits": False, "ladder": [*p.ladder, "exhausted"]})
    training = t.model_copy(
        update={
            "micro_batch_size": t.micro_batch_size // 2,
            "gradient_accumulation_steps": t.gradient_accumulation_steps * 2,
        }
    )
    return p.model_copy(update={"training": training, "ladder": [*p.ladder, "halved"]})


def failed(attempt: int, reason: FailureClass, *, node: str = "gpu-0", gpu: str = A800) -> AttemptRecord:
    end = T0 + timedelta(minutes=attempt * 10)
    return AttemptRecord(
        attempt=attempt,
        node=node,
        gpu=gpu,
        start_time=end - timedelta(minutes=5),
        end_time=end,
        reason=reason,
        exit_code=1,
        message=f"{reason} happened",
    )


def history_of(*reasons: FailureClass, node: str = "gpu-0", gpu: str = A800) -> list[AttemptRecord]:
    return [failed(i, r, node=node, gpu=gpu) for i, r in enumerate(reasons, start=1)]


def node(name: str, memory: str, product: str | None = None) -> dict[str, Any]:
    """A node as the operator's index holds it: ``product`` is its GPU product label."""
    labels = {} if product is None else {GFD_PRODUCT: product}
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {"memory": memory}}}


def policy_decision(
    history: list[AttemptRecord],
    policy: RestartPolicy | None = None,
    plans: CandidatePlans | None = None,
    nodes: dict[str, Any] | None = None,
) -> NextAttempt | GiveUp:
    return decide(
        policy or RestartPolicy(), history, plans or candidates(), replan=halve_micro_batch, nodes=nodes or {}
    )


def restart(decision: NextAttempt | GiveUp) -> NextAttempt:
    assert isinstance(decision, NextAttempt), decision
    return decision


def give_up(decision: NextAttempt | GiveUp) -> GiveUp:
    assert isinstance(decision, GiveUp), decision
    return decision


def wait_of(decision: NextAttempt | GiveUp, history: list[AttemptRecord]) -> float:
    start, end = restart(decision).not_before, history[-1].end_time
    assert end is not None
    return 0.0 if start is None else (start - end).total_seconds()
