"""LoRA on several GPUs with its frozen base sharded (FSDP, or HSDP over several nodes), and what FSDP2
holds unsharded besides the shards.

A 70B base is 140 GB in bf16: replicated (DDP) it fits no 80 GB card, sharded over one node's eight it is
17.5 GB a GPU. Sharding costs an all-gather of the base per micro-batch (forward and backward) and a
reduce-scatter of the adapter gradients, so a model that fits replicated stays on DDP. Under FSDP2 the
root (embeddings, head) stays gathered all step, two decoder layers are gathered at a time, and backward
adds their unsharded gradients, of the trainable parameters only, and one fp32 reduce-scatter input.
"""

from __future__ import annotations

import pytest

from sftjob.candidates import PlanRequest, evaluate, fixed_choices, shardings
from sftjob.config import LoraSettings, Method, Sharding
from sftjob.gpus import profile_for_type
from sftjob.memory import GIB, MemoryInputs, estimate_memory
from sftjob.model_shapes import resolve_architecture
from sftjob.planner import plan

A800 = profile_for_type("A800")
LLAMA_8B = resolve_architecture("meta-llama/Llama-3.1-8B")
LLAMA_70B = resolve_architecture("meta-llama/Llama-3.1-70B")
ADAPTER_STATES = ("adapters", "gradients", "optimizer")


def lora(architecture=LLAMA_70B, gpus_per_node=8, nodes=1, method: Method = "lora") -> PlanRequest:
    return PlanRequest(architecture=architecture, method=method, gpus_per_node=gpus_per_node, nodes=nodes)


def terms(method: Method, sharding: Sharding, world: int = 8, per_node: int = 8) -> dict[str, float]:
    inputs = MemoryInputs(
        LLAMA_70B,
        method,
        LoraSettings(),
        1,
        2048,
        2,
        True,
        sharding=sharding,
        world_size=world,
        gpus_per_node=per_node,
    )
    return {t.name: t.gib for t in estimate_memory(inputs, A800.memory_gib).terms}


def test_70b_lora_on_one_node_of_eight_a800_fits_with_its_base_sharded():
    p = plan(lora(), A800)
    assert p.fits and p.distributed.sharding == "fsdp"
    assert "sharding fsdp: frozen base and adapters split over 8 GPUs" in " | ".join(p.reasons)
    # The replicated plan it replaces: 140 GB of weights on every GPU.
    fixed, _ = fixed_choices(lora(), A800)
    assert not evaluate(lora(), A800, fixed, 1, True, "ddp", fixed.sequence).memory.fits


def test_8b_lora_on_eight_a800_stays_replicated():
    p = plan(lora(LLAMA_8B), A800)
    assert p.fits and p.distributed.sharding == "ddp"


def test_70b_lora_on_two_nodes_shards_inside_each_node_and_all_reduces_only_adapter_gradients_between():
    p = plan(lora(nodes=2), A800)
    assert p.fits and p.distributed.sharding == "hsdp"
    fixed, _ = fixed_choices(lora(nodes=2), A800)
    t = p.training
    fsdp = evaluate(lora(nodes=2), A800, fixed, t.micro_batch_size, t.gradient_checkpointing, "fsdp", 2048)
    assert p.predicted_tokens_per_second > 1.5 * fsdp.speed.tokens_per_second  # no all-gather over TCP


def test_qlora_is_never_sharded():
    assert shardings(lora(method="qlora")) == ["ddp"]


def test_the_frozen_base_and_the_adapter_states_are_divided_by_the_sharding_gpus():
    whole, sharded, hybrid = terms("lora", "none", 1, 1), terms("lora", "fsdp"), terms("lora", "hsdp", 16)
    for name in ("weights", *ADAPTER_STATES):
        assert sharded[name] == pytest.approx(whole[name] / 8, rel=1e-2), name
        assert hybrid[name] == pytest.approx(sharded[name], rel=1e-3), name
    assert "ddp_buckets" not in sharded


def test_fsdp2_keeps_the_root_and_two_layers_gathered_in_bf16():
    a = LLAMA_70B
    root = a.embedding_parameters + a.lm_head_parameters + a.hidden_size  # untied: table and head
    gathered = (root + 2 * a.layer_parameters) * 2 / GIB
    assert terms("lora", "fsdp")["weight_copies"] == pytest.approx(gathered, rel=1e-3)
    assert terms("full", "fsdp")["weight_copies"] == pytest.approx(gathered, rel=1e-3)


def test_backward_buffers_hold_only_trainable_gradients_for_lora_and_the_head_gradient_for_full():
    a = LLAMA_70B
    adapters_per_layer = a.lora_parameters(16) // a.layers
    # Two gathered layers' bf16 gradients and one fp32 reduce-scatter input.
    assert terms("lora", "fsdp")["gradient_buffers"] == pytest.approx(
        adapters_per_layer * (2 * 2 + 4) / GIB,
        abs=1e-3,  # terms are rounded to MiB
    )
    full = (a.embedding_parameters * 2 + a.layer_parameters * (2 * 2 + 4)) / GIB
    assert terms("full", "fsdp")["gradient_buffers"] == pytest.approx(full, rel=1e-3)
    assert "gradient_buffers" not in terms("lora", "ddp")


def test_sharded_lora_pays_an_all_gather_of_the_base_every_micro_batch():
    request = lora(LLAMA_8B)
    fixed, _ = fixed_choices(request, A800)
    ddp = evaluate(request, A800, fixed, 2, False, "ddp", fixed.sequence)
    fsdp = evaluate(request, A800, fixed, 2, False, "fsdp", fixed.sequence)
    assert fsdp.speed.tokens_per_second < ddp.speed.tokens_per_second
    assert fsdp.memory.total_gib < ddp.memory.total_gib
