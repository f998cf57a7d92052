"""Attention dropout (GPT-2's and StarCoder-1's ``attn_pdrop`` of 0.1) under varlen attention: applied
example by example in training, as SDPA applies it, and off in evaluation, where packed examples keep the
logits they have alone; a packed GPT-2 run trains."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from sftjob.failures import ExitCode
from sftjob_trainer import attention
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.data import Example
from sftjob_trainer.loop import model_inputs
from sftjob_trainer.model import resolve_attention
from sftjob_trainer.tiny import make_tokenizer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, train_log

pytestmark = pytest.mark.trainer

CPU = torch.device("cpu")
# Only the attention weights dropped: the rest of the model is deterministic in training mode too.
_SHAPE = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _model(model_type: str, attn_pdrop: float) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    attention.register()
    config = AutoConfig.for_model(model_type, vocab_size=128, attn_pdrop=attn_pdrop, **_SHAPE)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention.VARLEN)


def _packed() -> tuple[dict[str, torch.Tensor], list[int]]:
    generator = torch.Generator().manual_seed(0)
    examples = [
        Example(torch.randint(3, 128, (n,), generator=generator).tolist(), [1] * n) for n in (11, 7, 9)
    ]
    (unit,) = make_units(examples, packing_length=32)
    return collate([unit], Layout(packing=True, flatten=True, pad_id=0)), [
        0,
        *itertools.accumulate(unit.lengths),
    ]


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_bigcode"])
def test_varlen_attention_drops_attention_weights_in_training_and_none_in_evaluation(model_type: str) -> None:
    model = _model(model_type, attn_pdrop=0.5)
    batch, bounds = _packed()
    inputs = model_inputs(batch, CPU)
    with torch.no_grad():
        evaluated = model.eval()(**inputs, use_cache=False).logits[0]
        for start, end in itertools.pairwise(bounds):  # no dropout: each example as alone
            alone = model(input_ids=batch["input_ids"][:, start:end], use_cache=False).logits[0]
            torch.testing.assert_close(evaluated[start:end], alone, rtol=1e-5, atol=1e-5)
        model.train()
        trained = [model(**inputs, use_cache=False).logits[0] for _ in range(2)]
    assert not torch.allclose(trained[0], evaluated, atol=1e-3)  # dropped weights change the output
    assert not torch.allclose(trained[0], trained[1], atol=1e-3)  # and differently every time
    without = _model(model_type, attn_pdrop=0.0).train()
    with torch.no_grad():
        torch.testing.assert_close(without(**inputs, use_cache=False).logits[0], evaluated)


def test_the_kernel_backend_names_attention_dropout_as_what_keeps_a_gpu_off_the_flash_varlen_kernel() -> None:
    assert "attention dropout 0.1" in attention.kernel_backend(torch.device("cuda"), 0.1)
    assert "dropout" not in attention.kernel_backend(torch.device("cuda"))


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 with GPT-2's dropout settings (attention, residual and embedding: 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("tiny-gpt2") / "model"
    tokenizer = make_tokenizer()
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=256, **ids)
    assert config.attn_pdrop == 0.1
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_packed_gpt2_run_with_attention_dropout_trains_with_varlen_attention(
    trainer_config: MakeConfig, tiny_gpt2: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoConfig

    assert resolve_attention("sdpa", CPU, True, AutoConfig.from_pretrained(tiny_gpt2), 64) == attention.VARLEN
    config = trainer_config(model={"path": str(tiny_gpt2)}, method="full", training={"maxSteps": 2})
    with caplog.at_level(logging.INFO):
        assert run(str(config)) == ExitCode.OK
    assert f"attention {attention.VARLEN}" in caplog.text
    losses = train_log(config)
    assert sorted(losses) == [1, 2] and all(0 < loss < 100 for loss in losses.values())
    assert (Path(json.loads(config.read_text())["outputDir"]) / "model.safetensors").is_file()
