"""Host-side sizing of trainer pods: checkpoint size, and memory for loading and checkpointing."""

from sftjob.config import LoraSettings, Method
from sftjob.memory import GIB
from sftjob.model_shapes import resolve_architecture
from sftjob.resources import (
    HOST_GIB_PER_PROCESS,
    HOST_MEMORY_FLOOR_GIB,
    LOAD_HEADROOM,
    checkpoint_gib,
    pod_resources,
)

QWEN_7B = resolve_architecture("Qwen/Qwen2.5-7B-Instruct")
LLAMA_1B = resolve_architecture("meta-llama/Llama-3.2-1B")
LLAMA_70B = resolve_architecture("meta-llama/Llama-3.1-70B-Instruct")
LORA = LoraSettings()


def _memory_gib(method: Method, gpus: int, architecture=QWEN_7B) -> int:
    resources, _ = pod_resources(architecture, method, gpus)
    return int(resources.memory.removesuffix("Gi"))


def _shm_gib(gpus: int) -> int:
    resources, _ = pod_resources(QWEN_7B, "lora", gpus)
    return int(resources.shm_size.removesuffix("Gi"))


def test_a_full_fine_tuning_checkpoint_holds_fp32_weights_and_both_adamw_moments():
    expected = QWEN_7B.parameters * (4 + 4 + 4) / GIB
    assert checkpoint_gib(QWEN_7B, "full", LORA, "adamw_torch_fused") == expected
    assert 84 < expected < 86  # 7.62B parameters


def test_a_lora_checkpoint_holds_only_the_adapters_and_their_optimizer_state():
    adapters = QWEN_7B.lora_parameters(LORA.r, LORA.target_modules)
    assert checkpoint_gib(QWEN_7B, "lora", LORA, "adamw_torch_fused") == adapters * 12 / GIB
    assert checkpoint_gib(QWEN_7B, "qlora", LORA, "adamw_torch_fused") < 1


def test_an_8bit_optimizer_makes_a_smaller_checkpoint():
    assert checkpoint_gib(QWEN_7B, "full", LORA, "adamw_8bit") == QWEN_7B.parameters * (4 + 2) / GIB


def test_a_checkpoint_takes_no_host_memory_as_each_rank_writes_its_own_shards_from_the_gpu():
    bf16_model = QWEN_7B.parameters * 2 / GIB  # one GPU: the final model's bf16 copy, rank 0's only copy
    checkpoint = checkpoint_gib(QWEN_7B, "full", LORA, "adamw_torch_fused")
    along = HOST_GIB_PER_PROCESS + _shm_gib(1)
    assert LOAD_HEADROOM * bf16_model + along <= _memory_gib("full", 1) < checkpoint + along


def test_a_sharded_node_holds_rank_zeros_fp32_copy_of_the_model_not_one_per_gpu():
    fp32_model = QWEN_7B.parameters * 4 / GIB  # rank 0's; the other ranks receive their shards from it
    along = 8 * HOST_GIB_PER_PROCESS + _shm_gib(8)
    memory = int(pod_resources(QWEN_7B, "full", 8, sharded=True)[0].memory.removesuffix("Gi"))
    assert memory >= LOAD_HEADROOM * fp32_model + along
    assert memory < 8 * fp32_model  # 8 copies: 227 GiB before the rest


def test_a_model_loaded_straight_onto_its_gpus_takes_no_host_copy_for_adapters():
    floor = HOST_MEMORY_FLOOR_GIB + HOST_GIB_PER_PROCESS + _shm_gib(1)  # 43 GiB, rounded up to 48
    assert _memory_gib("lora", 1) == _memory_gib("qlora", 1) == 48  # a 7B base: page cache only
    assert floor <= _memory_gib("lora", 1, architecture=LLAMA_1B) < floor + 8
    sharded_lora, _ = pod_resources(QWEN_7B, "lora", 8, sharded=True)  # rank 0 loads the bf16 base on the CPU
    assert int(sharded_lora.memory.removesuffix("Gi")) >= LOAD_HEADROOM * QWEN_7B.parameters * 2 / GIB


def test_only_node_rank_zeros_pod_asks_for_the_load_memory_on_several_nodes():
    # Global rank 0 (in node rank 0's pod) loads, gathers and saves the whole model.
    resources, _ = pod_resources(QWEN_7B, "full", 8, nodes=2, sharded=True)
    held = 8 * HOST_GIB_PER_PROCESS + _shm_gib(8)
    assert resources.memory == pod_resources(QWEN_7B, "full", 8, sharded=True)[0].memory  # as on one node
    assert resources.worker_memory == "88Gi" and HOST_MEMORY_FLOOR_GIB + held == 88
    assert [resources.memory_for(rank) for rank in (0, 1, 7)] == [resources.memory, "88Gi", "88Gi"]
    ddp, _ = pod_resources(LLAMA_70B, "full", 8, nodes=2)  # rank 0 saves the final model from a bf16 copy
    assert ddp.worker_memory == "88Gi"
    assert int(ddp.memory.removesuffix("Gi")) >= LOAD_HEADROOM * LLAMA_70B.parameters * 2 / GIB + held


def test_every_pod_asks_for_the_same_memory_on_one_node_or_when_rank_zero_needs_no_more():
    assert pod_resources(QWEN_7B, "full", 8, sharded=True)[0].worker_memory is None  # one node
    small, _ = pod_resources(LLAMA_1B, "lora", 1, nodes=2, sharded=True)
    assert small.worker_memory is None and small.memory_for(1) == small.memory  # the floor is the same
    lora, _ = pod_resources(QWEN_7B, "lora", 8, nodes=2)  # DDP: every process loads onto its own GPU
    assert lora.worker_memory is None


def test_merging_the_adapter_asks_for_the_base_once_more_in_the_precision_it_computed_in():
    along = HOST_GIB_PER_PROCESS + _shm_gib(1)
    for method in ("lora", "qlora"):
        merging, _ = pod_resources(LLAMA_70B, method, 1, merged=True)  # the base, unquantised, on the CPU
        bf16_base = LLAMA_70B.parameters * 2 / GIB
        assert int(merging.memory.removesuffix("Gi")) >= LOAD_HEADROOM * bf16_base + along
        assert _memory_gib(method, 1, architecture=LLAMA_70B) == 48  # without: page cache only
    fp32, _ = pod_resources(LLAMA_70B, "lora", 1, "fp32", merged=True)
    assert int(fp32.memory.removesuffix("Gi")) >= LOAD_HEADROOM * LLAMA_70B.parameters * 4 / GIB + along
    sharded, _ = pod_resources(QWEN_7B, "lora", 8, sharded=True)  # rank 0 holds a bf16 copy already
    assert pod_resources(QWEN_7B, "lora", 8, sharded=True, merged=True)[0].memory == sharded.memory
