"""The trainer config's schema version is read before anything else: an operator and a trainer image of
different contract versions (spec.image pinned across an operator upgrade) fail with a ConfigError that says
so, not with the first field one side does not know."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from sftjob.config import SCHEMA_VERSION, TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.configs import load_config
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

# TrainerConfig's JSON schema (without titles and descriptions) at SCHEMA_VERSION: when this test fails,
# the contract changed, so bump SCHEMA_VERSION and record the new fingerprint here.
CONTRACT = {
    2: "2a5301c41ac25b0d",
    3: "ec7a60fe97e98fb6",
    4: "607282f643f7b027",
    5: "110940c874be2980",
    6: "620d09b28e18f3b9",
}


def _shape(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _shape(v) for k, v in schema.items() if k not in ("title", "description")}
    if isinstance(schema, list):
        return [_shape(v) for v in schema]
    return schema


def test_a_change_to_the_trainer_config_contract_comes_with_a_new_schema_version() -> None:
    text = json.dumps(_shape(TrainerConfig.model_json_schema()), sort_keys=True)
    assert CONTRACT.get(SCHEMA_VERSION) == hashlib.sha256(text.encode()).hexdigest()[:16], (
        "TrainerConfig changed (or pydantic renders its schema differently):"
        " bump sftjob.config.SCHEMA_VERSION and CONTRACT here"
    )


@pytest.mark.parametrize("key", ["schema_version", "schemaVersion"])
def test_a_config_of_another_schema_version_is_a_config_error_naming_both_versions_and_every_image_setting(
    trainer_config: MakeConfig, key: str
) -> None:
    path = trainer_config()
    newer = json.loads(path.read_text()) | {key: SCHEMA_VERSION + 1, "aFieldFromTheFuture": True}
    path.write_text(json.dumps(newer))
    with pytest.raises(TrainerError) as raised:
        load_config(str(path))
    assert raised.value.code == ExitCode.CONFIG_ERROR
    assert raised.value.reason.startswith(
        f"the operator wrote trainer config schema {SCHEMA_VERSION + 1}, this trainer image reads"
        f" {SCHEMA_VERSION}: use the trainer image that matches the operator (spec.image"
    )
    assert "defaults.trainerImage" in raised.value.reason and "--image" in raised.value.reason


def test_an_attempt_given_an_older_operators_config_ends_with_the_version_skew_in_its_message(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    path = trainer_config()
    path.write_text(json.dumps(json.loads(path.read_text()) | {"schema_version": 1}))
    assert run(str(path)) == ExitCode.CONFIG_ERROR
    assert "[exit 10] the operator wrote trainer config schema 1" in termination_log.read_text()


def test_the_operators_config_of_this_version_loads(trainer_config: MakeConfig) -> None:
    path = trainer_config()
    written = TrainerConfig.load(str(path)).to_json()
    assert json.loads(written)["schema_version"] == SCHEMA_VERSION
    path.write_text(written)
    assert load_config(str(path)).schema_version == SCHEMA_VERSION
