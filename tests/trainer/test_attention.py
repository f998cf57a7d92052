"""Varlen attention for packed rows: the same logits, loss and gradients as SDPA with a block mask."""

from __future__ import annotations

import importlib
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
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.loop import model_inputs
from sftjob_trainer.model import resolve_attention
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

CPU = torch.device("cpu")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _examples() -> list[Example]:
    """Lengths that pack into two 32-token rows of several examples each; labels on the answers."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for n in (13, 9, 7, 11, 5, 16, 3):
        ids = torch.randint(3, 300, (n,), generator=generator).tolist()
        examples.append(Example(ids, [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]))
    return examples


def _load(folder: Path, implementation: str) -> Any:
    from transformers import AutoModelForCausalLM

    attention.register()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=implementation)
    model.config.use_cache = False
    return model.train()


def _forward(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    targets = batch["num_targets"].clone()
    output = model(**model_inputs(batch, CPU), use_cache=False, num_items_in_batch=targets)
    output.loss.backward()
    return output.logits, output.loss


def test_varlen_attention_matches_sdpa_with_a_block_mask_in_logits_loss_and_gradients(
    tiny_model: Path,
) -> None:
    units = make_units(_examples(), packing_length=32)
    assert len(units) == 2 and all(len(u.lengths) >= 2 for u in units)
    masked = collate(units, Layout(packing=True, flatten=False, pad_id=0))  # two rows, block mask
    flat = collate(units, Layout(packing=True, flatten=True, pad_id=0))  # one row, cu_seq_lens
    assert flat["input_ids"].shape[0] == 1 and flat["cu_seq_lens"].dtype == torch.int32
    assert flat["cu_seq_lens"].tolist()[-1] == flat["input_ids"].shape[1]

    sdpa, varlen = _load(tiny_model, "sdpa"), _load(tiny_model, attention.VARLEN)
    assert varlen.config.num_key_value_heads < varlen.config.num_attention_heads  # GQA is covered
    sdpa_logits, sdpa_loss = _forward(sdpa, masked)
    varlen_logits, varlen_loss = _forward(varlen, flat)

    rows = [len(u.input_ids) for u in units]
    real = torch.cat([sdpa_logits[i, :n] for i, n in enumerate(rows)])
    assert torch.allclose(varlen_logits[0], real, atol=1e-5)
    assert torch.allclose(varlen_loss, sdpa_loss, atol=1e-6)
    for (name, a), b in zip(sdpa.named_parameters(), varlen.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_each_packed_example_gets_the_logits_it_has_alone(tiny_model: Path) -> None:
    model = _load(tiny_model, attention.VARLEN).eval()
    examples = _examples()[:3]
    (unit,) = make_units(examples, packing_length=64)
    batch = collate([unit], Layout(packing=True, flatten=True, pad_id=0))
    with torch.no_grad():
        packed = model(**model_inputs(batch, CPU), use_cache=False).logits[0]
        alone = {len(e.input_ids): model(input_ids=torch.tensor([e.input_ids])).logits[0] for e in examples}
    bounds = batch["cu_seq_lens"].tolist()
    for start, end in itertools.pairwise(bounds):
        assert torch.allclose(packed[start:end], alone[end - start], atol=1e-5)


def test_packed_sdpa_runs_load_varlen_attention_and_padded_runs_keep_sdpa() -> None:
    assert resolve_attention("sdpa", CPU, packing=True) == attention.VARLEN
    assert resolve_attention("sdpa", CPU, packing=False) == "sdpa"
    assert resolve_attention("eager", CPU, packing=True) == "eager"
    assert {attention.VARLEN, "flash_attention_2"} <= attention.FLATTENED


def test_the_trainer_trains_packed_rows_with_varlen_attention(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("messages", method="full", training={"maxSteps": 2})
    with caplog.at_level(logging.INFO):
        assert run(str(config)) == ExitCode.OK
    assert any(f"attention {attention.VARLEN}" in r.getMessage() for r in caplog.records)
    output = Path(json.loads(config.read_text())["outputDir"])
    assert attention.VARLEN not in (output / "config.json").read_text()  # the saved model loads anywhere


def test_varlen_attention_refuses_padded_batches() -> None:
    with pytest.raises(ValueError, match="without padding"):
        attention.no_mask(attention_mask=torch.tensor([[1, 1, 0]]))
    attention.no_mask(attention_mask=torch.tensor([[1, 1, 1]]))  # no padding: no error, no mask


def test_the_benchmark_self_check_compares_varlen_with_a_masked_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    check = importlib.import_module("throughput_workload").attention_check(CPU)
    assert check["backend"].startswith("per-example sdpa")
    assert check["maxAbsDiffOutput"] < 1e-5 and check["maxAbsDiffGrad"] < 1e-5
