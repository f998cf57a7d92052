"""Hand-made observations for the reconcile tests: nodes, pods, a fake planner, the context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sftjob import constants as c
from sftjob.config import DistributedSettings, TrainingSettings
from sftjob.gpus import GpuProfile
from sftjob.plan import MemoryEstimate, Plan, PodResources
from sftjob.spec import SFTJobSpec
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions, Context, Observed
from sftjob_operator.scheduling import default_products

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
UID = "uid-1"  # the job's
PRODUCTS = {"a800-0": "NVIDIA-A800-SXM4-80GB", "l40s-0": "NVIDIA-L40S", "a40-0": "NVIDIA-A40"}
NODES = {
    name: {
        "metadata": {"name": name, "labels": {c.GFD_PRODUCT: product}},
        "status": {"allocatable": {"memory": "512Gi"}, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    for name, product in PRODUCTS.items()
}


def fake_plan(spec: SFTJobSpec, profile: GpuProfile, fits: bool = True) -> Plan:
    world = spec.gpu.count * spec.gpu.nodes
    return Plan(
        gpu=profile.key,
        fits=fits,
        training=TrainingSettings(
            global_batch_size=4 * world, micro_batch_size=4, gradient_accumulation_steps=1
        ),
        distributed=DistributedSettings(nnodes=spec.gpu.nodes, nproc_per_node=spec.gpu.count),
        resources=PodResources(cpu="8", memory="64Gi", shm_size="16Gi"),
        memory=MemoryEstimate(terms=[], total_gib=90.0 if not fits else 30.0, budget_gib=40.0),
        predicted_tokens_per_second=1000.0,
        predicted_mfu=0.4,
        reasons=["does not fit: needs ~90 GiB"] if not fits else [],
    )


CTX = Context(products=default_products(), image="trainer:test", plan_fn=fake_plan)
SPEC = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "dataset": {"name": "org/chats"},
    "gpu": {"type": "L40S"},
}


def pod(
    attempt: int = 1, rank: int = 0, phase: str = "Running", node: str | None = "l40s-0", **extra: Any
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if phase == "Running":
        status["containerStatuses"] = [
            {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T11:59:00Z"}}}
        ]
    status.update(extra.pop("status", {}))
    return {
        "metadata": {
            "name": f"job-{attempt}-{rank}",
            "uid": f"pod-{attempt}-{rank}",
            "ownerReferences": [{"uid": extra.pop("owner", UID), "controller": True}],
            "labels": {c.LABEL_JOB: "job", c.LABEL_ATTEMPT: str(attempt), c.LABEL_RANK: str(rank)},
            "annotations": extra.pop("annotations", {}),
        },
        "spec": {"nodeName": node},
        "status": status,
    }


def terminated(code: int, reason: str, message: str = "") -> dict[str, Any]:
    state = {"terminated": {"exitCode": code, "reason": reason, "message": message}}
    return {"containerStatuses": [{"name": "trainer", "state": state}]}


def preempted_status(message: str = "preempted") -> dict[str, Any]:
    """A trainer that saved on SIGTERM, in a pod the scheduler preempted (DisruptionTarget)."""
    disruption = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
    return {**terminated(20, "Error", message), "conditions": [disruption]}


def observed(
    spec: Mapping[str, Any] = SPEC,
    status: Mapping[str, Any] | None = None,
    pods: Sequence[dict[str, Any]] = (),
    now: datetime = NOW,
    generation: int = 1,
) -> Observed:
    # A multi-node job's first pass reads its claims: no checkpoint claim is left by an earlier "job".
    return Observed(
        name="job", namespace="team", uid=UID, generation=generation, spec=spec, status=status or {},
        pods=list(pods), nodes=NODES, now=now, claims={"job-checkpoints": None},
    )  # fmt: skip


def then(obs: Observed, actions: Actions, **changes: Any) -> Observed:
    """The next observation: the status the pass wrote, plus ``changes``."""
    return replace(obs, status=actions.status.to_patch(), **changes)


def condition(actions: Actions, type: str) -> tuple[str, str]:
    found = next(x for x in actions.status.conditions if x.type == type)
    return found.status, found.reason


def started() -> tuple[Observed, Actions]:
    obs = observed()
    return obs, reconcile(obs, CTX)
