"""A hub model is trained on at one commit, the one its checkpoints record: a resume after the hub's
``main`` moved on goes on with the base it was trained on, and the adapter names that commit. The hub is
a cache folder of two commits of a tiny model (offline, as every trainer test)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file

from sftjob.config import ModelSource
from sftjob.failures import ExitCode
from sftjob_trainer import model, train
from sftjob_trainer.checkpoints import STATE_FILE, checkpoint_dirs
from sftjob_trainer.tiny import make_tiny_model
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

NAME = "org/tiny"
COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20
# trainer_config overrides: the tiny model from the hub, not its folder; two steps, a checkpoint of both.
HUB_MODEL: dict[str, Any] = {
    "model": {"name": NAME, "path": None},
    "training": {"maxSteps": 2},
    "checkpoints": {"everySteps": 2},
}


@pytest.fixture(scope="module")
def hub_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding ``org/tiny`` at two commits of different weights, ``main`` at the first."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--org--tiny"
    make_tiny_model(repo / "snapshots" / COMMIT_A, seed=0)
    make_tiny_model(repo / "snapshots" / COMMIT_B, seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_A)
    return cache


@pytest.fixture
def hub(hub_files: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's copy of the hub cache, the one the trainer reads (the repo's folder returned)."""
    home = tmp_path / "hf-home"
    shutil.copytree(hub_files, home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))  # preflight checks it is writable
    # Both read at each call; HF_HUB_OFFLINE only at import, which may precede the conftest's setting it.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub" / "models--org--tiny"


def _newest_state(config: Path) -> dict[str, Any]:
    root = Path(json.loads(config.read_text())["checkpoints"]["dir"])
    return dict(json.loads((max(checkpoint_dirs(root))[1] / STATE_FILE).read_text()))


def _output(config: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((Path(json.loads(config.read_text())["outputDir"]) / name).read_text()))


def _set_max_steps(config: Path, steps: int, revision: str | None = None) -> None:
    settings = json.loads(config.read_text())
    settings["training"]["maxSteps"] = steps
    settings["model"]["revision"] = revision
    config.write_text(json.dumps(settings))


def _base_weights(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """The weights of each base model the trainer loads from now on, as loaded."""
    loaded: list[dict[str, torch.Tensor]] = []
    load = train.load_model

    def spy(*args: Any, **kwargs: Any) -> Any:
        model = load(*args, **kwargs)
        loaded.append({key: value.detach().clone() for key, value in model.state_dict().items()})
        return model

    monkeypatch.setattr(train, "load_model", spy)
    return loaded


def _weights_of(snapshot: Path, loaded: dict[str, torch.Tensor]) -> bool:
    saved = load_file(snapshot / "model.safetensors")
    return all(torch.equal(loaded[key], tensor) for key, tensor in saved.items())


def test_a_first_attempt_trains_on_the_commit_main_points_at_and_names_it_in_its_checkpoints_and_adapter(
    trainer_config: MakeConfig, hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sftjob_trainer")
    config = trainer_config("text", **HUB_MODEL)

    assert train.run(str(config)) == ExitCode.OK

    state = _newest_state(config)
    assert state["model_commit"] == COMMIT_A
    assert state["identity"]["model.revision"] is None  # the spec's, what names the training
    assert _output(config, "adapter_config.json")["revision"] == COMMIT_A
    assert f"loading commit {COMMIT_A} of {NAME} (model.revision unset)" in caplog.text


def test_a_resume_after_main_moved_on_trains_on_the_commit_its_checkpoints_were_trained_on(
    trainer_config: MakeConfig, hub: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config("text", **HUB_MODEL)
    assert train.run(str(config)) == ExitCode.OK
    (hub / "refs" / "main").write_text(COMMIT_B)
    _set_max_steps(config, 4)
    caplog.set_level(logging.INFO, logger="sftjob_trainer")
    bases = _base_weights(monkeypatch)

    assert train.run(str(config)) == ExitCode.OK

    assert _output(config, "summary.json")["resumedFromStep"] == 2
    assert f"resuming on commit {COMMIT_A} of {NAME}, the one its checkpoints were trained on" in caplog.text
    [base] = bases
    assert _weights_of(hub / "snapshots" / COMMIT_A, base)
    assert not _weights_of(hub / "snapshots" / COMMIT_B, base)
    assert _newest_state(config)["model_commit"] == COMMIT_A
    assert _output(config, "adapter_config.json")["revision"] == COMMIT_A


def test_a_resume_whose_spec_now_pins_another_revision_trains_on_that_one(
    trainer_config: MakeConfig, hub: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = trainer_config("text", **HUB_MODEL)
    assert train.run(str(config)) == ExitCode.OK
    _set_max_steps(config, 4, revision=COMMIT_B)
    bases = _base_weights(monkeypatch)

    assert train.run(str(config)) == ExitCode.OK  # a revision pinned: the same training, with a warning

    assert "at a revision pinned or unpinned" in caplog.text and "resuming on commit" not in caplog.text
    [base] = bases
    assert _weights_of(hub / "snapshots" / COMMIT_B, base)
    assert _newest_state(config)["model_commit"] == COMMIT_B
    assert _output(config, "adapter_config.json")["revision"] == COMMIT_B


def test_a_model_path_run_records_no_commit(trainer_config: MakeConfig, tiny_model: Path) -> None:
    config = trainer_config("text", training={"maxSteps": 2}, checkpoints={"everySteps": 2})

    assert train.run(str(config)) == ExitCode.OK

    assert _newest_state(config)["model_commit"] is None
    adapter = _output(config, "adapter_config.json")
    assert adapter["revision"] is None and adapter["base_model_name_or_path"] == str(tiny_model)


def test_a_recorded_commit_gone_from_the_hub_fails_naming_it_and_the_way_on() -> None:
    from huggingface_hub.errors import RevisionNotFoundError
    from huggingface_hub.utils import httpx

    url = f"https://huggingface.co/api/models/{NAME}/revision/{COMMIT_A}"
    response = httpx.Response(404, request=httpx.Request("GET", url))
    gone = OSError(f"{COMMIT_A} is not a valid git identifier (branch name, tag name or commit id)")
    gone.__cause__ = RevisionNotFoundError("404 Client Error: Revision Not Found", response=response)
    error = model._load_error("tokenizer", ModelSource(name=NAME, revision=COMMIT_A), gone)
    assert error.code == ExitCode.MODEL_LOAD_ERROR
    recorded = f"commit {COMMIT_A}: unless model.revision names it, the commit the job's checkpoints"
    assert recorded in error.reason
    assert "set model.revision to a commit or tag the repo has" in error.reason
    branch = model._load_error("tokenizer", ModelSource(name=NAME, revision="v2"), gone)
    assert "checkpoints" not in branch.reason  # a revision the spec names, not a recorded commit


@pytest.mark.parametrize(
    ("auto_map", "pinned"),
    [
        ("modeling_tiny.TinyForCausalLM", True),  # the model's own repo
        (f"{NAME}--modeling_tiny.TinyForCausalLM", True),
        ("mosaicml/mpt-7b--modeling_mpt.MPTForCausalLM", False),  # another repo's code: read at its main
    ],
)
def test_remote_code_is_read_at_the_models_commit_only_when_it_lives_in_the_models_repo(
    auto_map: str, pinned: bool
) -> None:
    from transformers import PretrainedConfig

    source = ModelSource(name=NAME, revision=COMMIT_A, trust_remote_code=True)
    config = PretrainedConfig(auto_map={"AutoModelForCausalLM": auto_map})
    assert model._code_revision(source, config) == ({"code_revision": COMMIT_A} if pinned else {})
