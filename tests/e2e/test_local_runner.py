"""The local trainer runner: a fake-cluster pod backed by a real CPU trainer, driven by the real operator.

The operator plans the demo job (examples/demo/tiny-copy.yaml, a tiny Llama on a copy task),
creates its pod on a fake L40S node; the runner reads the injected config, runs the trainer as the
job's ServiceAccount, and ends the pod with the trainer's real exit code. A pod deleted under a running
trainer gets it SIGTERM (it saves a checkpoint); the pod the operator makes next resumes from there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import REPO, Jobs, wait_for

from sftjob_dev.cluster import Cluster
from sftjob_dev.runner import local_dir

pytestmark = [pytest.mark.e2e, pytest.mark.trainer]  # needs torch: see conftest.py

DEMO_JOB = REPO / "examples" / "demo" / "tiny-copy.yaml"


def demo_job(name: str, **training: Any) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(DEMO_JOB.read_text())
    job["metadata"]["name"] = name
    job["spec"]["training"].update(training)
    return job


def job_dir(cluster: Cluster, jobs: Jobs, name: str) -> Path:
    return local_dir(cluster.workdir) / jobs.namespace / name


def train_log(cluster: Cluster, jobs: Jobs, name: str) -> list[dict[str, Any]]:
    path = job_dir(cluster, jobs, name) / "checkpoints" / "final" / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def test_a_local_trainer_job_succeeds_showing_the_real_trainers_steps_and_loss(
    cluster: Cluster, jobs: Jobs, runner: Path
) -> None:
    jobs.apply(demo_job("tiny", maxSteps=60))
    status = jobs.wait_phase("tiny", "Succeeded", timeout=150)

    progress = status["progress"]
    assert progress["step"] == progress["totalSteps"] == 60
    assert math.isfinite(progress["loss"]) and progress["loss"] > 0
    losses = [r["loss"] for r in train_log(cluster, jobs, "tiny") if "loss" in r]
    assert progress["loss"] == pytest.approx(losses[-1], abs=1e-3)  # the operator keeps 4 decimals
    assert losses[-1] < losses[0] - 0.5, f"the copy task is learnable: loss should fall, got {losses}"
    summary = json.loads(
        (job_dir(cluster, jobs, "tiny") / "checkpoints" / "final" / "summary.json").read_text()
    )
    assert summary["steps"] == 60
    # The demo holds out 2% of its rows (spec.evaluation): their loss after the last step is in the status.
    assert (progress["evalStep"], progress["evalLoss"]) == (60, pytest.approx(summary["evalLoss"], abs=1e-4))
    for pod in jobs.pods("tiny"):
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert terminated["exitCode"] == 0
        assert terminated["message"].startswith("completed 60 steps")
    assert "reports as admin" not in runner.read_text(), "the trainer must report as its own ServiceAccount"


def test_a_deleted_pod_stops_its_trainer_with_a_checkpoint_and_the_next_attempt_resumes(
    cluster: Cluster, jobs: Jobs, runner: Path
) -> None:
    job = demo_job("resume", maxSteps=300)
    job["spec"]["checkpoints"]["everySteps"] = 1000  # only the SIGTERM checkpoint
    jobs.apply(job)
    wait_for(
        "the first trainer to pass step 50",
        lambda: max((r["step"] for r in train_log(cluster, jobs, "resume")), default=0) >= 50,
        timeout=90,
    )
    first = jobs.pods("resume")[0]["metadata"]["name"]
    jobs.kubectl("delete", "pod", first, "--wait=false")

    jobs.wait_phase("resume", "Succeeded", timeout=180)
    folder = job_dir(cluster, jobs, "resume")
    assert "exiting with PREEMPTED" in (folder / f"{first}.log").read_text()
    summary = json.loads((folder / "checkpoints" / "final" / "summary.json").read_text())
    assert summary["resumedFromStep"] >= 50
    assert summary["steps"] == 300
