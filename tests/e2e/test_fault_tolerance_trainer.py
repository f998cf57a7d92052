"""The real trainer (a tiny model on the CPU, backed by the local trainer runner) killed mid-run and
restarted by the operator's decision: the new attempt resumes from the last complete checkpoint. A
SIGKILL loses the steps since that checkpoint (the attempt ends as Unknown, killed by SIGKILL); a
SIGTERM makes the trainer finish its step, save a checkpoint and exit Preempted, losing nothing.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import REPO, Jobs, wait_for

from sftjob import constants as c
from sftjob_dev.cluster import Cluster
from sftjob_dev.runner import local_dir

pytestmark = [pytest.mark.e2e, pytest.mark.trainer]  # needs torch: see conftest.py

DEMO_JOB = REPO / "examples" / "demo" / "tiny-copy.yaml"
EVERY_STEPS = 40
# Each test signals the first attempt once it passes its first checkpoint, which must be well before the
# run's end: the tiny model trains some 40 steps/s on an idle machine, so a few hundred steps leave a
# window of seconds even when the test's own polling is starved. The restarted attempt trains to the end.
KILLED_STEPS = 320
TERMED_STEPS = 320
FINISH_TIMEOUT = 240  # the second attempt: a trainer start (a minute on a loaded machine), then its steps
STARTED = re.compile(r"pod (?P<ns>[^/\s]+)/(?P<pod>\S+): trainer started \(PID (?P<pid>\d+)\)")
RESUMED = re.compile(r"resumed from \S+ \(step (?P<step>\d+)\)")
LOGGED_STEP = re.compile(r": step (?P<step>\d+)/\d+ \(epoch ")


def demo_job(name: str, max_steps: int) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(DEMO_JOB.read_text())
    job["metadata"]["name"] = name
    job["spec"]["training"]["maxSteps"] = max_steps
    job["spec"]["checkpoints"]["everySteps"] = EVERY_STEPS
    job["spec"]["restartPolicy"] = {"backoffSeconds": 1}
    return job


def job_dir(cluster: Cluster, jobs: Jobs, name: str) -> Path:
    return local_dir(cluster.workdir) / jobs.namespace / name


def trainer_pid(runner: Path, namespace: str, pod: str) -> int:
    def started() -> int | None:
        for m in STARTED.finditer(runner.read_text(errors="replace")):
            if (m["ns"], m["pod"]) == (namespace, pod):
                return int(m["pid"])
        return None

    pid: int = wait_for(f"the runner to start the trainer of {pod}", started, timeout=60)
    return pid


def disk_checkpoint(folder: Path) -> int:
    """The newest complete checkpoint step on the job's checkpoint folder (0: none yet)."""
    steps = [
        int(p.name.removeprefix(c.CHECKPOINT_PREFIX))
        for p in (folder / "checkpoints").glob(f"{c.CHECKPOINT_PREFIX}*")
        if (p / c.CHECKPOINT_COMPLETE_MARKER).is_file()
    ]
    return max(steps, default=0)


def logged_steps(folder: Path) -> list[int]:
    """Every logged step of every attempt, in order (``train_log.jsonl`` is appended across attempts; the
    demo job's evaluations add lines of their own, left out here)."""
    path = folder / "checkpoints" / "final" / "train_log.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return [r["step"] for r in records if "loss" in r]


def attempt_steps(folder: Path, pod: str) -> list[int]:
    """The steps one attempt's trainer logged, from its own log (one pod per attempt here)."""
    return [int(m["step"]) for m in LOGGED_STEP.finditer((folder / f"{pod}.log").read_text())]


def logging_every(folder: Path, pod: str) -> int:
    """The steps between the train log's lines, from the config the runner gave the pod's trainer."""
    config = json.loads((folder / f"{pod}.config.json").read_text())
    return int(config["training"]["logging_every_steps"])


