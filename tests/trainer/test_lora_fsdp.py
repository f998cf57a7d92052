"""LoRA with its frozen base sharded by FSDP2 over two CPU ranks (gloo), as a 70B LoRA runs on one node.

Every rank builds the peft model without weights and shards it; rank 0 alone loads the base and adds the
adapters, seeded as one process seeds them, and broadcasts both into the shards. The run must train as
one process does on the same global batch, resume from an adapter checkpoint (the base comes from rank 0
again: no checkpoint holds it), and leave a normal peft adapter, gathered on rank 0, that loads onto a
freshly loaded base. LoRA dropout is off: each rank draws its own masks (see test_distributed.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sftjob.failures import ExitCode
from sftjob_trainer.train import run
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output
from tests.trainer.test_distributed import (
    RECORD_PRETRAINED_LOADS,
    STEPS,
    _assert_same_training,
    _batch,
    _checkpoint_root,
    _output,
    _pretrained_loads,
    _summary,
    _training,
)

pytestmark = pytest.mark.trainer

NO_DROPOUT = {"lora": {"dropout": 0.0}}
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}
ADAPTER_ATOL = 1e-5  # float order of two ranks' sums vs one process's accumulation


def _adapter_logits(base: Path, adapter: Path) -> torch.Tensor:
    """Logits of ``adapter`` loaded with peft onto a freshly loaded ``base``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(loaded, adapter).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(48).reshape(2, 24) % 100).logits


def _assert_same_adapter(got: Path, expected: Path) -> None:
    from safetensors.torch import load_file

    assert {p.name for p in got.iterdir()} >= ADAPTER_FILES
    assert not list(got.glob("model*.safetensors"))  # the adapter alone: no gathered base
    a, b = load_file(got / "adapter_model.safetensors"), load_file(expected / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) != []
    for name, tensor in a.items():
        torch.testing.assert_close(tensor, b[name], rtol=0, atol=ADAPTER_ATOL, msg=name)


def test_lora_under_fsdp_trains_like_one_process_resumes_and_saves_an_adapter_peft_loads(
    trainer_config: MakeConfig, termination_log: Path, tiny_model: Path
) -> None:
    one = trainer_config("messages", name="one", **_batch(1), **NO_DROPOUT)
    assert run(str(one)) == ExitCode.OK
    expected = _training(one)

    two = trainer_config("messages", name="fsdp", **_batch(RANKS, sharding="fsdp"), **NO_DROPOUT)
    script = two.parent / "record_pretrained_loads.py"
    script.write_text(RECORD_PRETRAINED_LOADS)
    entry = [str(script), str(two.parent)]
    assert torchrun(two, termination_log, entry) == ExitCode.OK, trainer_output(two)
    _assert_same_training(two, expected, range(1, STEPS + 1))
    # Rank 0 alone held the whole base in CPU memory; rank 1 got its shards from rank 0's broadcast.
    assert _pretrained_loads(two.parent) == [1, 0]
    _assert_same_adapter(_output(two), _output(one))
    config = json.loads((_output(two) / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model) and config["r"] == 8
    torch.testing.assert_close(
        _adapter_logits(tiny_model, _output(two)),
        _adapter_logits(tiny_model, _output(one)),
        rtol=0,
        atol=1e-5,
    )

    # Again from the checkpoint of step 4, as if killed before the last save: the adapters and their
    # optimizer state come back into the shards, over the base rank 0 loads again.
    root = _checkpoint_root(two)
    shutil.rmtree(root / f"checkpoint-{STEPS}")
    assert torchrun(two, termination_log, entry) == ExitCode.OK, trainer_output(two)
    assert _summary(two)["resumedFromStep"] == 4
    _assert_same_training(two, expected, range(5, STEPS + 1))
    assert _pretrained_loads(two.parent) == [2, 0]
    _assert_same_adapter(_output(two), _output(one))
