"""spec.tracking: what the spec accepts, what the trainer is told (no credentials) and what the pods get."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob.cli import main
from sftjob.config import MlflowSettings, TrackingSettings, TrainerConfig, WandbSettings
from sftjob.job_status import SFTJobStatus, TrackingUrls
from sftjob.spec import SFTJobSpec
from sftjob.spec_rules import tensorboard_problem
from sftjob_operator import builders, observe
from sftjob_operator.planning import CandidatePlans, plan_candidates
from sftjob_operator.scheduling import default_products
from sftjob_operator.status_draft import StatusDraft
from tests.unit.reconcile_cases import NOW
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
    assert env["MLFLOW_TRACKING_TOKEN"] == {
        "secretKeyRef": {"name": "mlflow", "key": "token", "optional": True}
    }
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "apiKey", "optional": True}}
    assert env["WANDB_DIR"] == c.SCRATCH_MOUNT  # writable: the image's own folders are not
    assert env["WANDB_BASE_URL"] == "https://w"
    assert "MLFLOW_TRACKING_USERNAME" not in env and "MLFLOW_TRACKING_PASSWORD" not in env


def test_mlflow_basic_auth_takes_a_user_name_and_a_password_from_a_secret() -> None:
    mlflow = {"trackingUri": "http://mlflow.mlops:5000", "username": "ci", "passwordSecretRef": {"name": "m"}}
    env = env_of(pod(spec(tracking={"mlflow": mlflow})))
    assert env["MLFLOW_TRACKING_USERNAME"] == "ci"
    assert env["MLFLOW_TRACKING_PASSWORD"] == {
        "secretKeyRef": {"name": "m", "key": "token", "optional": True}
    }
    assert "MLFLOW_TRACKING_TOKEN" not in env


@pytest.mark.parametrize(
    ("tracking", "words"),
    [
        ({"mlflow": {"trackingUri": "mlflow.mlops:5000"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "file:///tmp/mlruns"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "http://"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "https://alice:s3cret@mlflow.example.com"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "https://alice@mlflow.example.com/"}}, "should match pattern"),
        ({"mlflow": {"trackingUri": "https://mlflow\x0b.example.com"}}, "should match pattern"),
        (
            {"mlflow": {"trackingUri": "http://m", "username": "c\ti", "passwordSecretRef": {"name": "m"}}},
            "should match pattern",
        ),
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
        ({"wandb": {"project": "p\x0b"}}, "should match pattern"),
        ({"wandb": {"entity": "my-team"}}, "Field required"),
        ({"wandb": {"project": "p", "apiKey": "secret!"}}, "Extra inputs are not permitted"),
    ],
)
def test_a_bad_tracking_block_is_refused_with_the_reason(tracking: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        spec(tracking=tracking)


def test_with_tensorboard_on_the_output_may_not_be_the_checkpoint_volumes_tensorboard_folder() -> None:
    tensorboard = {"tensorboard": True}
    for path in ("tensorboard", "./tensorboard/final"):
        problem = tensorboard_problem(spec(output={"path": path}, tracking=tensorboard))
        assert problem is not None and "tensorboard folder" in problem
        assert tensorboard_problem(spec(output={"path": path})) is None  # TensorBoard off: the folder is free
    assert tensorboard_problem(spec(output={"path": "tensorboard-final"}, tracking=tensorboard)) is None
    claim = {"persistentVolumeClaim": {"claimName": "out"}}
    assert (
        tensorboard_problem(spec(output={"path": "tensorboard", "volume": claim}, tracking=tensorboard))
        is None
    )


def test_the_tracking_block_round_trips_in_camel_case() -> None:
    s = spec(tracking={"tensorboard": True, "mlflow": MLFLOW, "wandb": WANDB})
    body = json.loads(s.model_dump_json(by_alias=True, exclude_none=True))["tracking"]
    assert body == {"tensorboard": True, "mlflow": MLFLOW, "wandb": WANDB}


def _reporting(progress: dict[str, Any]) -> dict[str, Any]:
    annotations = {c.ANNOTATION_PROGRESS: json.dumps(progress)}
    return {"metadata": {"name": "llama-3-0", "annotations": annotations}, "status": {"phase": "Running"}}


def test_the_status_links_the_runs_the_trainer_reports_and_drops_what_is_not_a_web_address() -> None:
    urls = {
        "mlflow": "https://mlflow.example.com/#/experiments/3/runs/abc",
        "wandb": "https://wandb.ai/my-team/support-bot/runs/uid-1",
    }
    progress = observe.progress_of([_reporting({"step": 3, "totalSteps": 9, "trackingUrls": urls})])
    assert progress is not None and progress.tracking_urls is not None
    assert progress.model_dump(by_alias=True, exclude_none=True)["trackingUrls"] == urls
    for bad in ("javascript:alert(1)", "https://a b", "https://" + "x" * 2048, 7):
        reported = {"step": 3, "trackingUrls": {"mlflow": bad, "tensorboard": "https://t"}}
        assert observe.progress_of([_reporting(reported)]).tracking_urls is None  # type: ignore[union-attr]
    assert observe.progress_of([_reporting({"step": 3, "trackingUrls": "x"})]).tracking_urls is None  # type: ignore[union-attr]


def test_a_tracking_uri_may_carry_a_port_and_a_path_but_no_query_nor_fragment() -> None:
    uri = "https://mlflow.example.com:8443/prefix/a@b/"
    assert spec(tracking={"mlflow": {"trackingUri": uri}}).tracking.mlflow.tracking_uri == uri  # type: ignore[union-attr]
    for bad in ("https://mlflow.example.com/prefix?token=s3cret", "https://mlflow.example.com/#x"):
        with pytest.raises(ValidationError, match="should match pattern"):
            spec(tracking={"mlflow": {"trackingUri": bad}})


def test_sftjob_plan_refuses_an_output_in_the_folder_tensorboard_writes_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.unit.test_cli import JOB

    job = tmp_path / "job.yaml"
    job.write_text(JOB + "  tracking: {tensorboard: true}\n  output: {path: tensorboard}\n")
    assert main(["plan", "-f", str(job)]) == 2
    assert (
        "spec.output.path 'tensorboard' is the checkpoint volume's tensorboard folder"
        in capsys.readouterr().err
    )
    job.write_text(JOB + "  tracking: {tensorboard: true, wandb: {project: p, apiKeySecretRef: {name: w}}}\n")
    assert main(["plan", "-f", str(job)]) == 0


def test_the_status_keeps_the_run_pages_through_reports_without_them_and_takes_newer_ones() -> None:
    wandb, mlflow = "https://wandb.ai/t/p/runs/uid-1", "https://mlflow.example.com/#/experiments/3/runs/abc"
    draft = StatusDraft(SFTJobStatus(), generation=1, now=NOW)
    draft.fold_reports([_reporting({"step": 40, "totalSteps": 90, "trackingUrls": {"wandb": wandb}})])
    draft.fold_reports([_reporting({"step": 40, "totalSteps": 90, "phase": "data ready"})])  # a restart
    assert draft.status.progress is not None and draft.status.progress.tracking_urls == TrackingUrls(
        wandb=wandb
    )
    draft.fold_reports(
        [_reporting({"step": 41, "trackingUrls": {"mlflow": mlflow, "wandb": wandb + "?v=2"}})]
    )
    assert draft.status.progress.tracking_urls == TrackingUrls(mlflow=mlflow, wandb=wandb + "?v=2")
    assert draft.status.progress.step == 41
