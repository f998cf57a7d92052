"""Varlen attention for packed rows: the same logits, loss and gradients as SDPA with a block mask; and
eager attention for models whose attention neither computes exactly (Gemma 2's soft-capping)."""

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
from sftjob_trainer.batching import Layout, Unit, collate, make_units
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
    from transformers import LlamaConfig

    assert resolve_attention("sdpa", CPU, packing=True) == attention.VARLEN
    assert resolve_attention("sdpa", CPU, packing=False) == "sdpa"
    assert resolve_attention("eager", CPU, True, LlamaConfig()) == "eager"  # Llama's masks keep them apart
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


def test_attention_sdpa_cannot_compute_exactly_loads_eager_instead(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    gemma2 = Gemma2Config(sliding_window=8)  # soft-caps attention logits at 50
    with caplog.at_level(logging.WARNING):
        assert resolve_attention("sdpa", CPU, True, gemma2, 6) == "eager"
    assert "gemma2 soft-caps its attention logits" in caplog.text and "using eager attention" in caplog.text
    assert resolve_attention("sdpa", CPU, False, gemma2, 6) == "eager"  # transformers refuses sdpa for it

    mistral = MistralConfig(sliding_window=16)  # every layer windowed
    assert resolve_attention("sdpa", CPU, True, mistral, 17) == "eager"  # an example longer than the window
    assert resolve_attention("sdpa", CPU, True, mistral, 16) == attention.VARLEN  # the window changes nothing
    assert resolve_attention("sdpa", CPU, False, mistral, 17) == "sdpa"  # sdpa gets the window as a mask
    qwen2 = Qwen2Config(sliding_window=16, use_sliding_window=False)
    assert resolve_attention("sdpa", CPU, True, qwen2, 64) == attention.VARLEN


def _gemma2_unit() -> Unit:
    """One packed row of three examples, each longer than the tiny Gemma 2's sliding window."""
    (unit,) = make_units([e for e in _examples() if len(e.input_ids) > 8][:3], packing_length=64)
    return unit


def test_packed_gemma2_examples_under_eager_attention_get_the_logits_they_have_alone(
    tiny_gemma2: Path,
) -> None:
    model = _load(tiny_gemma2, "eager").eval()
    unit = _gemma2_unit()
    batch = collate([unit], Layout(packing=True, flatten=False, pad_id=0))  # eager's layout
    with torch.no_grad():
        packed = model(**model_inputs(batch, CPU), use_cache=False).logits[0]
        bounds = [0, *itertools.accumulate(unit.lengths)]
        for start, end in itertools.pairwise(bounds):
            alone = model(input_ids=torch.tensor([unit.input_ids[start:end].tolist()])).logits[0]
            assert torch.allclose(packed[start:end], alone, atol=1e-5)

        for layer in model.model.layers:  # what dropping the soft-capping would compute
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(**model_inputs(batch, CPU), use_cache=False).logits[0]
    assert not torch.allclose(uncapped, packed, atol=1e-3)


def test_varlen_attention_refuses_soft_capping_and_examples_longer_than_the_window(tiny_gemma2: Path) -> None:
    model = _load(tiny_gemma2, attention.VARLEN)
    batch = collate([_gemma2_unit()], Layout(packing=True, flatten=True, pad_id=0))
    with pytest.raises(ValueError, match="soft-capping"):
        model(**model_inputs(batch, CPU), use_cache=False)

    q = torch.zeros(1, 2, 12, 4)
    bounds = torch.tensor([0, 4, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding window"):
        attention.varlen_attention_forward(
            model, q, q, q, None, cu_seq_lens_q=bounds, max_length_q=8, sliding_window=7
        )
    out, _ = attention.varlen_attention_forward(
        model, q, q, q, None, cu_seq_lens_q=bounds, max_length_q=8, sliding_window=8
    )  # no example longer than the window: causal attention is the windowed one
    assert out.shape == (1, 12, 2, 4)


def test_the_trainer_trains_packed_gemma2_rows_with_eager_attention(
    trainer_config: MakeConfig, tiny_gemma2: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config(
        "messages", model={"path": str(tiny_gemma2)}, method="full", training={"maxSteps": 2}
    )
    with caplog.at_level(logging.INFO):
        assert run(str(config)) == ExitCode.OK
    assert "soft-caps its attention logits" in caplog.text and "using eager attention" in caplog.text
    assert f"attention {attention.VARLEN}" not in caplog.text


def test_gemma3_keeps_its_sliding_window_in_the_text_config_and_long_packed_examples_load_eager(
    tmp_path: Path,
) -> None:
    from transformers import AutoConfig, Gemma3Config

    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 8}
    Gemma3Config(text_config=text).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)  # what the trainer reads: the multimodal config
    assert getattr(config, "sliding_window", None) is None
    assert resolve_attention("sdpa", CPU, True, config, 20) == "eager"
    assert resolve_attention("sdpa", CPU, True, config, 8) == attention.VARLEN
