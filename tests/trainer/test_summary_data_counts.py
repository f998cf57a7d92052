"""summary.json counts what the data stage lost beside the malformed, truncated and targetless examples:
the assistant turns trained without part of their text, and those not trained on at all."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from sftjob.failures import ExitCode
from sftjob_trainer.tiny import copy_task
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

# Like Qwen3's: an answer followed by another turn loses its <think> block, so only the last one trains.
DROPS_EARLIER_REASONING = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _row(i: int, prompt: str, answer: str) -> dict[str, Any]:
    user, reply = {"role": "user", "content": prompt}, {"role": "assistant", "content": answer}
    if i % 4 == 0:  # reasoning the template does not render: the answer trains without it
        return {"messages": [user, reply | {"reasoning_content": "copy the words"}]}
    if i % 4 == 1:  # two turns, the first with a <think> block the second drops: the first goes untrained
        first = {"role": "assistant", "content": f"<think>copy</think>{answer}"}
        return {"messages": [user, first, user, reply]}
    return {"messages": [user, reply]}


def test_the_summary_counts_the_answers_the_template_cut_short_or_left_untrained(
    trainer_config: MakeConfig, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    config = trainer_config("messages", training={"maxSteps": 2})
    settings = json.loads(config.read_text())
    model = shutil.copytree(settings["model"]["path"], tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = DROPS_EARLIER_REASONING
    tokenizer.save_pretrained(model)
    rows = [_row(i, prompt, answer) for i, (prompt, answer) in enumerate(copy_task(64))]
    Path(settings["dataset"]["path"]).write_text("".join(json.dumps(row) + "\n" for row in rows))
    config.write_text(json.dumps(settings | {"model": {"path": str(model)}}))

    assert run(str(config)) == ExitCode.OK
    summary = json.loads((Path(settings["outputDir"]) / "summary.json").read_text())
    assert summary["answersCutByTemplate"] == 16 and summary["answersUntrained"] == 16
