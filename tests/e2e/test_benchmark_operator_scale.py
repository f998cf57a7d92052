"""The operator-at-scale benchmark runs end to end in a reduced size and writes a well-formed result.

This checks the harness (its own control planes, the operator subprocess, the floor's Jobs, the pod
watch, the API server and /proc readings, the JSON and Markdown), never the performance figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sftjob_dev.cluster import Cluster

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "operator_scale.py"
STAGES = (10, 20)
PROBE = 4
TIMEOUT = 600


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("operator-scale")
    argv = [
        sys.executable, str(SCRIPT), "--nodes", "20", "--jobs", ",".join(map(str, STAGES)), "--rate", "20",
        "--steady-seconds", "2", "--probe", str(PROBE), "--probe-rate", "8", "--settle-timeout", "90",
        "--out", str(out), "--name", "ci", "--run-dir", str(out),
    ]  # fmt: skip
    # A session of its own: on a timeout (or an interruption) its whole group, the benchmark and its
    # operator, is killed; the control planes it started run in sessions of their own, and its `finally`
    # that stops them never ran, so every one left in `out` is stopped here.
    run = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = run.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        stdout, stderr = run.communicate()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        for leftover in out.glob("sftjob-bench-*"):
            Cluster(leftover).down(quiet=True)
    assert run.returncode == 0, f"the benchmark failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert (out / "ci.md").read_text().startswith("# Operator at scale")
    return dict(json.loads((out / "ci.json").read_text()))


def test_result_records_the_machine_versions_and_command(result: dict) -> None:
    assert result["machine"]["cores"] >= 1 and len(result["machine"]["loadAverage"]) == 3
    assert {"python", "kopf", "kubernetes", "controlPlane"} <= result["versions"].keys()
    assert result["command"].startswith("python benchmarks/operator_scale.py --nodes 20")


@pytest.mark.parametrize("subject", ["operator", "floor"])
def test_every_job_of_every_stage_gets_a_running_pod(result: dict, subject: str) -> None:
    stages = result["subjects"][subject]["stages"]
    assert [s["liveJobs"] for s in stages] == list(STAGES)
    for stage, created in zip(stages, (10, 10 - PROBE), strict=True):
        assert stage["createdJobs"] == created and stage["createErrors"] == 0
        for phase in ("createToPodCreated", "createToPodScheduled", "createToPodRunning", "createToReady"):
            latency = stage[phase]
            assert latency["missing"] == 0 and latency["n"] == created
            assert 0 <= latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]


@pytest.mark.parametrize("subject", ["operator", "floor"])
def test_a_probe_after_each_stage_measures_latency_with_the_stage_live(result: dict, subject: str) -> None:
    probes = [s["probe"] for s in result["subjects"][subject]["stages"]]
    assert [p["liveJobsBefore"] for p in probes] == list(STAGES)
    for probe in probes:
        assert probe["createdJobs"] == PROBE and probe["offeredRate"] == 8
        assert probe["createToPodCreated"]["missing"] == 0 and probe["createToReady"]["n"] == PROBE


@pytest.mark.parametrize("subject", ["operator", "floor"])
def test_controller_cost_and_api_requests_are_measured(result: dict, subject: str) -> None:
    for stage in result["subjects"][subject]["stages"]:
        assert stage["controller"]["cpuSeconds"] >= 0 and stage["controller"]["rssMiB"] > 0
        assert stage["apiRequestsPerJob"] > 0
        assert "POST pods" in stage["apiRequestsPerJobByVerb"]
        assert stage["steadyState"]["apiRequestsPerSecond"] >= 0


def test_operator_counters_targets_and_ratios_are_reported(result: dict) -> None:
    stage = result["subjects"]["operator"]["stages"][-1]
    assert stage["subjectCounters"]["sftjob_operator_pods_created_total"] == 10 - PROBE
    assert len(result["targets"]) == 5 and all(t["met"] in (True, False, None) for t in result["targets"])
    assert [r["liveJobs"] for r in result["ratios"]] == list(STAGES)
