"""A resume whose data layout changed (an OOM re-plan halved the packed rows) ends where the new layout's data
ends (or, from an older checkpoint, after the fraction of the run still to do): it still covers the planned
epochs and the learning rate continues without a jump."""

from __future__ import annotations

import itertools
import json
import logging
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from sftjob.config import TrainingSettings
from sftjob.failures import ExitCode
from sftjob_trainer.batching import Course, Schedule
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.loop import build_scheduler, continue_course, follow_course
from sftjob_trainer.train import run
from tests.trainer.runs import ONE_PACKED_EPOCH, MakeConfig, killed_at

pytestmark = pytest.mark.trainer

SETTINGS = TrainingSettings()  # cosine, 3% warmup, 2e-4


def _stepped(parts: Trainables, steps: int) -> list[float]:
    """The learning rate of each of ``steps`` optimizer steps."""
    rates = []
    for _ in range(steps):
        rates.append(parts.optimizer.param_groups[0]["lr"])
        parts.optimizer.step()
        parts.scheduler.step()
    return rates


def _parts(total: int) -> Trainables:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=SETTINGS.learning_rate)
    return Trainables(torch.nn.Linear(1, 1), optimizer, build_scheduler(optimizer, SETTINGS, total), None)


def test_halved_rows_after_20_of_33_steps_end_the_run_after_its_one_epoch() -> None:
    # 3200 examples of 600 tokens: 1067 rows of 2048 (33 steps of 32) or 3200 rows of 1024 (100 steps).
    rows_2048 = Schedule(units=1067, micro_batch_size=1, accumulation=32, world_size=1, seed=0)
    rows_1024 = Schedule(units=3200, micro_batch_size=1, accumulation=32, world_size=1, seed=0)
    course = Course.fresh(rows_2048.total_steps(1.0, None))
    assert course.resumed(20, 33) == course  # the same layout: an exact resume

    resumed = course.resumed(20, rows_1024.total_steps(1.0, None))
    assert resumed.total == 20 + 40  # 13 of 33 steps left: 39.4 of the new 100
    assert resumed.resumed(45, 100) == resumed  # a second restart with the same layout changes nothing
    schedule = Schedule(3200, 1, 32, 1, 0, offset=resumed.offset)
    assert schedule.epoch_of(20) == pytest.approx(0.6) and schedule.epoch_of(resumed.total) == 1.0
    assert resumed.position(20) == 20 and resumed.position(resumed.total) == pytest.approx(33)


def test_a_course_resumed_where_the_new_layouts_data_stands_ends_where_that_data_ends() -> None:
    # Rows halved at step 20 of 33: the rest of the epoch and what follows take the new layout's data
    # positions 62 to 100 (its offset 42), not the 39.4% of 100 steps the fraction of the run would give.
    course = Course.fresh(33, "epochs 1").resumed(20, 100, offset=42)
    assert (course.total, course.offset) == (58, 42)
    assert course.position(20) == 20 and course.position(58) == pytest.approx(33)  # the schedule's end
    assert course.resumed(40, 100) == course == course.resumed(40, 100, offset=42)  # a later restart


def test_the_learning_rate_continues_from_the_same_fraction_of_the_run_after_a_layout_change() -> None:
    uninterrupted = _parts(33)
    expected = _stepped(uninterrupted, 33)

    interrupted = _parts(33)
    before = _stepped(interrupted, 20)
    saved = interrupted.scheduler.state_dict(), interrupted.optimizer.state_dict()
    resumed = _parts(100)  # the trainer builds the new layout's schedule, then loads the checkpoint
    resumed.optimizer.load_state_dict(saved[1])
    resumed.scheduler.load_state_dict(saved[0])
    course = Course.fresh(33).resumed(20, 100)
    follow_course(resumed, SETTINGS, course)
    after = _stepped(resumed, course.total - 20)

    assert before == expected[:20]
    assert after[0] == expected[20]  # step 21 runs at the rate the interrupted run had set
    assert all(b <= a for a, b in itertools.pairwise(after))  # cosine: only down, no jump
    assert after[-1] <= expected[-1] + 1e-12 and after[-1] < 1e-6  # and down to ~0 at the end
    assert course.position(40) == 26.5 and expected[27] < after[20] < expected[26]  # step 41, not 1.84e-4


