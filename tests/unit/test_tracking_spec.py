"""spec.tracking: what the spec accepts, what the trainer is told (no credentials) and what the pods get."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob.config import MlflowSettings, TrackingSettings, TrainerConfig, WandbSettings
from sftjob.spec import SFTJobSpec
from sftjob_operator import builders
from sftjob_operator.planning import CandidatePlans, plan_candidates
from sftjob_operator.scheduling import default_products
from tests.unit.test_builders import JOB, env_of, fake_plan, pod, spec

TENSORBOARD_DIR = f"{c.CHECKPOINT_MOUNT}/{c.TENSORBOARD_FOLDER}"
MLFLOW = {"trackingUri": "https://mlflow.example.com", "tokenSecretRef": {"name": "mlflow", "key": "token"}}
WANDB = {"project": "support-bot", "entity": "my-team", "apiKeySecretRef": {"name": "wandb", "key": "apiKey"}}


def config_of(s: SFTJobSpec) -> TrainerConfig:
    data = builders.config_map(JOB, s, _plans(s))["data"]
    return TrainerConfig.model_validate_json(data[c.CONFIG_FILE])


def _plans(s: SFTJobSpec) -> CandidatePlans:
    return plan_candidates(s, default_products(), fake_plan)


def test_a_job_without_tracking_tells_the_trainer_of_no_tracker_and_sets_no_tracker_environment() -> None:
    s = spec()
    assert config_of(s).tracking == TrackingSettings()
    assert not config_of(s).tracking.enabled
    env = env_of(pod(s))
    assert not {name for name in env if name.startswith(("WANDB_", "MLFLOW_"))}


def test_tensorboard_writes_to_the_checkpoint_volumes_tensorboard_folder() -> None:
    tracking = config_of(spec(tracking={"tensorboard": True})).tracking
    assert tracking == TrackingSettings(tensorboard_dir=TENSORBOARD_DIR)
    assert tracking.enabled


def test_the_trainer_config_names_the_trackers_but_holds_no_secret_reference() -> None:
    s = spec(tracking={"mlflow": MLFLOW | {"experiment": "chat models"}, "wandb": WANDB})
    tracking = config_of(s).tracking
    assert tracking.mlflow == MlflowSettings(
        tracking_uri="https://mlflow.example.com", experiment="chat models"
    )
    assert tracking.wandb == WandbSettings(project="support-bot", entity="my-team")
    rendered = json.loads(builders.config_map(JOB, s, _plans(s))["data"][c.CONFIG_FILE])
    assert rendered["tracking"] == {
        "tensorboard_dir": None,
        "mlflow": {"tracking_uri": "https://mlflow.example.com", "experiment": "chat models"},
        "wandb": {"project": "support-bot", "entity": "my-team"},
    }


def test_tracker_credentials_reach_the_trainer_as_the_environment_its_libraries_read() -> None:
    s = spec(
        tracking={"mlflow": MLFLOW, "wandb": WANDB}, env=[{"name": "WANDB_BASE_URL", "value": "https://w"}]
    )
    env = env_of(pod(s))
    assert env["MLFLOW_TRACKING_TOKEN"] == {"secretKeyRef": {"name": "mlflow", "key": "token"}}
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "apiKey"}}
    assert env["WANDB_DIR"] == c.SCRATCH_MOUNT  # writable: the image's own folders are not
    assert env["WANDB_BASE_URL"] == "https://w"
    assert "MLFLOW_TRACKING_USERNAME" not in env and "MLFLOW_TRACKING_PASSWORD" not in env


def test_mlflow_basic_auth_takes_a_user_name_and_a_password_from_a_secret() -> None:
    mlflow = {"trackingUri": "http://mlflow.mlops:5000", "username": "ci", "passwordSecretRef": {"name": "m"}}
    env = env_of(pod(spec(tracking={"mlflow": mlflow})))
    assert env["MLFLOW_TRACKING_USERNAME"] == "ci"
    assert env["MLFLOW_TRACKING_PASSWORD"] == {"secretKeyRef": {"name": "m", "key": "token"}}
    assert "MLFLOW_TRACKING_TOKEN" not in env


@pytest.mark.parametrize(
    ("tracking", "words"),
    [
        ({"mlflow": {"trackingUri": "mlflow.mlops:5000"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "file:///tmp/mlruns"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "http://"}}, "should match pattern"),
        (
            {"mlflow": {"trackingUri": "http://m", "username": "ci"}},
            "username and passwordSecretRef go together",
        ),
        (
            {"mlflow": {"trackingUri": "http://m", "passwordSecretRef": {"name": "m"}}},
            "username and passwordSecretRef go together",
        ),
        (
            {"mlflow": MLFLOW | {"username": "ci", "passwordSecretRef": {"name": "m"}}},
            "tokenSecretRef or username with passwordSecretRef, not both",
        ),
        ({"mlflow": {"trackingUri": "http://m", "experiment": "a\nb"}}, "should match pattern"),
        ({"wandb": {"project": "org/project"}}, "should match pattern"),
        ({"wandb": {"project": "p", "entity": "my team"}}, "should match pattern"),
        ({"wandb": {"entity": "my-team"}}, "Field required"),
        ({"wandb": {"project": "p", "apiKey": "secret!"}}, "Extra inputs are not permitted"),
    ],
)
def test_a_bad_tracking_block_is_refused_with_the_reason(tracking: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        spec(tracking=tracking)


def test_the_output_may_not_be_the_tensorboard_folder_of_the_checkpoint_volume() -> None:
    with pytest.raises(ValidationError, match="tensorboard"):
        spec(output={"path": "tensorboard"})
    with pytest.raises(ValidationError, match="tensorboard"):
        spec(output={"path": "./tensorboard/final"})
    assert spec(output={"path": "tensorboard-final"}).output.path == "tensorboard-final"
    assert spec(output={"path": "tensorboard", "volume": {"persistentVolumeClaim": {"claimName": "out"}}})


def test_the_tracking_block_round_trips_in_camel_case() -> None:
    s = spec(tracking={"tensorboard": True, "mlflow": MLFLOW, "wandb": WANDB})
    body = json.loads(s.model_dump_json(by_alias=True, exclude_none=True))["tracking"]
    assert body == {"tensorboard": True, "mlflow": MLFLOW, "wandb": WANDB}
