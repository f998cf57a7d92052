"""Progress annotations: the contract's JSON, sent through the API client, and never fatal."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from sftjob.config import ReportSettings
from sftjob.constants import ANNOTATION_CHECKPOINT, ANNOTATION_PROGRESS
from sftjob_trainer.report import ProgressReporter

pytestmark = pytest.mark.trainer


class FakePods:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> None:
        if self.fail:
            raise ConnectionError("apiserver unreachable")
        self.patches.append((name, namespace, body))


def _reporter(monkeypatch: pytest.MonkeyPatch, api: FakePods) -> ProgressReporter:
    monkeypatch.setenv("POD_NAME", "job-0")
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    monkeypatch.setattr(ProgressReporter, "_connect", lambda self, enabled: api)
    return ProgressReporter(ReportSettings(interval_seconds=3600))


def test_progress_and_checkpoint_are_patched_onto_the_pod_as_contract_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = FakePods()
    reporter = _reporter(monkeypatch, api)
    reporter.progress(
        {
            "step": 5,
            "totalSteps": 10,
            "epoch": 0.5,
            "loss": 1.5,
            "learningRate": 1e-4,
            "tokensPerSecond": 900.0,
            "etaSeconds": 12.0,
        }
    )
    reporter.checkpoint(4, "/checkpoints/checkpoint-4")
    reporter.close()
    ((name, namespace, body),) = api.patches
    assert (name, namespace) == ("job-0", "team-a")
    progress = json.loads(body["metadata"]["annotations"][ANNOTATION_PROGRESS])
    assert progress["step"] == 5 and progress["updated"].endswith("Z")
    checkpoint = json.loads(body["metadata"]["annotations"][ANNOTATION_CHECKPOINT])
    assert checkpoint["step"] == 4 and checkpoint["path"] == "/checkpoints/checkpoint-4"


def test_a_failing_api_server_never_raises_and_the_report_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakePods(fail=True)
    reporter = _reporter(monkeypatch, api)
    reporter.checkpoint(2, "/c/checkpoint-2")
    reporter.flush()
    api.fail = False
    reporter.close()
    assert len(api.patches) == 1


def test_reporting_is_disabled_outside_a_pod(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    caplog.set_level(logging.INFO)
    reporter = ProgressReporter(ReportSettings())
    assert not reporter.enabled
    assert "POD_NAME is not set" in caplog.text
    reporter.progress({"step": 1})
    reporter.close()


def test_a_nan_loss_is_reported_as_null_in_valid_json(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakePods()
    reporter = _reporter(monkeypatch, api)
    reporter.progress({"step": 5, "loss": float("nan"), "tokensPerSecond": float("inf")})
    reporter.close()
    ((_, _, body),) = api.patches

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    progress = json.loads(body["metadata"]["annotations"][ANNOTATION_PROGRESS], parse_constant=refuse)
    assert (progress["step"], progress["loss"], progress["tokensPerSecond"]) == (5, None, None)