def _trained(parts: Trainables, first: int, last: int, skipped: frozenset[int] = frozenset()) -> list[float]:
    """The learning rate of each of the steps ``first`` to ``last``; a ``skipped`` step (fp16 overflow,
    non-finite: loop._update) updates nothing and holds the schedule back."""
    rates = []
    for step in range(first, last + 1):
        rates.append(parts.optimizer.param_groups[0]["lr"])
        if step not in skipped:
            parts.optimizer.step()
            parts.scheduler.step()
    return rates


def test_steps_skipped_before_a_layout_change_hold_the_learning_rate_back_after_it_as_before_it() -> None:
    skipped = frozenset({3, 4, 5, 6})
    uninterrupted = _parts(33)
    expected = _trained(uninterrupted, 1, 33, skipped)

    interrupted = _parts(33)
    assert _trained(interrupted, 1, 20, skipped) == expected[:20]
    saved = interrupted.scheduler.state_dict(), interrupted.optimizer.state_dict()
    resumed = _parts(100)
    resumed.optimizer.load_state_dict(saved[1])
    resumed.scheduler.load_state_dict(saved[0])
    assert resumed.scheduler.last_epoch == 16  # 20 steps, 16 updates
    state = TrainState(step=20, course=asdict(Course.fresh(33, "epochs 1")))
    course = continue_course(state, resumed, SETTINGS, 100)
    after = _trained(resumed, 21, course.total)

    assert course.total == 60 and course.rate_from == 16  # the data from step 20, the rate from update 16
    assert after[0] == expected[20]  # step 21 at the rate the run had set
    assert expected[21] < after[1] < after[0]  # then a third of a planned step on: no jump to step 19's
    assert all(b <= a for a, b in itertools.pairwise(after))
    # It ends held back by the four skipped steps, as the uninterrupted run ends.
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(
        uninterrupted.optimizer.param_groups[0]["lr"]
    )


def test_the_learning_rate_goes_on_from_where_it_stood_through_two_layout_changes_with_skipped_steps() -> (
    None
):
    first = Course.fresh(33).resumed(20, 100, updates=16)
    assert first.position(20) == 20 and first.rate_position(16) == 16
    second = first.resumed(30, 200, updates=24)  # 10 steps on, 2 of them skipped
    assert second.position(30) == first.position(30)  # the same fraction of the run done
    assert second.rate_position(24) == first.rate_position(24)  # the rate where it stood
    end = 24 + second.total - 30  # updates at the end, no step skipped since
    assert second.rate_position(end) == pytest.approx(33 - 4 - 2 * first.pace)  # held back by the skips only


def test_a_course_saved_without_where_the_rate_stood_resumes_as_it_was_laid_out() -> None:
    laid_out = Course.fresh(33).resumed(20, 100)  # no step skipped: the rate where the run is
    older = {k: v for k, v in asdict(laid_out).items() if k not in ("updates_from", "rate_from")}
    assert Course.saved(older) == laid_out
    assert [laid_out.rate_position(u) for u in (20, 40)] == [laid_out.position(s) for s in (20, 40)]


