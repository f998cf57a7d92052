"""Tiny end-to-end runs: every data format with LoRA and full fine-tuning, outputs, learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sftjob.failures import ExitCode
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.data import Example
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig, train_log

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize("fmt", ["messages", "alpaca", "text"])
def test_lora_and_full_runs_finish_and_save_outputs_for_every_format(
    trainer_config: MakeConfig, method: str, fmt: str, termination_log: Path
) -> None:
    config = trainer_config(fmt, method=method, training={"maxSteps": 4})
    assert run(str(config)) == ExitCode.OK
    output = Path(json.loads(config.read_text())["outputDir"])
    summary = json.loads((output / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["format"] == fmt
    assert summary["tokens"] > 0 and summary["tokensPerSecond"] > 0
    weights = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert (output / weights).is_file()
    assert (output / "tokenizer.json").is_file()
    assert termination_log.read_text().startswith("completed 4 steps")


def test_loss_goes_down_on_a_copy_task(trainer_config: MakeConfig) -> None:
    config = trainer_config("messages", method="full", training={"maxSteps": 30, "loggingEverySteps": 1})
    assert run(str(config)) == ExitCode.OK
    losses = train_log(config)
    first, last = sum(losses[s] for s in range(1, 4)) / 3, sum(losses[s] for s in range(28, 31)) / 3
    assert last < 0.8 * first, (first, last)


def test_auto_detection_reads_parquet_folders(trainer_config: MakeConfig, tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    config_path = trainer_config("alpaca", training={"maxSteps": 2})
    config = json.loads(config_path.read_text())
    jsonl = Path(config["dataset"]["path"])
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pyarrow.Table.from_pylist(rows), folder / "part-0.parquet")
    config["dataset"] = {"path": str(folder), "maxSeqLength": 64}
    config_path.write_text(json.dumps(config))
    assert run(str(config_path)) == ExitCode.OK
    summary = json.loads((Path(config["outputDir"]) / "summary.json").read_text())
    assert summary["format"] == "alpaca"


def test_packed_rows_give_each_example_the_logits_it_has_alone(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    a, b = Example(list(range(5, 17)), [-100] * 12), Example(list(range(40, 49)), [-100] * 9)
    (unit,) = make_units([a, b], packing_length=32)
    batch = collate([unit], Layout(packing=True, flatten=False, pad_id=0))
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        alone = [model(input_ids=torch.tensor([e.input_ids])).logits[0] for e in (a, b)]
    assert torch.allclose(packed[0, :12], alone[0], atol=1e-5)
    assert torch.allclose(packed[0, 12:], alone[1], atol=1e-5)
    assert batch["num_tokens"].item() == 21 and batch["num_samples"].item() == 2
