"""The plan for one SFTJob on one GPU profile, as the operator runs it and ``sftjob plan`` shows it.

The planner answers the spec's question (``to_plan_request``); the user's ``spec.resources`` then win
over the planned pod requests, and a CPU count of the user's also sets the dataloader workers and the
threads of each training process, which the planner derived from its own count; a user's memory below
the plan's keeps the memory-backed /dev/shm, which counts against it, to a quarter of it. One function,
so the CLI and the operator can never show different plans for the same spec.
"""

from __future__ import annotations

import math
from typing import Any

from sftjob import planner
from sftjob.gpus import GpuProfile
from sftjob.plan import Plan, PodResources
from sftjob.resources import pod_environment, workers_per_process
from sftjob.spec import SFTJobSpec, to_plan_request
from sftjob.storage import quantity_gib, quantity_value

SHM_SHARE_OF_USER_MEMORY = 4  # /dev/shm at most a quarter of a user's memory smaller than the plan's


def memory_problem(spec: SFTJobSpec, profile: GpuProfile) -> str | None:
    """A user's ``spec.resources.memory`` below what the planner asks for: allowed (the user knows the
    node), but said, since loading or saving the model may then be OOM-killed (HostOOM)."""
    wanted = spec.resources.memory
    if wanted is None:
        return None
    made = planner.plan(to_plan_request(spec, spec.gpu.count, spec.gpu.nodes), profile)
    if quantity_gib(wanted) >= quantity_gib(made.resources.memory):
        return None
    shm = with_user_resources(spec, made, profile).resources.shm_size
    return (
        f"spec.resources.memory {wanted} is below the planned {made.resources.memory} per pod on"
        f" {profile.key}: loading or saving the model may be OOM-killed (HostOOM); /dev/shm gets {shm}"
    )


def plan_job(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
    """The job's plan on ``profile``; raises ValueError when the model cannot be sized."""
    made = with_user_resources(
        spec, planner.plan(to_plan_request(spec, spec.gpu.count, spec.gpu.nodes), profile), profile
    )
    if spec.queue_name and made.resources.worker_memory is not None:
        # One pod shape, one PodSet: Kueue picks a flavor per PodSet, and two shapes of a pod group could
        # be given two cards whose nodes the ranks, kept on one GPU product, could then never share.
        return made.model_copy(
            update={"resources": made.resources.model_copy(update={"worker_memory": None})}
        )
    return made


def with_user_resources(spec: SFTJobSpec, plan: Plan, profile: GpuProfile) -> Plan:
    wanted = spec.resources
    if wanted.cpu is None and wanted.memory is None:
        return plan
    shm = plan.resources.shm_size
    if wanted.memory is not None:
        quarter = quantity_gib(wanted.memory) / SHM_SHARE_OF_USER_MEMORY
        if quarter < quantity_gib(shm):
            shm = f"{max(1, math.floor(quarter * 1024))}Mi"
    resources = PodResources(
        cpu=wanted.cpu or plan.resources.cpu,
        memory=wanted.memory or plan.resources.memory,
        shm_size=shm,
        worker_memory=None if wanted.memory else plan.resources.worker_memory,  # the user's: every pod
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
