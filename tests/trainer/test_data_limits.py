"""Examples are cut to the longest sequence training takes (maxSeqLength, or shorter packed rows), and
what that costs is counted: warned about past 1% of the examples, fatal past half of them dropped."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.data import WITHOUT_TARGET_FAIL_FRACTION, load_examples
from sftjob_trainer.tiny import format_row, make_tokenizer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def _dataset(path: Path, short: int, long: int) -> DatasetSource:
    """``short`` chats of about 30 tokens and ``long`` ones whose prompt alone is about 100 tokens."""
    rows = [format_row("repeat: abc", "abc", "messages")] * short
    rows += [format_row("repeat: " + "abc " * 50, "abc", "messages")] * long
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return DatasetSource(path=str(path), max_seq_length=256)


def test_packed_rows_shorter_than_max_seq_length_cut_examples_at_data_time_and_count_them(
    tmp_path: Path, tokenizer: Any
) -> None:
    source = _dataset(tmp_path / "rows.jsonl", short=99, long=1)
    examples, stats, _ = load_examples(source, tokenizer)
    assert (len(examples), stats.truncated, stats.without_target) == (100, 0, 0)

    examples, stats, _ = load_examples(source, tokenizer, row_length=64)  # an OOM re-plan's half rows
    assert (len(examples), stats.truncated, stats.without_target) == (99, 1, 1)
    assert max(len(e.input_ids) for e in examples) <= 64


def test_examples_left_without_a_target_warn_past_one_percent(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    source = _dataset(tmp_path / "rows.jsonl", short=90, long=10)
    with caplog.at_level(logging.WARNING):
        examples, _, _ = load_examples(source, tokenizer, row_length=64)
    assert len(examples) == 90
    assert "10 of 100 examples (10.0%) are longer than 64 tokens" in caplog.text
    assert "dataset.maxSeqLength=256; packed rows of 64 tokens from training.packingLength" in caplog.text


def test_more_than_half_the_examples_without_a_target_fail_naming_max_seq_length(
    tmp_path: Path, tokenizer: Any
) -> None:
    assert WITHOUT_TARGET_FAIL_FRACTION == 0.5
    source = _dataset(tmp_path / "rows.jsonl", short=4, long=6)
    reason = r"6 of 10 examples .* no target token .*dataset\.maxSeqLength"
    with pytest.raises(TrainerError, match=reason) as e:
        load_examples(source.model_copy(update={"max_seq_length": 64}), tokenizer)
    assert e.value.code == ExitCode.DATA_ERROR


def test_the_summary_counts_truncated_examples_and_those_without_a_target(trainer_config: MakeConfig) -> None:
    config = trainer_config("messages", training={"maxSteps": 1, "packingLength": 44})
    assert run(str(config)) == ExitCode.OK
    summary = json.loads((Path(json.loads(config.read_text())["outputDir"]) / "summary.json").read_text())
    assert summary["truncated"] > 0 and summary["withoutTarget"] == 0  # answers cut short, none cut off
