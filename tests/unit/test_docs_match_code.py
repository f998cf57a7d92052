"""What users read states what the code does: the docs name the trainer config's schema version, every
GPU fault signature and every field the give-up messages advise changing, and `kubectl explain` tells a
multi-node job which claims its nodes can share and a model of its own code that packing is then off
unless asked for."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sftjob.config import SCHEMA_VERSION
from sftjob.failures import GPU_FAULT_PATTERN
from sftjob_operator.restarts import ADVICE, RECREATE

ROOT = Path(__file__).resolve().parents[2]


def words(path: str) -> str:
    """The file's text with its line breaks and runs of spaces as single spaces."""
    return " ".join((ROOT / path).read_text().split())


def you_column() -> dict[str, str]:
    """docs/failures.md's failure-class table: each class's "You" cell."""
    rows = re.findall(r"^\| `(\w+)` \|.*\| ([^|]*) \|$", (ROOT / "docs/failures.md").read_text(), re.M)
    return dict(rows)


def spec_property(*names: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "sftjob.io_sftjobs.yaml").read_text())
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for name in names:
        node = node["properties"][name]
    return dict(node)


def described(*names: str) -> str:
    return " ".join(spec_property(*names)["description"].split())


def test_api_md_names_the_trainer_config_schema_version_the_operator_writes() -> None:
    assert f"(`schema_version`, now {SCHEMA_VERSION})" in words("docs/api.md")


def test_failures_md_names_every_gpu_fault_signature_the_classifier_matches() -> None:
    text = words("docs/failures.md")
    for alternative in GPU_FAULT_PATTERN.split("|"):
        literal = re.sub(r"\\b", "", alternative).replace("[sz]", "z").replace(" ?", " ")
        assert f"`{literal}`" in text, alternative


def test_a_multi_node_jobs_volumes_say_which_access_modes_every_node_can_mount() -> None:
    assert "ReadWriteMany" in described("gpu", "nodes") and "ReadOnlyMany" in described("gpu", "nodes")
    for shared in (("checkpoints", "volume"), ("output", "volume")):
        assert "claim must be ReadWriteMany" in described(*shared)
    for read_only in (("model", "volume"), ("dataset", "volume")):
        assert "claim must be ReadOnlyMany or ReadWriteMany" in described(*read_only)


def test_trust_remote_code_says_packing_is_planned_off_unless_asked_for() -> None:
    assert "Packing is then planned off unless training.packing or training.packingLength asks for it" in (
        described("model", "trustRemoteCode")
    )


def test_failures_md_you_column_names_every_field_the_give_up_advice_names() -> None:
    you = you_column()
    for cls, advice in ADVICE.items():
        for field in re.findall(r"\b[a-z]\w*(?:\.[a-zA-Z]+)+", advice.replace(RECREATE, "")):
            assert field in you[cls.value], (cls, field)


def test_failures_md_says_to_recreate_the_job_wherever_the_give_up_advice_does() -> None:
    you = you_column()
    for cls in (cls for cls, advice in ADVICE.items() if RECREATE in advice):
        assert "delete the job and create it again" in you[cls.value], cls