def test_a_resume_with_halved_rows_ends_after_the_planned_epoch_with_a_smooth_learning_rate(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("messages", **ONE_PACKED_EPOCH)
    assert run(str(config)) == ExitCode.OK
    settings = killed_at(config, 6)  # and restarted with half the row length
    output = Path(settings["outputDir"])
    first = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    planned = first[-1]["step"]
    assert first[-1]["epoch"] == 1.0

    settings["training"]["packingLength"] = 64
    config.write_text(json.dumps(settings))
    with caplog.at_level(logging.WARNING):
        assert run(str(config)) == ExitCode.OK
    assert "resuming at step 6 with a data layout that takes" in caplog.text
    lines = (output / "train_log.jsonl").read_text().splitlines()
    second = [json.loads(line) for line in lines[len(first) :]]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["resumedFromStep"] == 6
    assert summary["totalSteps"] == summary["steps"] == second[-1]["step"] > planned  # more, smaller steps
    assert second[-1]["epoch"] == 1.0  # one epoch in all, as planned

    rates = [record["learningRate"] for record in second]
    assert rates[0] == first[6]["learningRate"]  # step 7 at the rate of the uninterrupted run
    assert all(b <= a for a, b in itertools.pairwise(rates))
    assert rates[-1] <= first[-1]["learningRate"]


def test_a_job_recreated_with_more_steps_over_its_kept_checkpoints_runs_them_all_on_a_new_schedule(
    trainer_config: MakeConfig, caplog: pytest.LogCaptureFixture
) -> None:
    config = trainer_config("text", training={"maxSteps": 8}, checkpoints={"everySteps": 2, "keep": 20})
    assert run(str(config)) == ExitCode.OK
    settings = killed_at(config, 4)
    settings["training"]["maxSteps"] = 12  # not a layout change: the user asked for a longer run
    config.write_text(json.dumps(settings))
    with caplog.at_level(logging.WARNING):
        assert run(str(config)) == ExitCode.OK
    assert "another run length (maxSteps 12, was maxSteps 8)" in caplog.text
    summary = json.loads((Path(settings["outputDir"]) / "summary.json").read_text())
    assert summary["resumedFromStep"] == 4 and summary["totalSteps"] == summary["steps"] == 12


def test_a_job_recreated_with_a_lower_learning_rate_resumes_at_it_not_at_the_checkpoints() -> None:
    from sftjob_trainer.loop import build_optimizer, rebase

    model = torch.nn.Linear(4, 2)
    first = build_optimizer(model, SETTINGS, torch.device("cpu"))
    before = Trainables(model, first, build_scheduler(first, SETTINGS, 100), None)
    _stepped(before, 50)
    saved = before.optimizer.state_dict(), before.scheduler.state_dict()

    lower = SETTINGS.model_copy(update={"learning_rate": 2e-5, "weight_decay": 0.1})
    again = build_optimizer(model, lower, torch.device("cpu"))
    after = Trainables(model, again, build_scheduler(again, lower, 100), None)
    after.optimizer.load_state_dict(saved[0])  # what a resume restores: the old rate and decay with it
    after.scheduler.load_state_dict(saved[1])
    rebase(after, lower)

    factor = after.scheduler.lr_lambdas[0](50)
    assert after.scheduler.base_lrs == [2e-5, 2e-5]
    assert [g["lr"] for g in after.optimizer.param_groups] == pytest.approx([2e-5 * factor] * 2)
    assert [g["weight_decay"] for g in after.optimizer.param_groups] == [0.1, 0.0]
    after.scheduler.step()
    assert after.optimizer.param_groups[0]["lr"] == pytest.approx(2e-5 * after.scheduler.lr_lambdas[0](51))


def test_a_job_recreated_with_more_steps_and_a_lower_learning_rate_trains_every_step_on_the_new_schedule(
    trainer_config: MakeConfig, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from sftjob_trainer.checkpoints import SCHEDULER_FILE, TENSORS_DIR

    config = trainer_config("text", training={"maxSteps": 8}, checkpoints={"everySteps": 2, "keep": 20})
    assert run(str(config)) == ExitCode.OK
    settings = killed_at(config, 4)
    output, root = Path(settings["outputDir"]), Path(settings["checkpoints"]["dir"])
    first = len((output / "train_log.jsonl").read_text().splitlines())
    # 100 -> 200 steps in the review's words: the run longer, the rate ten times lower, some weight decay.
    settings["training"] |= {"maxSteps": 12, "learningRate": 3e-4, "weightDecay": 0.1}
    config.write_text(json.dumps(settings))
    assert run(str(config)) == ExitCode.OK

    lines = (output / "train_log.jsonl").read_text().splitlines()[first:]
    rates = {record["step"]: record["learningRate"] for record in map(json.loads, lines)}
    cosine = {step: 3e-4 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 12)) for step in range(5, 13)}
    assert rates == pytest.approx(cosine)  # step 5 too: not the old schedule's 1.5e-3 of 3e-3
    scheduler = torch.load(root / "checkpoint-12" / SCHEDULER_FILE, weights_only=False)
    assert scheduler["base_lrs"] == pytest.approx([3e-4] * len(scheduler["base_lrs"]))
    dcp_to_torch_save(root / "checkpoint-12" / TENSORS_DIR, tmp_path / "12.pt")
    groups = torch.load(tmp_path / "12.pt", weights_only=False)["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups if group["params"]] == [0.1]  # LoRA: matrices only
