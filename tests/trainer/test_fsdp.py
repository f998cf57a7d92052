"""FSDP2 keeps what sharding saves: no whole model on a rank but 0, nor on a GPU, nor a whole gradient; one
fp16 loss scale for all.

Full fine-tuning under FSDP builds the model without weights on every rank, shards it, and fills the
shards from rank 0's pretrained weights (or a checkpoint), so host memory holds one copy per node, not
one per GPU; the result must be the model rank 0 loaded, RoPE buffers and tied head included, and after a
resume still hold the buffers that came from the pretrained weights (a MoE router's bias). A model
that was loaded whole stays on the CPU for ``fully_shard`` to move layer by layer. Gradients are
reduce-scattered after every micro-batch instead of accumulated unsharded, and with fp16 every rank
skips the same overflowing steps (each rank only sees its own gradient shards).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sftjob.config import TrainerConfig
from sftjob_trainer import distributed
from sftjob_trainer.distributed import DistContext, wrap_model
from sftjob_trainer.model import build_model, load_model
from tests.trainer.runs import (
    RANKS,
    SMALL_SHARDED_MODEL,
    MakeConfig,
    tiny_glm_moe_config,
    torchrun,
    trainer_output,
)

pytestmark = pytest.mark.trainer

# No GPU here: the meta device stands for the rank's GPU (moving a module there is as visible).
GPU = torch.device("meta")
# Config overrides for full fine-tuning sharded over the ranks, with the fixture's global batch of 8.
SHARDED = {
    "method": "full",
    "distributed": {"nprocPerNode": RANKS, "sharding": "fsdp"},
    "training": {"gradientAccumulationSteps": 1},
}

# Two micro-batches of fp16 training on a small model sharded over the ranks; each rank writes what it saw.
FSDP_PROBE = (
    """
import json, sys
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from sftjob.config import TrainerConfig
from sftjob_trainer.distributed import init_distributed, no_sync, wrap_model
from sftjob_trainer.loop import make_scaler
from sftjob_trainer.model import precision_plan

