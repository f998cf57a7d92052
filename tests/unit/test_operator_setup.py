"""How the operator is set up before it reconciles: its flags are checked, and kopf is told to have
the API server send it only trainer pods."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from sftjob import constants as c
from sftjob_operator import handlers
from sftjob_operator.main import parse_args
from sftjob_operator.workqueue import WorkQueue


@pytest.mark.parametrize("value", ["0", "-5", "0.5", "inf", "nan", "1e999"])
def test_a_resync_period_below_a_second_or_not_finite_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args([f"--resync-seconds={value}"])
    assert "--resync-seconds / SFTJOB_RESYNC_SECONDS must be a finite number of seconds >= 1" in (
        capsys.readouterr().err
    )


def test_a_resync_period_from_the_environment_is_checked_like_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SFTJOB_RESYNC_SECONDS", "0")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "SFTJOB_RESYNC_SECONDS" in capsys.readouterr().err
    monkeypatch.setenv("SFTJOB_RESYNC_SECONDS", "12.5")
    assert parse_args([]).resync_seconds == 12.5


def test_the_default_resync_period_is_the_handlers_one() -> None:
    assert parse_args([]).resync_seconds == handlers.RESYNC_SECONDS


def test_only_pods_with_the_job_label_are_listed_and_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers.Runtime, "queue", WorkQueue())
    monkeypatch.setattr(handlers.Runtime, "workers", [])
    settings = kopf.OperatorSettings()

    start: Any = handlers.configure  # kopf's decorators type them as its activity callbacks
    stop: Any = handlers.stop_workers

    async def start_and_stop() -> None:
        await start(settings=settings, sftjobs={}, trainer_pods={}, gpu_nodes={})
        await stop()

    asyncio.run(start_and_stop())
    selectors = settings.watching.label_selectors
    assert selectors.collect(kopf.Resource("", "v1", "pods")) == [c.LABEL_JOB]
    assert selectors.collect(kopf.Resource("metrics.k8s.io", "v1beta1", "pods")) == []
    assert selectors.collect(kopf.Resource("", "v1", "nodes")) == []
    assert selectors.collect(kopf.Resource(c.API_GROUP, c.API_VERSION, c.PLURAL)) == []
