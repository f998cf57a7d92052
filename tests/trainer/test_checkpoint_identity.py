"""Checkpoints record the training they belong to: a job created again under its name over another
training's checkpoints is refused before a tensor loads, naming each difference (not when the model or
dataset only moved to a volume or got a pinned revision), and checkpoints none of which fits the model stop
the run as a configuration error that blames what changed: the spec, the image's model code, or the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import checkpoint_loading, checkpoints, identity, ownership, resume
from sftjob_trainer.checkpoints import TrainState, checkpoint_dirs
from tests.trainer.checkpoint_cases import (
    ONE_PROCESS,
    attempt,
    bad,
    trainables,
    trainables_of_width,
    unloadable,
)

pytestmark = pytest.mark.trainer

TRAINED: dict[str, object] = {
    "model.name": "Qwen/Qwen2.5-7B",
    "model.path": None,
    "model.revision": None,
    "method": "lora",
    "lora.r": 16,
    "lora.targetModules": "all-linear",
}


def test_a_checkpoint_of_other_training_is_refused_before_its_tensors_load_naming_each_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    checkpoints.save(
        tmp_path, TrainState(step=4, identity=TRAINED), trainables(), ONE_PROCESS, keep=2, job=attempt(1)
    )
    monkeypatch.setattr(checkpoint_loading.dcp, "load", None)  # reading a tensor would fail the test
    now = TRAINED | {"model.name": "Qwen/Qwen2.5-7B-Instruct", "lora.r": 32}

    with pytest.raises(TrainerError) as refused:  # the job created again, with another base and lora.r
        resume.load_latest(tmp_path, trainables(), ONE_PROCESS, now)
    assert refused.value.code == ExitCode.CONFIG_ERROR
    reason = refused.value.reason
    assert "checkpoint-4" in reason and "is of other training than this job's spec" in reason
    assert "model.name was Qwen/Qwen2.5-7B, now Qwen/Qwen2.5-7B-Instruct" in reason
    assert "lora.r was 16, now 32" in reason and "method was" not in reason
    assert "another name" in reason and "delete or move the checkpoints" in reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4] and bad(tmp_path) == []


def test_only_fields_both_identities_record_are_compared_so_older_checkpoints_resume_as_before(
    tmp_path: Path,
) -> None:
    assert identity.compare({}, TRAINED) == ([], [], False)  # saved before checkpoints recorded it
    assert identity.compare(TRAINED | {"later.field": 1}, TRAINED) == ([], [], True)  # a newer trainer's
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    checkpoints.save(tmp_path, TrainState(step=4), trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    loaded = resume.load_latest(tmp_path, trainables(), ONE_PROCESS, TRAINED)
    assert loaded is not None and loaded.state.step == 4


def _config(**changes: object) -> TrainerConfig:
    settings: dict[str, object] = {
        "model": {"name": "Qwen/Qwen2.5-7B"},
        "dataset": {"path": "/data/train.jsonl"},
        "lora": {"r": 16, "targetModules": ["v_proj", "q_proj"]},
        "training": {"globalBatchSize": 8, "gradientAccumulationSteps": 8},
    }
    return TrainerConfig.model_validate(settings | changes)


def test_the_identity_of_training_leaves_out_what_may_change_over_kept_checkpoints() -> None:
    trained = identity.identity(_config())
    replanned = _config(
        training={
            "globalBatchSize": 32,
            "microBatchSize": 2,
            "gradientAccumulationSteps": 2,
            "maxSteps": 500,
            "learningRate": 1e-5,
            "weightDecay": 0.1,
            "gradientCheckpointing": True,
            "packingLength": 512,
        },
        distributed={"nprocPerNode": 8, "sharding": "fsdp"},
        lora={"r": 16, "targetModules": ["q_proj", "v_proj"], "dropout": 0.2},
    )
    assert identity.identity(replanned) == trained
    assert identity.compare(trained, identity.identity(_config(dataset={"path": "/data/v2.jsonl"}))).other
    full = identity.identity(_config(method="full"))
    assert "lora.r" not in full and identity.compare(trained, full).other == ["method was lora, now full"]


# A LoRA of a hub model on a hub dataset, neither pinned.
FROM_THE_HUB: dict[str, object] = TRAINED | {
    "dataset.name": "org/chats",
    "dataset.path": None,
    "dataset.revision": None,
    "dataset.split": "train",
    "dataset.format": "auto",
}
ON_A_VOLUME = {"model.name": None, "model.path": "/model/qwen2.5-7b"}


def test_a_source_moved_to_a_volume_or_a_revision_pinned_is_no_evidence_of_other_training() -> None:
    moved = identity.compare(FROM_THE_HUB, FROM_THE_HUB | ON_A_VOLUME)  # a NetworkError's advice
    assert moved.other == [] and not moved.same
    assert moved.moved == [
        "model.name was Qwen/Qwen2.5-7B, now unset",
        "model.path was unset, now /model/qwen2.5-7b",
    ]
    to_a_file = FROM_THE_HUB | {"dataset.name": None, "dataset.path": "/data/chats.jsonl"}
    assert identity.compare(FROM_THE_HUB, to_a_file).other == []
    pinned = identity.compare(FROM_THE_HUB, FROM_THE_HUB | {"dataset.revision": "0123abc"})  # a DataError's
    assert pinned == ([], ["dataset.revision was unset, now 0123abc"], False)
    main, commit = FROM_THE_HUB | {"model.revision": "main"}, FROM_THE_HUB | {"model.revision": "9f2e"}
    assert identity.compare(main, commit).other == []  # main is the default branch, as unset is
    assert identity.compare(FROM_THE_HUB, main) == ([], [], True)


@pytest.mark.parametrize(
    ("was", "now", "named"),
    [
        ({}, {"model.name": "Qwen/Qwen2.5-7B-Instruct"}, "model.name was Qwen/Qwen2.5-7B, now Qwen"),
        (ON_A_VOLUME, {"model.path": "/model/llama"}, "model.path was /model/qwen2.5-7b"),
        ({}, {"dataset.name": "org/other"}, "dataset.name was org/chats"),
        ({"model.revision": "v1"}, {"model.revision": "v2"}, "model.revision was v1, now v2"),
        ({"dataset.revision": "0123abc"}, {"dataset.revision": "4567def"}, "dataset.revision was 0123abc"),
        ({}, {"dataset.split": "test"}, "dataset.split was train, now test"),
        ({}, {"dataset.format": "text"}, "dataset.format was auto, now text"),
        ({}, {"method": "qlora"}, "method was lora, now qlora"),
        ({}, {"lora.targetModules": ["q_proj"]}, 'lora.targetModules was all-linear, now ["q_proj"]'),
    ],
)
def test_another_source_two_set_revisions_or_another_method_adapter_or_split_is_other_training(
    was: dict[str, object], now: dict[str, object], named: str
) -> None:
    found = identity.compare(FROM_THE_HUB | was, FROM_THE_HUB | was | now)
    assert found.moved == [] and len(found.other) == 1 and found.other[0].startswith(named)


def test_a_job_recreated_with_its_model_on_a_volume_resumes_the_hub_models_checkpoints_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    state = TrainState(step=4, identity=FROM_THE_HUB)
    checkpoints.save(tmp_path, state, trainables(), ONE_PROCESS, keep=2, job=attempt(1))
    now = FROM_THE_HUB | ON_A_VOLUME | {"dataset.revision": "0123abc"}
    loaded = resume.load_latest(tmp_path, trainables(), ONE_PROCESS, now)
    assert loaded is not None and loaded.state.step == 4
    assert "resuming it as the same training" in caplog.text
    assert "model.path was unset, now /model/qwen2.5-7b" in caplog.text
    assert "dataset.revision was unset, now 0123abc" in caplog.text


def _saved_as(width: int, root: Path, step: int, **recorded: Any) -> None:
    """A checkpoint of step ``step`` of a ``width``-wide layer (an adapter of lora.r ``width``, say), its
    state recording ``recorded`` besides."""
    parts = trainables_of_width(width)
    checkpoints.save(root, TrainState(step=step, **recorded), parts, ONE_PROCESS, keep=3, job=attempt(1))


def test_checkpoints_none_of_which_fits_the_model_stop_the_run_as_a_config_error_not_a_storage_error(
    tmp_path: Path,
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (2, 4):
        _saved_as(2, tmp_path, step)  # as lora.r 2, say, resumed below with 3

    with pytest.raises(TrainerError) as stopped:
        resume.load_latest(tmp_path, trainables_of_width(3), ONE_PROCESS)
    assert stopped.value.code == ExitCode.CONFIG_ERROR
    reason = stopped.value.reason
    assert "no checkpoint in" in reason and "fits this model (checkpoint-4, checkpoint-2;" in reason
    assert "model.weight is [2, 4] in it, [3, 4] here" in reason
    assert "trained with other settings than the spec asks for now" in reason and "another name" in reason
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [4, 2] and bad(tmp_path) == []


THIS_IMAGE = {"transformers": "5.23.0", "peft": "0.18.0"}


@pytest.mark.parametrize(
    ("saved_with", "said"),
    [
        (
            {"transformers": "4.57.1", "peft": "0.18.0"},
            "they were saved with transformers 4.57.1 (this image has 5.23.0), whose code names or shapes",
        ),
        ({}, "another transformers or peft version than the image that saved them"),
        (THIS_IMAGE, "the model changed where the spec reads it"),
    ],
)
def test_checkpoints_of_this_jobs_training_that_do_not_fit_blame_the_image_or_the_model_not_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_with: dict[str, str], said: str
) -> None:
    monkeypatch.setattr(resume, "model_code", lambda: THIS_IMAGE)
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    for step in (2, 4):
        _saved_as(2, tmp_path, step, identity=FROM_THE_HUB, versions=saved_with)

    with pytest.raises(TrainerError) as stopped:  # the same spec, and another image's model code
        resume.load_latest(tmp_path, trainables_of_width(3), ONE_PROCESS, FROM_THE_HUB)
    assert stopped.value.code == ExitCode.CONFIG_ERROR
    reason = stopped.value.reason
    assert "fits this model (checkpoint-4, checkpoint-2;" in reason and said in reason
    assert "model.weight is [2, 4] in it, [3, 4] here" in reason
    assert "other settings than the spec" not in reason and "another name" in reason
    if saved_with != THIS_IMAGE:
        assert "do not fit this trainer image's model code" in reason and "spec.image" in reason


def test_checkpoints_that_do_not_fit_a_model_moved_to_a_volume_name_the_move(tmp_path: Path) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    _saved_as(2, tmp_path, 2, identity=FROM_THE_HUB)

    with pytest.raises(TrainerError) as stopped:  # another model at the path the job was given
        resume.load_latest(tmp_path, trainables_of_width(3), ONE_PROCESS, FROM_THE_HUB | ON_A_VOLUME)
    assert stopped.value.code == ExitCode.CONFIG_ERROR
    reason = stopped.value.reason
    assert "is not the one the spec reads now (model.name was Qwen/Qwen2.5-7B, now unset;" in reason
    assert "the source they were trained with" in reason


def test_checkpoints_that_do_not_fit_beside_ones_whose_files_are_broken_stop_the_run_as_a_storage_error(
    tmp_path: Path,
) -> None:
    ownership.take_over(tmp_path, attempt(1), ONE_PROCESS)
    _saved_as(3, tmp_path, 2)
    _saved_as(2, tmp_path, 4)
    unloadable(tmp_path / "checkpoint-2")

    with pytest.raises(TrainerError) as stopped:
        resume.load_latest(tmp_path, trainables_of_width(3), ONE_PROCESS)
    assert stopped.value.code == ExitCode.STORAGE_ERROR and "move them away" in stopped.value.reason
