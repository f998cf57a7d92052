"""Hybrid sharding (HSDP) for full fine-tuning on several nodes: FSDP inside each node, replicas across.

Under FSDP every micro-batch all-gathers and reduce-scatters over all ranks, so it crosses the slow link
between nodes; under HSDP that traffic stays on the node's own link and one gradient all-reduce per
optimizer step crosses. It holds a whole copy of the model states per node, so a model whose states do
not fit one node's GPUs keeps FSDP.
"""

from __future__ import annotations

import pytest

from sftjob.candidates import PlanRequest, evaluate, fixed_choices, shardings
from sftjob.config import LoraSettings, Sharding
from sftjob.gpus import profile_for_type
from sftjob.memory import MemoryInputs, estimate_memory
from sftjob.model_shapes import resolve_architecture
from sftjob.network import DEFAULT_RDMA_GBPS, DEFAULT_TCP_GBPS
from sftjob.planner import plan

A800 = profile_for_type("A800")
LLAMA_8B = resolve_architecture("meta-llama/Llama-3.1-8B")
LLAMA_70B = resolve_architecture("meta-llama/Llama-3.1-70B")
TCP, RDMA = DEFAULT_TCP_GBPS / 8, DEFAULT_RDMA_GBPS / 8
STATES = ("weights", "gradients", "optimizer")


def full(architecture=LLAMA_8B, gpus_per_node=8, nodes=2, inter_node_gbs=TCP) -> PlanRequest:
    return PlanRequest(
        architecture=architecture,
        method="full",
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        inter_node_gbs=inter_node_gbs,
        rdma=inter_node_gbs != TCP,
    )


def tokens_per_second_under_fsdp(request: PlanRequest, micro: int, checkpointing: bool) -> float:
    """What the plan would predict with FSDP at the same micro-batch."""
    fixed, _ = fixed_choices(request, A800)
    candidate = evaluate(request, A800, fixed, micro, checkpointing, "fsdp", fixed.sequence)
    return candidate.speed.tokens_per_second


def states_gib(sharding: Sharding, world_size: int, gpus_per_node: int) -> dict[str, float]:
    """Weights, gradients and optimizer state per GPU (with accumulation: the gradients live throughout)."""
    inputs = MemoryInputs(
        LLAMA_8B,
        "full",
        LoraSettings(),
        1,
        2048,
        2,
        sharding=sharding,
        world_size=world_size,
        gpus_per_node=gpus_per_node,
    )
    return {t.name: t.gib for t in estimate_memory(inputs, A800.memory_gib).terms if t.name in STATES}


def test_8b_full_on_two_nodes_of_eight_a800_over_tcp_picks_hsdp_and_predicts_far_more_than_fsdp():
    request = full()
    p = plan(request, A800)
    assert p.fits and p.distributed.sharding == "hsdp"
    t = p.training
    fsdp = tokens_per_second_under_fsdp(request, t.micro_batch_size, t.gradient_checkpointing)
    assert p.predicted_tokens_per_second > 1.5 * fsdp


def test_the_slower_the_link_between_nodes_the_more_hsdp_gains_over_fsdp():
    gains = []
    for link in (TCP, RDMA):
        request = full(inter_node_gbs=link)
        p = plan(request, A800)
        assert p.distributed.sharding == "hsdp"
        t = p.training
        fsdp = tokens_per_second_under_fsdp(request, t.micro_batch_size, t.gradient_checkpointing)
        gains.append(p.predicted_tokens_per_second / fsdp)
    over_tcp, over_rdma = gains
    assert over_tcp > over_rdma > 1


def test_hsdp_splits_the_model_states_over_the_gpus_of_one_node_not_the_whole_world():
    whole = states_gib("none", 1, 1)
    hybrid = states_gib("hsdp", 16, 8)
    for name in STATES:
        assert hybrid[name] == pytest.approx(whole[name] / 8, rel=1e-3), name
    assert hybrid == pytest.approx(states_gib("fsdp", 8, 8), rel=1e-3)


def test_the_plan_says_hsdp_shards_inside_each_node_and_crosses_between_nodes_once_per_step():
    reasons = " | ".join(plan(full(), A800).reasons)
    assert "sharding hsdp: model states split over each node's 8 GPUs" in reasons
    assert "replicated on the 2 nodes" in reasons


@pytest.mark.parametrize(("gpus_per_node", "nodes"), [(8, 1), (1, 4)])
def test_hsdp_is_offered_only_on_several_nodes_of_several_gpus(gpus_per_node: int, nodes: int):
    request = full(gpus_per_node=gpus_per_node, nodes=nodes)
    assert "hsdp" not in shardings(request)
    assert plan(request, A800).distributed.sharding != "hsdp"
    assert "hsdp" in shardings(full(gpus_per_node=2, nodes=2))


def test_hsdp_is_offered_to_lora_as_to_full_fine_tuning_but_never_to_qlora():
    assert shardings(full().model_copy(update={"method": "lora"})) == ["ddp", "fsdp", "hsdp"]
    assert shardings(full().model_copy(update={"method": "qlora"})) == ["ddp"]


def test_70b_full_whose_states_do_not_fit_one_node_keeps_fsdp():
    request = full(LLAMA_70B, nodes=4)
    p = plan(request, A800)
    assert p.fits and p.distributed.sharding == "fsdp"
    fixed, _ = fixed_choices(request, A800)
    hybrid = evaluate(request, A800, fixed, 1, True, "hsdp", fixed.sequence)
    assert not hybrid.memory.fits  # 70.6B x 16 B / 8 GPUs is more than an A800 holds


def test_70b_full_that_fits_nowhere_on_two_nodes_reports_the_frugal_fsdp_numbers():
    p = plan(full(LLAMA_70B), A800)
    assert not p.fits and p.distributed.sharding == "fsdp"
