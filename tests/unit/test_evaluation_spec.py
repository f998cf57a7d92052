"""spec.evaluation: what the spec accepts, what the trainer is told and what the status shows of it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from sftjob.config import EvaluationSettings
from sftjob.constants import ANNOTATION_CHECKPOINT, ANNOTATION_PROGRESS
from sftjob.spec import SFTJobSpec
from sftjob_operator import observe

BASE: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "dataset": {"name": "org/chats"}}


def _spec(**changes: Any) -> SFTJobSpec:
    return SFTJobSpec.model_validate(BASE | changes)


def test_evaluation_is_off_unless_asked_for_and_keeps_a_thousand_examples_by_default() -> None:
    assert _spec().evaluation is None
    settings = _spec(evaluation={"fraction": 0.02}).evaluation
    assert settings == EvaluationSettings(fraction=0.02, max_samples=1000, every_steps=None)


@pytest.mark.parametrize(
    ("evaluation", "words"),
    [
        ({"split": "test", "fraction": 0.1}, "exactly one of split"),
        ({"everySteps": 10}, "exactly one of split"),
        ({"split": "train"}, "the split the job trains on"),
        ({"fraction": 0.6}, "less than or equal to 0.5"),
        ({"fraction": 0}, "greater than 0"),
        ({"fraction": 0.1, "maxSamples": 0}, "greater than or equal to 1"),
    ],
)
def test_an_evaluation_that_holds_out_nothing_or_everything_is_refused(
    evaluation: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        _spec(evaluation=evaluation)


def test_another_split_than_the_training_split_is_accepted() -> None:
    spec = _spec(dataset={"name": "org/chats", "split": "train_sft"}, evaluation={"split": "test_sft"})
    assert spec.evaluation is not None and spec.evaluation.split == "test_sft"


def _pod(progress: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None) -> observe.Obj:
    annotations = {}
    if progress is not None:
        annotations[ANNOTATION_PROGRESS] = json.dumps(progress)
    if checkpoint is not None:
        annotations[ANNOTATION_CHECKPOINT] = json.dumps(checkpoint)
    return {"metadata": {"name": "job-1-0", "annotations": annotations}, "status": {}}


def test_the_status_shows_the_last_eval_loss_and_the_step_it_was_measured_at() -> None:
    progress = observe.progress_of(
        [_pod({"step": 40, "totalSteps": 100, "evalLoss": 1.234567, "evalStep": 30})]
    )
    assert progress is not None and (progress.eval_loss, progress.eval_step) == (1.2346, 30)
    assert observe.progress_of([_pod({"step": 40, "totalSteps": 100})]).eval_loss is None  # type: ignore[union-attr]


def test_a_checkpoint_carries_the_eval_loss_of_its_weights_and_never_a_nan() -> None:
    checkpoint = {"step": 30, "path": "/checkpoints/checkpoint-30", "evalLoss": 1.5}
    found = observe.checkpoint_of([_pod(checkpoint=checkpoint)])
    assert found is not None and found.eval_loss == 1.5
    nan = observe.checkpoint_of([_pod(checkpoint=checkpoint | {"evalLoss": math.nan})])
    assert nan is not None and nan.eval_loss is None and nan.step == 30


def test_the_trainer_is_told_the_evaluation_as_the_spec_gives_it() -> None:
    from sftjob.config import JobRef
    from sftjob_operator import builders
    from sftjob_operator.planning import plan_candidates
    from sftjob_operator.scheduling import default_products

    spec = _spec(evaluation={"split": "test", "everySteps": 50})
    job = JobRef(namespace="ns", name="job", uid="u", attempt=1)
    config = builders.trainer_config(job, spec, plan_candidates(spec, default_products()).first)
    assert config.evaluation == EvaluationSettings(split="test", every_steps=50)
    plain = _spec()
    assert (
        builders.trainer_config(job, plain, plan_candidates(plain, default_products()).first).evaluation
        is None
    )


def test_the_last_eval_loss_stays_in_the_status_while_a_restarted_trainer_sets_up() -> None:
    from datetime import timedelta

    from sftjob_operator.reconcile import reconcile
    from tests.unit.reconcile_cases import CTX, NOW, observed, pod, then

    obs = observed()
    first = reconcile(obs, CTX)
    evaluated = {"step": 40, "totalSteps": 100, "loss": 1.1, "evalLoss": 1.5, "evalStep": 40}
    seen = reconcile(
        then(obs, first, pods=[pod(annotations={ANNOTATION_PROGRESS: json.dumps(evaluated)})]), CTX
    )
    assert seen.status.progress is not None and seen.status.progress.eval_loss == 1.5
    setup = {"step": 40, "totalSteps": 100, "phase": "data ready"}  # a new trainer's first report
    later = then(
        obs,
        seen,
        pods=[pod(annotations={ANNOTATION_PROGRESS: json.dumps(setup)})],
        now=NOW + timedelta(minutes=2),
    )
    progress = reconcile(later, CTX).status.progress
    assert progress is not None and (progress.eval_loss, progress.eval_step) == (1.5, 40)


def test_early_stopping_and_the_best_model_are_off_unless_asked_for_and_patience_is_required() -> None:
    settings = _spec(evaluation={"fraction": 0.02}).evaluation
    assert settings is not None and settings.final_model == "Last" and settings.early_stopping is None
    chosen = _spec(evaluation={"fraction": 0.02, "finalModel": "Best", "earlyStopping": {"patience": 3}})
    assert chosen.evaluation is not None and chosen.evaluation.early_stopping is not None
    assert chosen.evaluation.early_stopping.min_delta == 0.0
    for bad, words in [
        ({"earlyStopping": {}}, "patience"),
        ({"earlyStopping": {"patience": 0}}, "greater than or equal to 1"),
        ({"earlyStopping": {"patience": 2, "minDelta": -0.1}}, "greater than or equal to 0"),
        ({"finalModel": "best"}, "'Last' or 'Best'"),
    ]:
        with pytest.raises(ValidationError, match=words):
            _spec(evaluation={"fraction": 0.02} | bad)


def test_the_status_keeps_the_best_checkpoint_the_newest_report_names() -> None:
    from sftjob_operator.reconcile import reconcile
    from tests.unit.reconcile_cases import CTX, observed, pod, then

    best = {"step": 20, "path": "/checkpoints/checkpoint-20", "evalLoss": 0.9}
    newest = {"step": 40, "path": "/checkpoints/checkpoint-40", "evalLoss": 1.2, "best": best}
    obs = observed()
    first = reconcile(obs, CTX)
    seen = reconcile(
        then(obs, first, pods=[pod(annotations={ANNOTATION_CHECKPOINT: json.dumps(newest)})]), CTX
    )
    assert seen.status.best_checkpoint is not None
    assert (seen.status.best_checkpoint.step, seen.status.best_checkpoint.eval_loss) == (20, 0.9)
    assert seen.status.last_checkpoint is not None and seen.status.last_checkpoint.step == 40
    nan = observe.best_checkpoint_of([_pod(checkpoint=newest | {"best": best | {"evalLoss": math.nan}})])
    assert nan is None


def test_a_job_that_stopped_early_says_so_when_it_succeeds() -> None:
    from sftjob.job_status import ProgressStatus, SFTJobStatus
    from sftjob_operator.status_draft import StatusDraft
    from tests.unit.reconcile_cases import NOW

    report = {"step": 300, "totalSteps": 300, "plannedSteps": 1000, "phase": "stopped early"}
    progress = observe.progress_of([_pod(report)])
    assert progress is not None and progress.planned_steps == 1000
    draft = StatusDraft(SFTJobStatus(progress=progress), generation=1, now=NOW)
    draft.succeeded(2)
    succeeded = next(c for c in draft.status.conditions if c.type == "Succeeded")
    assert succeeded.status == "True" and "stopped early at step 300 of 1000" in succeeded.message
    status = SFTJobStatus(progress=ProgressStatus(step=1000, total_steps=1000))
    plain = StatusDraft(status, generation=1, now=NOW)
    plain.succeeded(2)
    assert "early" not in next(c for c in plain.status.conditions if c.type == "Succeeded").message
