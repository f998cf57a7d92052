"""The plan for one SFTJob on one GPU profile, as the operator runs it and ``sftjob plan`` shows it.

The planner answers the spec's question (``to_plan_request``); the user's ``spec.resources`` then win
over the planned pod requests, and a CPU count of the user's also sets the dataloader workers and the
threads of each training process, which the planner derived from its own count. One function, so the
CLI and the operator can never show different plans for the same spec.
"""

from __future__ import annotations

import math
from typing import Any

from sftjob import planner
from sftjob.gpus import GpuProfile
from sftjob.plan import Plan, PodResources
from sftjob.resources import pod_environment, workers_per_process
from sftjob.spec import SFTJobSpec, to_plan_request
from sftjob.storage import quantity_value


def plan_job(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
    """The job's plan on ``profile``; raises ValueError when the model cannot be sized."""
    made = planner.plan(to_plan_request(spec, spec.gpu.count, spec.gpu.nodes), profile)
    return with_user_resources(spec, made, profile)


def with_user_resources(spec: SFTJobSpec, plan: Plan, profile: GpuProfile) -> Plan:
    wanted = spec.resources
    if wanted.cpu is None and wanted.memory is None:
        return plan
    resources = PodResources(
        cpu=wanted.cpu or plan.resources.cpu,
        memory=wanted.memory or plan.resources.memory,
        shm_size=plan.resources.shm_size,
    )
    update: dict[str, Any] = {"resources": resources}
    if wanted.cpu is not None:
        per_gpu = max(1, math.floor(quantity_value(wanted.cpu) / spec.gpu.count))
        env = pod_environment(spec.gpu.count, spec.gpu.nodes, per_gpu)
        update["env"] = {**plan.env, "OMP_NUM_THREADS": env["OMP_NUM_THREADS"]}
        update["training"] = plan.training.model_copy(
            update={"dataloader_workers": workers_per_process(per_gpu)}
        )
    return plan.model_copy(update=update)