def test_a_sigkilled_trainer_is_restarted_and_resumes_at_the_last_checkpoint(
    cluster: Cluster, jobs: Jobs, runner: Path
) -> None:
    jobs.apply(demo_job("killed", max_steps=KILLED_STEPS))
    folder = job_dir(cluster, jobs, "killed")
    pid = trainer_pid(runner, jobs.namespace, "killed-1-0")

    def past_a_checkpoint() -> bool:
        """The trainer has a complete checkpoint on disk and has trained past it."""
        on_disk, steps = disk_checkpoint(folder), logged_steps(folder)
        return on_disk > 0 and bool(steps) and steps[-1] > on_disk

    wait_for("the trainer to train past a checkpoint", past_a_checkpoint, timeout=120, every=0.05)
    os.killpg(pid, signal.SIGKILL)
    checkpoint = disk_checkpoint(folder)  # final: nothing writes after the kill

    status = jobs.wait_phase("killed", "Succeeded", timeout=FINISH_TIMEOUT)
    first, second = status["attempts"]
    assert (first["reason"], first["exitCode"]) == ("Unknown", 137)
    assert "SIGKILL" in first["message"]
    # The operator knows what the trainer last reported (every 30 s), which may be nothing yet for a run
    # this short: at most the checkpoint on disk. The trainer's own log below shows the exact step it
    # resumed from (lost steps are checked exactly by the SIGTERM test below and unit tests). Progress and
    # checkpoint reports go out together and a checkpoint comes every EVERY_STEPS steps, so the steps
    # between the two that the operator counts as lost are at most that many.
    assert 0 <= first.get("lostSteps", 0) <= EVERY_STEPS, first
    assert 0 <= second.get("resumedFromStep", 0) <= checkpoint
    assert second["succeeded"] and second.get("lostSteps") is None
    assert status["restarts"] == 1

    trainer_log = (folder / "killed-2-0.log").read_text()
    resumed = RESUMED.search(trainer_log)
    assert resumed is not None and int(resumed["step"]) == checkpoint, trainer_log[-2000:]
    steps = logged_steps(folder)
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart - 1] > checkpoint, "the first attempt trained past the checkpoint before the kill"
    assert checkpoint < steps[restart] <= checkpoint + 10, "the second attempt starts right after it"
    assert steps[-1] == KILLED_STEPS


def test_a_sigtermed_trainer_saves_its_step_and_the_restart_loses_nothing(
    cluster: Cluster, jobs: Jobs, runner: Path
) -> None:
    jobs.apply(demo_job("termed", max_steps=TERMED_STEPS))
    folder = job_dir(cluster, jobs, "termed")
    pid = trainer_pid(runner, jobs.namespace, "termed-1-0")
    wait_for(
        "the trainer to pass its first checkpoint",
        lambda: disk_checkpoint(folder) > 0,
        timeout=120,
        every=0.05,
    )
    os.kill(pid, signal.SIGTERM)

    status = jobs.wait_phase("termed", "Succeeded", timeout=FINISH_TIMEOUT)
    first, second = status["attempts"]
    assert (first["reason"], first["exitCode"]) == ("Preempted", 20)
    saved_at = re.search(r"checkpoint saved at step (\d+)", first["message"])
    assert saved_at is not None, first["message"]
    saved = int(saved_at[1])
    assert first["lostSteps"] == 0
    assert second["resumedFromStep"] == saved
    trainer_log = (folder / "termed-2-0.log").read_text()
    resumed = RESUMED.search(trainer_log)
    assert resumed is not None and int(resumed["step"]) == saved
    summary = json.loads((folder / "checkpoints" / "final" / "summary.json").read_text())
    assert (summary["resumedFromStep"], summary["steps"]) == (saved, TERMED_STEPS)

    # Beyond the trainer's own report: each attempt's log, a line every `every` steps, shows the first
    # stopping at the saved step and the second going on right after it; the train log holds both, every
    # logging step of the run once: none lost, none trained twice.
    every = logging_every(folder, "termed-1-0")
    before, after = attempt_steps(folder, "termed-1-0"), attempt_steps(folder, "termed-2-0")
    assert saved - every < before[-1] <= saved < after[0] <= saved + every, (saved, before, after)
    assert logged_steps(folder) == before + after
    assert [s for s in before + after if s % every == 0] == list(range(every, TERMED_STEPS + 1, every))
    assert after[-1] == TERMED_STEPS
