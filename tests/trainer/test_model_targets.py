"""What the trainer makes trainable, and the models and settings it refuses before training: a multimodal
model's towers get no adapters (and, fully fine-tuned, no gradient, which DDP expects), target modules
that partly miss the model, gradient checkpointing on a model without it, and a config with no causal-LM
class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.config import LoraSettings, ModelSource, TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.adapters import towers_in_training
from sftjob_trainer.model import prepare_for_training, resolve_model_class

pytestmark = pytest.mark.trainer

CPU = torch.device("cpu")
VOCAB = 128
LANGUAGE_MODEL = "model.language_model."  # Gemma 3's decoder
HEAD = "lm_head."


def _gemma3() -> Any:
    """A tiny random Gemma 3 with its SigLIP vision tower, as AutoModelForCausalLM loads a checkpoint."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    config = Gemma3Config(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _trainable(model: Any) -> list[str]:
    return [name.removeprefix("base_model.model.") for name, p in model.named_parameters() if p.requires_grad]


def _backward(model: Any) -> None:
    ids = torch.randint(0, VOCAB, (2, 12))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def _every_trainable_parameter_has_a_gradient(model: Any) -> bool:
    return all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]], ids=["all-linear", "q and v"])
def test_lora_adapts_only_a_multimodal_models_language_model(targets: Any) -> None:
    lora = LoraSettings(target_modules=targets, dropout=0.0)
    model = prepare_for_training(_gemma3(), "lora", lora, TrainingSettings(), CPU)

    trainable = _trainable(model)
    assert trainable and all(name.startswith(LANGUAGE_MODEL) and ".lora_" in name for name in trainable)
    if targets != "all-linear":
        assert {name.split(".lora_")[0].rpartition(".")[2] for name in trainable} == set(targets)
    _backward(model)
    assert _every_trainable_parameter_has_a_gradient(model)


def test_full_fine_tuning_of_a_multimodal_model_trains_its_towers_too_and_ddp_expects_them_without_gradients(
    tmp_path: Path,
) -> None:
    import torch.distributed as dist

    from sftjob_trainer.distributed import DistContext, wrap_model

    model = prepare_for_training(_gemma3(), "full", LoraSettings(), TrainingSettings(), CPU)
    assert all(p.requires_grad for p in model.parameters())  # one checkpoint layout under DDP and FSDP
    assert towers_in_training(model)

    config = TrainerConfig.model_validate(
        {"model": {"name": "a/b"}, "dataset": {"name": "c/d"}, "training": {"global_batch_size": 1}}
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # A context of two ranks, for wrap_model to wrap; DDP itself runs in this one-process group.
        ctx = DistContext(rank=0, world_size=2, local_rank=0, local_world_size=2, device=CPU)
        ddp = wrap_model(model, config, ctx, torch.float32)
        # Over two ranks DDP would fail the second step without it (a single one never checks).
        assert ddp.find_unused_parameters
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2, 12))
            ddp(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        dist.destroy_process_group()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith(LANGUAGE_MODEL))


def test_a_text_only_models_full_fine_tuning_has_no_towers_in_training(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = prepare_for_training(
        AutoModelForCausalLM.from_pretrained(tiny_model), "full", LoraSettings(), TrainingSettings(), CPU
    )
    assert not towers_in_training(model)


@pytest.mark.parametrize("targets", [["fc1"], ["qproj"]], ids=["vision tower only", "typo"])
def test_target_modules_reaching_no_layer_of_the_language_model_are_a_config_error(
    targets: list[str],
) -> None:
    with pytest.raises(TrainerError) as raised:
        prepare_for_training(_gemma3(), "lora", LoraSettings(target_modules=targets), TrainingSettings(), CPU)
    assert raised.value.code == ExitCode.CONFIG_ERROR
    assert raised.value.reason.startswith(f"spec.lora.targetModules {targets} match no layer")
    assert "'q_proj'" in raised.value.reason and "'fc1'" not in raised.value.reason.partition("layers, ")[2]


def test_target_modules_that_miss_a_fused_projection_are_a_config_error_naming_it() -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    lora = LoraSettings(target_modules=["q_proj", "o_proj"])
    with pytest.raises(TrainerError) as raised:
        prepare_for_training(Phi3ForCausalLM(config), "lora", lora, TrainingSettings(), CPU)
    assert raised.value.code == ExitCode.CONFIG_ERROR
    assert raised.value.reason.startswith("spec.lora.targetModules ['q_proj'] match no layer")
    assert "'qkv_proj'" in raised.value.reason and "'gate_up_proj'" in raised.value.reason


def test_target_modules_that_peft_turns_into_a_mixtures_expert_tensors_are_not_missing() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    # Without dropout peft takes the fused experts (gate_up_proj and down_proj) as whole parameters.
    lora = LoraSettings(target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"], dropout=0.0)
    model = prepare_for_training(Qwen3MoeForCausalLM(config), "lora", lora, TrainingSettings(), CPU)
    assert any(".experts." in name for name in _trainable(model))


def test_gradient_checkpointing_of_a_model_without_it_is_a_config_error() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    class NoCheckpointing(LlamaForCausalLM):
        supports_gradient_checkpointing = False

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    training = TrainingSettings(gradient_checkpointing=True)
    with pytest.raises(TrainerError) as raised:
        prepare_for_training(NoCheckpointing(config), "lora", LoraSettings(), training, CPU)
    assert raised.value.code == ExitCode.CONFIG_ERROR
    assert "set spec.training.gradientCheckpointing: false" in raised.value.reason


def test_a_config_without_a_causal_lm_class_fails_before_the_data_is_read() -> None:
    from transformers import Qwen2_5_VLConfig

    with pytest.raises(TrainerError) as raised:
        resolve_model_class(Qwen2_5_VLConfig(), True, ModelSource(name="org/qwen2.5-vl"))
    assert raised.value.code == ExitCode.MODEL_LOAD_ERROR
    assert raised.value.reason.startswith("qwen2_5_vl has no causal-LM class in transformers 5.")
