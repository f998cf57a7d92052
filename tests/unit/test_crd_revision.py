"""The SFTJob CRD carries its schema revision, bumped with every schema change, and the operator checks
the CRD in the cluster at start: one older than its own (an upgrade that skipped it) is an ERROR naming
both revisions and the command that updates it; a read it may not make never stops it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError

from sftjob import constants as c
from sftjob_operator import main

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "sftjob.io_sftjobs.yaml").read_text())
# The schema (descriptions left out) of each revision. A schema change fails the test below: bump
# CRD_SCHEMA_REVISION and the CRD's annotation, and record the new digest here.
SCHEMA_DIGESTS = {
    1: "8069152b7879d11a42e428e305976b57742ef003521a2b1427a2693675c540cc",
    2: "1e5271c30789abbc0e187ed333608fba4c32212e6053fcb1b27c15e9cbc5a2f1",
    3: "ccc44b79ba8540faf725e852de8482328554ca172e74e05d32c287682ec4ebef",
    4: "b07271331f59aba8887299503d36fe5f82b02eb38bf83bdf17a65cac643e84ed",
    5: "6bf6a6ca75bcf688aeb5c05c3df2492f54291dbced4c623986a9511da7a4c76b",
    6: "bf2e400da239e45df58e9d964ab65326d754c062e9f49f9de7a493ad2b1da233",
}


def schema_digest(crd: dict[str, Any]) -> str:
    def bare(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: bare(v) for k, v in node.items() if k != "description"}
        if isinstance(node, list):
            return [bare(v) for v in node]
        return node

    versions = [
        {k: v for k, v in ver.items() if k != "additionalPrinterColumns"} for ver in crd["spec"]["versions"]
    ]
    return hashlib.sha256(json.dumps(bare(versions), sort_keys=True).encode()).hexdigest()


def annotated(revision: str | None) -> dict[str, Any]:
    annotations = {} if revision is None else {c.ANNOTATION_SCHEMA_REVISION: revision}
    return {"metadata": {"name": main.CRD_NAME, "annotations": annotations}}


def test_the_published_crd_carries_this_operators_schema_revision() -> None:
    assert CRD["metadata"]["annotations"][c.ANNOTATION_SCHEMA_REVISION] == str(c.CRD_SCHEMA_REVISION)


def test_a_schema_change_comes_with_a_new_schema_revision() -> None:
    digest = schema_digest(CRD)
    assert SCHEMA_DIGESTS.get(c.CRD_SCHEMA_REVISION) == digest, (
        "the CRD's schema changed: bump CRD_SCHEMA_REVISION (sftjob/constants.py) and the CRD's"
        f" {c.ANNOTATION_SCHEMA_REVISION} annotation, and record {digest!r} for it in SCHEMA_DIGESTS"
    )


def test_the_operators_own_revision_is_not_reported() -> None:
    assert main.crd_problem(annotated(str(c.CRD_SCHEMA_REVISION))) is None


@pytest.mark.parametrize("revision", [None, "0", "not-a-number"])
def test_an_older_crd_is_an_error_naming_both_revisions_and_the_command_that_updates_it(
    revision: str | None,
) -> None:
    problem = main.crd_problem(annotated(revision))
    assert problem is not None
    level, message = problem
    assert level == logging.ERROR
    assert f"schema revision 0 ({c.ANNOTATION_SCHEMA_REVISION}), older than this operator's" in message
    assert f"operator's {c.CRD_SCHEMA_REVISION}:" in message
    assert "kubectl apply --server-side -f crds/sftjob.io_sftjobs.yaml" in message


def test_a_newer_crd_is_a_warning_and_a_missing_one_an_error() -> None:
    newer = main.crd_problem(annotated(str(c.CRD_SCHEMA_REVISION + 1)))
    assert newer is not None and newer[0] == logging.WARNING and "newer than this operator's" in newer[1]
    missing = main.crd_problem(None)
    assert missing is not None and missing[0] == logging.ERROR and "is not installed" in missing[1]


class Response:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.data = json.dumps({"items": items}).encode()


class FakeApi:
    """``ApiextensionsV1Api`` answering ``list`` with ``answer`` (raised when an exception)."""

    answer: ClassVar[Any] = None
    asked: ClassVar[dict[str, Any]] = {}

    def __init__(self, api: Any) -> None:
        pass

    def list_custom_resource_definition(self, **kwargs: Any) -> Any:
        FakeApi.asked = kwargs
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> type[FakeApi]:
    monkeypatch.setattr(main.client, "ApiextensionsV1Api", FakeApi)
    return FakeApi


def test_the_operator_reads_the_crd_by_name_with_the_list_its_rbac_grants_and_logs_an_old_one(
    api: type[FakeApi], caplog: pytest.LogCaptureFixture
) -> None:
    api.answer = Response([annotated(None)])
    with caplog.at_level(logging.INFO, logger=main.__name__):
        main.check_crd(object())  # type: ignore[arg-type]
    assert api.asked["field_selector"] == "metadata.name=sftjobs.sftjob.io"
    assert [r.levelno for r in caplog.records] == [logging.ERROR]


@pytest.mark.parametrize(
    "failure",
    [ApiException(status=403, reason="Forbidden"), MaxRetryError(None, "/", "refused")],  # type: ignore[arg-type]
)
def test_a_crd_the_operator_cannot_read_is_a_warning_and_the_operator_starts(
    api: type[FakeApi], caplog: pytest.LogCaptureFixture, failure: Exception
) -> None:
    api.answer = failure
    with caplog.at_level(logging.INFO, logger=main.__name__):
        main.check_crd(object())  # type: ignore[arg-type]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "schema revision is unchecked" in caplog.records[0].getMessage()
