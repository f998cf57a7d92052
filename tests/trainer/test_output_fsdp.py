"""The output of a full fine-tune sharded with FSDP2 is the model one process would write: a tied head is
written once, as the embedding table it is (gathering the shards copies each key separately)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sftjob_trainer.tiny import make_tokenizer, tiny_llama
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# Each rank builds the same tied Llama, shards it, and writes the output as the trainer does at the end.
WRITE_SHARDED = """
import sys
import torch
from sftjob.config import TrainerConfig
from sftjob_trainer import output
from sftjob_trainer.distributed import init_distributed, wrap_model
from sftjob_trainer.tiny import make_tokenizer, tiny_llama

config = TrainerConfig.load(sys.argv[1])
ctx = init_distributed(config)
tokenizer = make_tokenizer()
torch.manual_seed(0)
model = wrap_model(tiny_llama(tokenizer, tied=True), config, ctx, torch.float32)
output.write_model(config, ctx, model, tokenizer, {"steps": 0})
ctx.close()
"""


def test_under_fsdp_a_tied_head_is_written_once_as_the_embedding_table(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    from transformers import AutoModelForCausalLM

    config = trainer_config(
        method="full",
        distributed={"nprocPerNode": RANKS, "sharding": "fsdp"},
        training={"gradientAccumulationSteps": 1, "precision": "bf16"},
    )
    script = config.parent / "write_sharded.py"
    script.write_text(WRITE_SHARDED)
    assert torchrun(config, termination_log, [str(script), str(config)]) == 0, trainer_output(config)

    out = config.parent / "output"
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.manual_seed(0)
    built = tiny_llama(make_tokenizer(), tied=True)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, built.get_parameter(name).to(torch.bfloat16)), name
