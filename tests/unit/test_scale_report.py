"""The operator-scale benchmark's verdicts: which stage and which latency each target is judged on."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

LATENCIES = ("createToPodCreated", "createToPodRunning", "createToReady")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("scale.report")


def latency(p99: float) -> dict[str, Any]:
    return {"n": 100, "p50": p99 / 2, "p95": p99, "p99": p99, "max": p99, "missing": 0}


def stage(live: int, burst_p99: float, probe_p99: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "liveJobs": live,
        "createdJobs": live,
        "jobsPerSecond": 60.0,
        "createToPodCreated": latency(burst_p99),
        "controller": {"rssMiB": 200.0},
        "apiRequestsPerJob": 10.0,
        "steadyState": {"apiRequestsPerSecond": 1.0, "apiRequestsPerLiveJobPerMinute": 60.0 / live},
    }
    if probe_p99 is not None:
        out["probe"] = {
            "liveJobsBefore": live,
            "createdJobs": 100,
            "offeredRate": 10.0,
            **{
                key: latency(probe_p99)
                for key in ("createToPodCreated", "createToPodRunning", "createToReady")
            },
        }
    return out


def test_the_latency_target_is_judged_on_the_probe_when_the_stage_has_one(report: ModuleType) -> None:
    first = report.targets([stage(100, 2.0, 0.2), stage(1000, 30.0, 0.4)])[0]
    assert first["target"].endswith("(probe, 10 jobs/s)")
    assert first["measured"] == "0.4 s" and first["met"] is True


def test_without_a_probe_the_latency_target_is_judged_on_the_burst(report: ModuleType) -> None:
    first = report.targets([stage(100, 2.0, None), stage(1000, 30.0, None)])[0]
    assert first["target"].endswith("(burst)")
    assert first["measured"] == "30.0 s" and first["met"] is False


def test_the_probe_table_shows_one_row_per_probed_stage(report: ModuleType) -> None:
    rows = report._probe_table([stage(100, 2.0, None), stage(1000, 30.0, 0.4)])
    assert [r.split("|")[1:3] for r in rows if r.startswith("| 1")] == [[" 1000 ", " 100 at 10 "]]


def test_idle_requests_are_judged_per_live_job_at_the_largest_stage(report: ModuleType) -> None:
    idle = report.targets([stage(100, 2.0, None), stage(5000, 30.0, None)])[-1]
    assert "per live job per minute" in idle["target"]
    assert idle["measured"] == "0.012" and idle["met"] is True
