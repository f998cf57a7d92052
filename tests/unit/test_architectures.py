"""Resolving a model's shape: explicit block, built-in table, config.json, or a guess from its size."""

import pytest

from sftjob.architectures import Architecture, architecture_from_hf_config
from sftjob.model_shapes import known_architecture, parameters_problem, resolve_architecture


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("meta-llama/Llama-3.2-1B", 1.24),
        ("meta-llama/Llama-3.2-3B-Instruct", 3.21),
        ("meta-llama/Llama-3.1-8B-Instruct", 8.03),
        ("meta-llama/Meta-Llama-3-8B", 8.03),
        ("meta-llama/Llama-3.3-70B-Instruct", 70.55),
        ("Qwen/Qwen2.5-0.5B-Instruct", 0.49),
        ("Qwen/Qwen2.5-7B", 7.62),
        ("Qwen/Qwen2.5-72B-Instruct", 72.71),
        ("mistralai/Mistral-7B-Instruct-v0.3", 7.25),
        ("google/gemma-2-2b-it", 2.61),
        ("google/gemma-2-9b", 9.24),
        ("google/gemma-2-27b-it", 27.23),
        ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", 1.10),
    ],
)
def test_built_in_families_match_their_published_parameter_counts(model, billions):
    assert resolve_architecture(model).parameters / 1e9 == pytest.approx(billions, abs=0.01)


def test_names_match_case_insensitively_and_do_not_confuse_sizes():
    assert resolve_architecture("QWEN/QWEN2.5-7B-INSTRUCT").hidden_size == 3584
    assert resolve_architecture("Qwen/Qwen2.5-72B").hidden_size == 8192


def test_explicit_architecture_wins_over_the_table():
    mine = Architecture(layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128, vocab_size=300)
    assert resolve_architecture("meta-llama/Llama-3.1-8B", mine, 8_000_000_000).layers == 2


def test_a_shape_counting_more_than_a_quarter_fewer_parameters_than_given_is_a_problem_naming_both():
    mixtral_layers = Architecture(
        layers=32, hidden_size=4096, heads=32, kv_heads=8, intermediate_size=14336, vocab_size=32000
    )
    problem = parameters_problem(mixtral_layers, 46_700_000_000)
    assert problem is not None and problem.startswith(
        "spec.model.architecture has 7.24B parameters but spec.model.parameters says 46.70B"
    )
    assert parameters_problem(mixtral_layers, 9_700_000_000) is not None  # 25.4% fewer
    assert parameters_problem(mixtral_layers, 9_000_000_000) is None  # 20% fewer
    assert parameters_problem(mixtral_layers, None) is None and parameters_problem(None, 10**9) is None


def test_a_plain_mlp_model_the_gated_shape_overcounts_is_not_refused():
    # StarCoder2-15B: its MLP has two matrices (c_fc, c_proj), the shape counts three: 22.0B for 15.96B.
    starcoder2 = Architecture(
        layers=40, hidden_size=6144, heads=48, kv_heads=4, intermediate_size=24576, vocab_size=49152
    )
    assert starcoder2.parameters > 1.3 * 15_960_000_000
    assert parameters_problem(starcoder2, 15_960_000_000) is None


def test_the_common_mixtures_of_experts_are_in_the_table_with_every_expert_counted():
    sizes = {
        "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.70,
        "mistralai/Mixtral-8x22B-v0.1": 140.63,
        "Qwen/Qwen1.5-MoE-A2.7B": 14.32,
        "Qwen/Qwen2-57B-A14B-Instruct": 57.41,
        "Qwen/Qwen3-30B-A3B": 30.53,
        "allenai/OLMoE-1B-7B-0924": 6.92,
    }
    for name, billions in sizes.items():
        shape = resolve_architecture(name)
        assert shape.experts is not None and round(shape.parameters / 1e9, 2) == billions, name


def test_gemma_2_2b_described_with_the_2b_of_its_name_is_one_model():
    gemma = resolve_architecture("google/gemma-2-2b")  # 2.61B
    assert parameters_problem(gemma, 2_000_000_000) is None


def test_unknown_model_with_a_size_gets_a_llama_shaped_guess_close_to_that_size():
    arch = resolve_architecture("acme/secret-model", None, 7_000_000_000)
    assert arch.parameters == pytest.approx(7e9, rel=0.05)
    assert "guess" in (arch.name or "")
    assert not arch.liger_supported


def test_unknown_model_without_hints_names_the_fields_to_set():
    with pytest.raises(ValueError, match=r"spec\.model\.parameters.*spec\.model\.architecture"):
        resolve_architecture("acme/secret-model")


def test_non_embedding_parameters_exclude_the_input_embedding_table():
    arch = resolve_architecture("meta-llama/Llama-3.1-8B")
    assert arch.parameters - arch.non_embedding_parameters == 128256 * 4096


def test_hf_config_gives_the_same_shape_as_the_table():
    config = {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    from_config = architecture_from_hf_config(config)
    assert from_config.parameters == resolve_architecture("Qwen/Qwen2.5-7B").parameters
    assert from_config.liger_supported


def test_hf_config_of_gemma2_ties_embeddings_by_default_and_keeps_head_dim():
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 26,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 9216,
        "vocab_size": 256000,
    }
    arch = architecture_from_hf_config(config)
    assert arch.tied_embeddings
    assert arch.parameters == resolve_architecture("google/gemma-2-2b").parameters


def test_hf_config_missing_fields_are_named():
    with pytest.raises(ValueError, match="hidden_size"):
        architecture_from_hf_config({"num_hidden_layers": 2})


