"""The operator's plans per candidate GPU: what the user's spec.resources changes in the planned pod."""

from __future__ import annotations

from typing import Any

from sftjob.spec import SFTJobSpec
from sftjob_operator.planning import plan_candidates
from sftjob_operator.scheduling import default_products

SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"},
    "dataset": {"name": "HuggingFaceH4/ultrachat_200k"},
    "method": "lora",
    "gpu": {"type": "L40S", "count": 4},
}


def planned(**changes: Any) -> Any:
    return plan_candidates(SFTJobSpec.model_validate({**SPEC, **changes}), default_products()).first


def test_without_resources_the_plan_sizes_cpus_workers_and_threads_itself() -> None:
    plan = planned()
    assert plan.resources.cpu == "32" and plan.training.dataloader_workers == 4
    assert plan.env["OMP_NUM_THREADS"] == "3"


def test_a_users_cpu_count_also_sets_the_workers_and_threads_of_each_process() -> None:
    plan = planned(resources={"cpu": "8"})  # 2 CPUs per GPU process
    assert plan.resources.cpu == "8" and plan.training.dataloader_workers == 1
    assert plan.env["OMP_NUM_THREADS"] == "1"


def test_a_fractional_cpu_count_still_gives_every_process_one_worker_and_one_thread() -> None:
    plan = planned(resources={"cpu": "1500m"})
    assert plan.training.dataloader_workers == 1 and plan.env["OMP_NUM_THREADS"] == "1"


def test_a_users_memory_alone_leaves_the_planned_cpus_alone() -> None:
    plan = planned(resources={"memory": "200Gi"})
    assert plan.resources.memory == "200Gi" and plan.resources.cpu == "32"
    assert plan.training.dataloader_workers == 4
