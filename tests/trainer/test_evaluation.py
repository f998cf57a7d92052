"""spec.evaluation: which examples are held out, how their loss is measured, and where it is reported."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from sftjob.config import DatasetSource, EvaluationSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.batching import Layout
from sftjob_trainer.checkpoints import newest_complete_step
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.evaluation import eval_set, evaluate, fused_loss_in, hold_out, load_split
from sftjob_trainer.model import precision_plan
from sftjob_trainer.tiny import write_dataset
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(0, 1, 0, 1, torch.device("cpu"))


def _examples(count: int) -> list[Example]:
    return [Example([1, 2 + i % 50, 3], [IGNORE_INDEX, 2 + i % 50, 3], row=i) for i in range(count)]


def _rows(examples: list[Example]) -> list[int]:
    return [e.row for e in examples]


def test_a_held_out_fraction_is_the_same_rows_every_time_and_none_of_them_trains() -> None:
    examples = _examples(2000)
    settings = EvaluationSettings(fraction=0.1)
    train, held = hold_out(examples, 2000, settings, seed=7)
    again_train, again_held = hold_out(examples, 2000, settings, seed=7)
    assert 150 <= len(held) <= 250 and len(train) + len(held) == 2000
    assert _rows(held) == _rows(again_held) and _rows(train) == _rows(again_train)
    assert not set(_rows(held)) & set(_rows(train))
    assert _rows(hold_out(examples, 2000, settings, seed=8)[1]) != _rows(held)


def test_a_row_stays_held_out_when_other_rows_drop_out_of_the_examples() -> None:
    examples = _examples(2000)
    settings = EvaluationSettings(fraction=0.1, max_samples=50)
    _, held = hold_out(examples, 2000, settings, seed=3)
    # An OOM re-plan cut the examples shorter: every third row lost its target and is gone.
    fewer = [e for e in examples if e.row % 3]
    train, held_again = hold_out(fewer, 2000, settings, seed=3)
    assert _rows(held_again) == [r for r in _rows(held) if r % 3]
    assert not set(_rows(train)) & set(_rows(held))


def test_a_held_out_fraction_keeps_at_most_max_samples_and_the_row_with_the_smallest_key() -> None:
    _, capped = hold_out(_examples(200), 200, EvaluationSettings(fraction=0.5, max_samples=7), seed=0)
    assert len(capped) == 7
    _, one = hold_out(_examples(3), 3, EvaluationSettings(fraction=0.01), seed=0)
    assert len(one) == 1


def test_the_rows_held_out_of_a_small_dataset_never_move_onto_a_row_trained_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    examples, settings = _examples(60), EvaluationSettings(fraction=0.01)  # often no key below it
    for seed in range(10):
        train, held = hold_out(examples, 60, settings, seed)
        rows = set(_rows(held))
        assert rows
        # An OOM re-plan cut the examples shorter: other rows lost their target, then the held-out ones too.
        fewer = [e for e in examples if e.row % 7 or e.row in rows]
        assert set(_rows(hold_out(fewer, 60, settings, seed)[1])) == rows
        with caplog.at_level(logging.WARNING):
            train_again, held_again = hold_out([e for e in examples if e.row not in rows], 60, settings, seed)
        assert held_again == [] and _rows(train_again) == _rows(train)
    assert caplog.text.count("holds out no usable example") == 10


def test_a_fraction_that_leaves_nothing_to_train_on_is_a_data_error() -> None:
    with pytest.raises(TrainerError) as err:
        hold_out(_examples(1), 1, EvaluationSettings(fraction=0.5), seed=0)
    assert err.value.code == ExitCode.DATA_ERROR and "leaves none to train on" in str(err.value)


def test_every_rank_runs_as_many_eval_batches_and_a_short_rank_gets_no_targets() -> None:
    layout = Layout(packing=False, flatten=False, pad_id=0)
    held = eval_set(_examples(5), None, 2, layout)
    first, second = list(held.batches(0, 2)), list(held.batches(1, 2))
    assert len(first) == len(second) == 2
    assert [int(b["num_targets"]) for b in first] == [4, 2]  # units 0, 2 then 4
    assert [int(b["num_targets"]) for b in second] == [4, 0]  # units 1, 3 then a blank batch
    assert held.examples == 5


@pytest.mark.parametrize(("packing", "micro"), [(None, 1), (None, 3), (128, 2)])
def test_the_eval_loss_is_the_mean_loss_per_target_token_however_the_examples_are_batched(
    tiny_model: Path, packing: int | None, micro: int
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    model.train()  # evaluate switches dropout and recomputation off, and puts the mode back
    examples = [Example([5, 6 + i, 7, 8 + i, 9], [IGNORE_INDEX, IGNORE_INDEX, 7, 8 + i, 9]) for i in range(7)]
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logits = model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1]
            labels = torch.tensor(e.labels[1:])
            total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            count += int((labels != IGNORE_INDEX).sum())
    layout = Layout(packing=packing is not None, flatten=False, pad_id=0)
    loss, seconds = evaluate(
        model, eval_set(examples, packing, micro, layout), precision_plan("full", "fp32"), ONE_PROCESS
    )
    assert loss == pytest.approx(total / count, rel=1e-5)
    assert seconds >= 0 and model.training


def test_an_eval_split_that_reads_the_training_file_is_a_data_error(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "rows.jsonl", "messages", rows=8)
    source = DatasetSource(path=str(data))
    with pytest.raises(TrainerError) as err:
        load_split(source, EvaluationSettings(split="validation"), "messages", None, None, 0)
    assert err.value.code == ExitCode.DATA_ERROR and "use evaluation.fraction" in str(err.value)


def test_a_run_reports_its_eval_loss_in_the_summary_the_train_log_and_the_checkpoints(
    trainer_config: MakeConfig,
) -> None:
    config = trainer_config(
        "messages",
        training={"maxSteps": 6},
        checkpoints={"everySteps": 4},
        evaluation={"fraction": 0.1, "everySteps": 3},
    )
    assert run(str(config)) == ExitCode.OK
    settings = json.loads(config.read_text())
    output = Path(settings["outputDir"])
    summary = json.loads((output / "summary.json").read_text())
    assert summary["evalStep"] == 6 and 5 <= summary["evalExamples"] <= 25  # about 10% of 128 rows
    lines = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    evaluations = [line for line in lines if "evalLoss" in line]
    assert [line["step"] for line in evaluations] == [3, 4, 6]  # everySteps, the checkpoint, the end
    assert evaluations[-1]["evalLoss"] == pytest.approx(summary["evalLoss"])
    root = Path(settings["checkpoints"]["dir"])
    step = newest_complete_step(root)
    state = json.loads((root / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["eval_step"] == step and state["eval_loss"] == pytest.approx(summary["evalLoss"])


def test_an_eval_split_of_a_dataset_folder_reads_its_own_files(
    trainer_config: MakeConfig, tmp_path: Path
) -> None:
    folder = tmp_path / "data"
    write_dataset(folder / "train.jsonl", "alpaca", rows=64, seed=0)
    write_dataset(folder / "validation.jsonl", "alpaca", rows=5, seed=3)
    config = trainer_config(
        "alpaca", training={"maxSteps": 2}, dataset={"path": str(folder)}, evaluation={"split": "validation"}
    )
    assert run(str(config)) == ExitCode.OK
    summary = json.loads((Path(json.loads(config.read_text())["outputDir"]) / "summary.json").read_text())
    assert summary["evalExamples"] == 5 and summary["evalLoss"] > 0


def test_a_stop_request_ends_the_evaluation_before_its_next_batch_without_a_loss(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    held = eval_set(_examples(6), None, 2, Layout(packing=False, flatten=False, pad_id=0))
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1  # SIGTERM arrives during the first batch

    ticks: list[int] = []
    loss, _ = evaluate(
        model, held, precision_plan("full", "fp32"), ONE_PROCESS, stop=stop, tick=lambda: ticks.append(1)
    )
    assert loss is None and len(ticks) == 1


def test_liger_s_fused_loss_is_found_inside_peft_s_wrapper(tiny_model: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    wrapped = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    assert not fused_loss_in(wrapped)

    def lce_forward(*args: object, **kwargs: object) -> None:  # what Liger patches onto the instance
        raise AssertionError

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"
    base.forward = lce_forward  # type: ignore[method-assign]
    assert fused_loss_in(wrapped)


def test_an_eval_split_missing_from_the_folder_names_the_evaluation_field(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    write_dataset(folder / "train.jsonl", "messages", rows=4)
    write_dataset(folder / "test.jsonl", "messages", rows=4)
    with pytest.raises(TrainerError, match=r"none is split 'validation' \(evaluation.split\)"):
        load_split(
            DatasetSource(path=str(folder)), EvaluationSettings(split="validation"), "messages", None, None, 0
        )


def test_a_resume_whose_held_out_examples_an_oom_replan_cut_shorter_compares_no_loss_across_the_cut(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config(
        "text",  # 13 to 29 tokens an example: rows of 16 cut most of them
        training={"maxSteps": 8, "packingLength": 64},
        checkpoints={"everySteps": 2, "keep": 20},
        evaluation={"fraction": 0.1, "finalModel": "Best", "earlyStopping": {"patience": 3}},
    )
    assert run(str(config)) == ExitCode.OK
    settings = json.loads(config.read_text())
    output, root = Path(settings["outputDir"]), Path(settings["checkpoints"]["dir"])
    first = len((output / "train_log.jsonl").read_text().splitlines())
    kept = json.loads((root / "checkpoint-4" / "trainer_state.json").read_text())
    assert kept["lowest_eval_loss"] is not None and kept["eval_set"]["examples"] > 0
    for step in (6, 8):
        shutil.rmtree(root / f"checkpoint-{step}")
    settings["training"]["packingLength"] = 16  # the OOM re-plan halved the rows (twice)
    config.write_text(json.dumps(settings))
    with caplog.at_level(logging.WARNING):
        assert run(str(config)) == ExitCode.OK
    assert "resuming at step 4 with other held-out examples" in caplog.text

    lines = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()[first:]]
    losses = {line["step"]: line["evalLoss"] for line in lines if "evalLoss" in line}
    assert sorted(losses) == [4, 6, 8]  # the weights resumed from evaluated again, on the cut examples
    state = json.loads((root / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["eval_set"] != kept["eval_set"]
    assert state["lowest_eval_loss"] == pytest.approx(min(losses.values()))  # none of the longer examples'
    assert state["best_eval_loss"] == pytest.approx(min(losses.values()))
    assert state["best_step"] in losses


def test_a_resume_on_the_same_held_out_examples_or_from_a_state_that_names_none_keeps_its_counts() -> None:
    from sftjob_trainer import selection
    from sftjob_trainer.checkpoints import TrainState

    measured = eval_set(_examples(10), None, 2, Layout(False, False, 0)).fingerprint
    assert measured == eval_set(_examples(10), 64, 4, Layout(True, False, 0)).fingerprint  # packing aside
    for saved in (measured, {}):  # {}: an older trainer's state
        state = TrainState(step=8, eval_step=8, eval_loss=1.0, lowest_eval_loss=0.9, eval_set=saved)
        state.evals_without_improvement, state.best_step, state.best_eval_loss = 2, 4, 0.9
        selection.measured_on(state, measured)
        assert (state.lowest_eval_loss, state.evals_without_improvement, state.best_step) == (0.9, 2, 4)
        assert state.eval_set == measured
    cut = [Example(e.input_ids[:2], e.labels[:2], e.row) for e in _examples(10)]
    assert eval_set(cut, None, 2, Layout(False, False, 0)).fingerprint != measured