def test_lora_parameters_count_every_targeted_projection():
    arch = resolve_architecture("meta-llama/Llama-2-7b-hf")
    # r x (in + out) per projection: 4 attention (4096 -> 4096) + gate/up (4096 -> 11008) + down
    per_layer = 16 * (4 * 8192 + 3 * (4096 + 11008))
    assert arch.lora_parameters(16) == 32 * per_layer
    assert arch.lora_parameters(16, ["all-linear"]) == arch.lora_parameters(16)
    assert arch.lora_parameters(16, ["q_proj", "v_proj"]) == 32 * 16 * 2 * 8192


def test_architecture_block_reads_camel_case_like_the_spec():
    arch = Architecture.model_validate(
        {"layers": 2, "hiddenSize": 64, "heads": 4, "kvHeads": 2, "intermediateSize": 128, "vocabSize": 300}
    )
    assert arch.kv_dim == 32


@pytest.mark.parametrize(
    "model", ["TinyLlama/TinyLlama-1.1B", "meta-llama/Llama-2-7b-hf", "google/gemma-2-9b", "Qwen/Qwen2.5-7B"]
)
def test_a_known_shape_survives_the_round_trip_through_a_transformers_config(model: str) -> None:
    known = known_architecture(model)
    assert known is not None
    back = architecture_from_hf_config(known.to_hf_config())
    assert back.model_copy(update={"name": None}) == known.model_copy(update={"name": None})


def test_mistral_7b_v0_1_has_its_sliding_window_and_later_versions_none() -> None:
    assert resolve_architecture("mistralai/Mistral-7B-v0.1").sliding_window == 4096
    assert resolve_architecture("mistralai/Mistral-7B-Instruct-v0.1").sliding_window == 4096
    assert resolve_architecture("mistralai/Mistral-7B-Instruct-v0.2").sliding_window is None
    assert resolve_architecture("mistral-community/Mistral-7B-v0.2").vocab_size == 32000
    assert resolve_architecture("mistralai/Mistral-7B-Instruct-v0.3").sliding_window is None


def test_a_mistral_7b_naming_no_version_gets_v0_1s_sliding_window() -> None:
    # Fine-tunes of v0.1 rarely say so (OpenHermes 2.5 attends within 4096 tokens); v0.2/v0.3's full
    # attention assumed windowed only costs eager attention past 4096-token rows, counted in the plan.
    assert resolve_architecture("teknium/OpenHermes-2.5-Mistral-7B").sliding_window == 4096


def test_a_sliding_window_is_read_from_config_json_only_where_layers_use_it() -> None:
    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    mistral = {**base, "vocab_size": 100, "model_type": "mistral", "sliding_window": 4096}
    assert architecture_from_hf_config(mistral).sliding_window == 4096
    qwen = {**mistral, "model_type": "qwen2", "use_sliding_window": False}
    assert architecture_from_hf_config(qwen).sliding_window is None
    full = {**mistral, "layer_types": ["full_attention", "full_attention"]}
    assert architecture_from_hf_config(full).sliding_window is None


def test_a_small_model_known_only_by_its_size_gets_a_narrow_tied_deep_enough_shape() -> None:
    from sftjob.model_shapes import llama_shaped

    guess = llama_shaped(360_000_000)  # SmolLM2-360M: 32 layers of 960, tied
    assert guess.tied_embeddings and guess.hidden_size <= 1024 and guess.layers >= 16
    assert guess.parameters == pytest.approx(360e6, rel=0.05)
    assert llama_shaped(8_000_000_000).tied_embeddings is False


# The mixture-of-experts fields of the published config.json files (hub ids in the names).
MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN1_5_MOE_A2_7B = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 24,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "intermediate_size": 5632,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
}


def test_a_mixtral_holds_every_expert_in_memory_and_computes_two_per_token():
    arch = architecture_from_hf_config(MIXTRAL_8X7B)
    assert arch.parameters == 46_702_792_704  # MixtralForCausalLM's count: 46.7B
    # Per token: attention, the router, 2 of the 8 experts and the head; not 46.7B, nor one expert's 7.1B.
    assert round(arch.matmul_parameters / 1e9, 2) == 12.75
    assert arch.active_intermediate_size == 2 * 14336
    assert arch.lora_widths() == (4 * 4096, 4096 + 2 * 1024 + 4096)  # the experts are no linear layers


def test_a_qwen2_moe_counts_its_shared_expert_router_and_q_k_v_biases():
    arch = architecture_from_hf_config(QWEN1_5_MOE_A2_7B)
    assert arch.attention_bias
    assert arch.parameters == 14_315_784_192  # Qwen2MoeForCausalLM's count: 14.3B, "A2.7B" active
    assert round((arch.matmul_parameters + arch.embedding_parameters) / 1e9, 2) == 2.69
    assert arch.active_intermediate_size == 4 * 1408 + 5632
    assert arch.linear_parameters == 24 * (arch.attention_parameters + 3 * 2048 * 5632 + 2048)


def test_a_dense_config_has_no_experts_and_a_mixture_survives_the_round_trip():
    assert architecture_from_hf_config({**MIXTRAL_8X7B, "num_local_experts": 0}).experts is None
    arch = architecture_from_hf_config(QWEN1_5_MOE_A2_7B)
    assert architecture_from_hf_config(arch.to_hf_config()) == arch


def test_a_mixture_routing_tokens_to_more_experts_than_it_has_is_refused():
    with pytest.raises(ValueError, match=r"perToken 9 exceeds experts\.count 8"):
        architecture_from_hf_config({**MIXTRAL_8X7B, "num_experts_per_tok": 9})
