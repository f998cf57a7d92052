"""The operator's plans per candidate GPU: the cards planned (a product nodeSelector narrows them), and
what the user's spec.resources changes in the planned pod."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sftjob import constants as c
from sftjob.gpu_products import cards_for_job
from sftjob.spec import SFTJobSpec
from sftjob_operator.conditions import Reason
from sftjob_operator.planning import PlanningError, check_checkpoint_volume, plan_candidates
from sftjob_operator.reconcile import reconcile
from sftjob_operator.scheduling import default_products
from tests.unit.reconcile_cases import CTX, condition, fake_plan, observed

PRODUCTS = default_products()

SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"},
    "dataset": {"name": "HuggingFaceH4/ultrachat_200k"},
    "method": "lora",
    "gpu": {"type": "L40S", "count": 4},
}


def planned(**changes: Any) -> Any:
    return plan_candidates(SFTJobSpec.model_validate({**SPEC, **changes}), PRODUCTS).first


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


def test_a_sharded_multi_node_full_fine_tune_asks_for_the_load_memory_on_node_rank_zero_alone() -> None:
    full = {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}, "method": "full"}
    one, two = {"type": "A800", "count": 4}, {"type": "A800", "count": 4, "nodes": 2}
    one_node, two_nodes = planned(**full, gpu=one), planned(**full, gpu=two)
    assert two_nodes.distributed.sharding in ("fsdp", "hsdp")
    assert one_node.resources.worker_memory is None
    assert two_nodes.resources.memory == one_node.resources.memory == "72Gi"  # 1.5 x the fp32 model, and more
    assert two_nodes.resources.worker_memory == "64Gi"  # the floor, 4 processes and the /dev/shm
    # The user's memory is every pod's; their CPUs alone leave the planned split alone.
    assert planned(**full, gpu=two, resources={"memory": "100Gi"}).resources.worker_memory is None
    assert planned(**full, gpu=two, resources={"cpu": "16"}).resources.worker_memory == "64Gi"
    # Under Kueue every pod takes node rank 0's: one pod shape is one PodSet, given one flavor.
    assert planned(**full, gpu=two, queueName="team-a").resources.worker_memory is None


def test_the_operator_plans_exactly_the_cards_sftjob_plan_is_given() -> None:
    for gpu in ({"type": "A800"}, {"type": "Any"}, {"types": ["L40S", "A800"]}):
        spec = SFTJobSpec.model_validate({**SPEC, "gpu": gpu})
        assert list(plan_candidates(spec, PRODUCTS, fake_plan).plans) == list(
            cards_for_job(spec, PRODUCTS).profiles
        )


def test_a_node_selector_on_a_card_too_small_for_the_job_fails_planning_with_that_cards_reason() -> None:
    spec = SFTJobSpec.model_validate(
        {**SPEC, "model": {"name": "Qwen/Qwen2.5-72B-Instruct"}, "method": "qlora", "gpu": {"type": "A800"}}
    )
    assert plan_candidates(spec, PRODUCTS).allowed_products()  # the 80 GB cards fit it
    narrowed = spec.model_copy(update={"node_selector": {c.GFD_PRODUCT: "NVIDIA-A800-PCIE-40GB"}})
    with pytest.raises(PlanningError) as raised:
        plan_candidates(narrowed, PRODUCTS)
    assert raised.value.reason == Reason.DOES_NOT_FIT
    message = raised.value.message
    assert f"spec.nodeSelector {c.GFD_PRODUCT}=NVIDIA-A800-PCIE-40GB" in message
    assert "A800-PCIE-40GB: qlora of 72.7B on 1 x A800-PCIE-40GB needs ~" in message
    assert "SXM4" not in message.split("; try:")[0]  # only the selected card's verdict


def test_a_node_selector_on_a_fitting_card_plans_and_admits_that_card_alone() -> None:
    selector = {c.GFD_PRODUCT: "NVIDIA-A800-PCIE-80GB"}
    spec = SFTJobSpec.model_validate({**SPEC, "gpu": {"type": "A800"}, "nodeSelector": selector})
    plans = plan_candidates(spec, PRODUCTS, fake_plan)
    assert list(plans.plans) == ["A800-PCIE-80GB"] and plans.first.gpu == "A800-PCIE-80GB"
    assert plans.allowed_products() == ["NVIDIA-A800-PCIE-80GB"]


def test_a_job_selecting_a_card_its_plan_does_not_fit_fails_before_any_pod_instead_of_pending() -> None:
    ctx = replace(CTX, plan_fn=lambda spec, profile: fake_plan(spec, profile, fits=profile.memory_gib > 50))
    selector = {c.GFD_PRODUCT: "NVIDIA-A800-PCIE-40GB"}
    actions = reconcile(observed(spec={**SPEC, "gpu": {"type": "A800"}, "nodeSelector": selector}), ctx)
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == ("True", "DoesNotFit")
    assert condition(actions, "Planned") == ("False", "DoesNotFit") and not actions.children


def test_a_described_sliding_window_model_is_planned_with_the_attention_of_the_built_in_one() -> None:
    """Mistral 7B v0.1 attends within 4096 tokens: rows longer than that need eager attention (its
    score matrix counted), whether the planner knows the model or the spec describes its shape."""
    mistral = {"layers": 32, "hiddenSize": 4096, "heads": 32, "kvHeads": 8, "intermediateSize": 14336}
    shape = {**mistral, "vocabSize": 32000, "family": "mistral", "slidingWindow": 4096}
    dataset = {"name": "org/chats", "maxSeqLength": 8192}

    def attention(model: dict[str, Any]) -> tuple[str, float]:
        spec = SFTJobSpec.model_validate(
            {**SPEC, "model": model, "dataset": dataset, "gpu": {"type": "A800"}}
        )
        plan = next(iter(plan_candidates(spec, PRODUCTS).plans.values()))
        return plan.training.attention, plan.memory.total_gib

    built_in = attention({"name": "mistralai/Mistral-7B-v0.1"})
    described = attention({"name": "acme/mistral-7b-v0.1-chat", "architecture": shape})
    assert built_in[0] == described[0] == "eager" and described[1] == pytest.approx(built_in[1], rel=0.01)
    full_attention = {"name": "acme/mistral-7b-v0.1-chat", "architecture": {**shape, "slidingWindow": None}}
    assert attention(full_attention)[0] == "sdpa"


def test_a_checkpoint_claim_sized_in_kibibytes_too_small_for_the_run_fails_planning() -> None:
    """Not skipped as unreadable: ``104857600Ki`` (100Gi) is a quantity the CRD admits."""
    full = {
        **SPEC,
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
        "method": "full",
        "gpu": {"type": "A800", "count": 8},
    }
    spec = SFTJobSpec.model_validate({**full, "checkpoints": {"size": "104857600Ki"}})
    with pytest.raises(PlanningError) as raised:
        check_checkpoint_volume(spec, plan_candidates(spec, PRODUCTS))
    assert raised.value.reason == Reason.CHECKPOINT_VOLUME_TOO_SMALL
    assert raised.value.message.startswith("spec.checkpoints.size 104857600Ki cannot hold the run")