"""
    + SMALL_SHARDED_MODEL
    + """scaler = make_scaler(precision_plan("full", "fp16"), ctx.device, sharded=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
seen = {"scaler": type(scaler).__name__, "stepped": [], "scale": []}
for overflow in (False, True):
    with no_sync(model, last_micro_batch=False):
        scaler.scale(model(torch.ones(2, 8))).backward()
    seen["shardedAfterFirstMicroBatch"] = all(
        isinstance(p.grad, DTensor) and p.grad.placements[0].is_shard() for p in model.parameters()
    )
    with no_sync(model, last_micro_batch=True):
        scaler.scale(model(torch.ones(2, 8))).backward()
    if overflow and ctx.rank == 0:  # in a gradient shard only rank 0 holds
        next(model.parameters()).grad.to_local()[0, 0] = float("inf")
    before = [p.detach().to_local().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    after = [p.detach().to_local() for p in model.parameters()]
    seen["stepped"].append(any(not torch.equal(b, a) for b, a in zip(before, after)))
    seen["scale"].append(scaler.get_scale())
with open(f"{sys.argv[2]}/rank-{ctx.rank}.json", "w") as fh:
    json.dump(seen, fh)
ctx.barrier()
ctx.close()
"""
)


# Each rank builds, shards and fills the model as a fresh full fine-tuning run does, then writes its logits.
FSDP_LOAD_PROBE = """
import sys
import torch
from sftjob.config import TrainerConfig
from sftjob_trainer.distributed import init_distributed, load_rank0_weights, wrap_model
from sftjob_trainer.model import build_model, pretrained_weights

config = TrainerConfig.load(sys.argv[1])
ctx = init_distributed(config)
model = wrap_model(build_model(config, "eager"), config, ctx, torch.float32)
load_rank0_weights(model, pretrained_weights(config, "eager") if ctx.is_main else {})
tied = model.lm_head.weight is model.model.embed_tokens.weight
with torch.no_grad():
    logits = model(input_ids=torch.arange(48).reshape(2, 24)).logits
seen = {"tied": tied, "logits": logits, "inv_freq": model.model.rotary_emb.inv_freq.clone()}
torch.save(seen, f"{sys.argv[2]}/rank-{ctx.rank}.pt")
ctx.barrier()
ctx.close()
"""


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose head is its embedding table, with Llama 3.1's RoPE scaling and sampling
    defaults of its own."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tied-llama") / "model"
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)
    model.save_pretrained(folder)
    return folder


def test_the_model_built_for_fsdp_is_the_loaded_one_without_its_weights_but_with_its_buffers_and_tied_head(
    trainer_config: MakeConfig, tied_llama: Path
) -> None:
    config = TrainerConfig.load(str(trainer_config(model={"path": str(tied_llama)}, **SHARDED)))
    built = build_model(config, "eager")
    loaded = load_model(config, torch.device("cpu"), "eager")
    assert {p.device for p in built.parameters()} == {torch.device("meta")}  # no memory
    assert built.lm_head.weight is built.model.embed_tokens.weight
    assert sorted(built.state_dict()) == sorted(loaded.state_dict())  # rank 0's weights fit it, strictly
    buffers = dict(loaded.named_buffers())
    assert sorted(dict(built.named_buffers())) == sorted(buffers) != []
    for name, buffer in built.named_buffers():
        assert buffer.device == torch.device("cpu") and torch.equal(buffer, buffers[name]), name
    assert built.training == loaded.training
    assert built.generation_config.to_dict() == loaded.generation_config.to_dict()  # saved with the output


def test_under_fsdp_every_rank_computes_the_logits_of_the_model_rank_0_loaded(
    trainer_config: MakeConfig, termination_log: Path, tied_llama: Path
) -> None:
    config = trainer_config(name="load", model={"path": str(tied_llama)}, **SHARDED)
    script = config.parent / "fsdp_load_probe.py"
    script.write_text(FSDP_LOAD_PROBE)
    assert torchrun(config, termination_log, [str(script), str(config), str(config.parent)]) == 0, (
        trainer_output(config)
    )
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        tied_llama, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        expected = reference(input_ids=torch.arange(48).reshape(2, 24)).logits
    for rank in range(RANKS):
        seen = torch.load(config.parent / f"rank-{rank}.pt", weights_only=True)
        assert seen["tied"], rank  # one shared parameter, trained once, as in one process
        # Rank 1 never loaded the model: its RoPE frequencies are its own, its weights rank 0's broadcast.
        assert torch.equal(seen["inv_freq"], reference.model.rotary_emb.inv_freq), rank
        torch.testing.assert_close(seen["logits"], expected, rtol=0, atol=1e-6, msg=f"rank {rank}")


def test_under_fsdp_the_loaded_model_stays_on_the_cpu_for_fully_shard_to_move_layer_by_layer(
    trainer_config: MakeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TrainerConfig.load(str(trainer_config(**SHARDED)))
    devices_when_sharded: list[set[torch.device]] = []

    def fully_shard(model: nn.Module, compute_dtype: torch.dtype, mesh: object) -> nn.Module:
        devices_when_sharded.append({p.device for p in model.parameters()})
        return model

    monkeypatch.setattr(distributed, "_fully_shard", fully_shard)
    wrap_model(nn.Linear(4, 4), config, DistContext(0, RANKS, 0, RANKS, GPU), torch.bfloat16)
    assert devices_when_sharded == [{torch.device("cpu")}]


def test_without_fsdp_the_whole_model_moves_to_the_device(trainer_config: MakeConfig) -> None:
    config = TrainerConfig.load(str(trainer_config(method="full")))
    model = wrap_model(nn.Linear(4, 4), config, DistContext(0, 1, 0, 1, GPU), torch.bfloat16)
    assert {p.device for p in model.parameters()} == {GPU}


def test_fsdp_reduce_scatters_every_micro_batch_and_all_ranks_skip_an_fp16_overflow_together(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config(name="probe", **SHARDED)
    script = config.parent / "fsdp_probe.py"
    script.write_text(FSDP_PROBE)
    assert torchrun(config, termination_log, [str(script), str(config), str(config.parent)]) == 0, (
        trainer_output(config)
    )
    for rank in range(RANKS):
        seen = json.loads((config.parent / f"rank-{rank}.json").read_text())
        assert seen["scaler"] == "ShardedGradScaler"
        # Sharded gradients already after the first micro-batch: no whole fp32 gradient waits on the GPU.
        assert seen["shardedAfterFirstMicroBatch"], rank
        # A clean step is taken; an overflow in rank 0's shard is skipped by both, which halve the scale.
        assert seen["stepped"] == [True, False], rank
        assert seen["scale"] == [65536.0, 32768.0], rank


# The trainer as an older one ran it: its checkpoints held no buffers.
OLDER_TRAINER = """
from sftjob_trainer import checkpoints, train

checkpoints.persistent_buffers = lambda model, state: set()
train.main()
"""
ROUTER_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def tiny_glm_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GLM-4 MoE whose router correction bias, a buffer, comes from its weights (not zero,
    as the model class builds it)."""
    from transformers import Glm4MoeForCausalLM

    from sftjob_trainer.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    config = tiny_glm_moe_config(
        len(tokenizer),
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config)
    with torch.no_grad():
        model.get_buffer(ROUTER_BIAS).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    folder = tmp_path_factory.mktemp("tiny-glm-moe") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("saved_by", ["this trainer", "an older trainer"])
def test_a_full_fine_tune_resumed_under_fsdp_keeps_the_router_bias_of_the_pretrained_weights(
    trainer_config: MakeConfig, termination_log: Path, tiny_glm_moe: Path, saved_by: str
) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from sftjob_trainer.checkpoints import TENSORS_DIR

    config = trainer_config(
        model={"path": str(tiny_glm_moe)},
        **SHARDED | {"training": {"gradientAccumulationSteps": 1, "maxSteps": 4}},
        checkpoints={"everySteps": 2},
    )
    entry = None
    if saved_by == "an older trainer":
        script = config.parent / "older_trainer.py"
        script.write_text(OLDER_TRAINER)
        entry = [str(script)]
    assert torchrun(config, termination_log, entry) == 0, trainer_output(config)
    saved = FileSystemReader(config.parent / "checkpoints" / "checkpoint-2" / TENSORS_DIR).read_metadata()
    assert (f"model.{ROUTER_BIAS}" in saved.state_dict_metadata) == (saved_by == "this trainer")

    # The restart resumes from step 2 (a full fine-tune's last step is not saved) on a model built with
    # a zero bias: before, it trained on with it, and wrote it.
    assert torchrun(config, termination_log) == 0, trainer_output(config)
    out = config.parent / "output"
    assert json.loads((out / "summary.json").read_text())["resumedFromStep"] == 2
    assert torch.equal(load_file(out / "model.safetensors")[ROUTER_BIAS], torch.tensor([1.0, 2.0, 3.0, 4.0]))
