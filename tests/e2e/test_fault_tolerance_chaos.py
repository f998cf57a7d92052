"""Chaos: 100 jobs whose attempts fail at random (KWOK-steered exit codes, OOM kills, preemptions)
while the operator is SIGKILLed five times. Every job still ends Succeeded or Failed for a stated
reason, its ``restarts`` equals the failures it was given, and no pod is left over or duplicated.

Each job gets a script: a few transient failures, then success, a permanent failure, or one failure
too many for its ``maxRestarts``. The test steers each attempt's pod by the script as soon as the
pod is bound, so the outcome of every job is known in advance.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client, config
from operator_harness import Jobs, Operator, sftjob, wait_for

from sftjob import constants as c
from sftjob.failures import EXIT_CODE_CLASS, ExitCode, FailureClass
from sftjob_dev.cluster import Cluster

pytestmark = pytest.mark.e2e

JOBS = 100
# The operator is SIGKILLed (and started again) once this many jobs have finished: five times.
KILL_AT_FINISHED = (5, 20, 35, 50, 65)
SEED = 20261130
MAX_RESTARTS = 2


@dataclass(frozen=True)
class Outcome:
    """What one attempt's pod is steered into, and how the operator must classify it."""

    steer: dict[str, str]  # sim.sftjob.dev/* annotations
    failure: FailureClass | None  # None: the attempt succeeds

    @property
    def counted(self) -> bool:
        """Counts against maxRestarts (docs/failures.md)."""
        return self.failure not in (None, FailureClass.PREEMPTED)


def fail(code: ExitCode, message: str) -> Outcome:
    steer = {c.SIM_OUTCOME: "fail", c.SIM_EXIT_CODE: str(int(code)), c.SIM_MESSAGE: message}
    return Outcome(steer, EXIT_CODE_CLASS[code])


SUCCEED = Outcome({c.SIM_OUTCOME: "succeed"}, None)
OOM_KILL = Outcome({c.SIM_OUTCOME: "oomkill"}, FailureClass.HOST_OOM)
TRANSIENT = (
    fail(ExitCode.UNKNOWN, "RuntimeError: chaos"),
    fail(ExitCode.PREEMPTED, "preempted (SIGTERM): checkpoint saved"),
    fail(ExitCode.STORAGE_ERROR, "OSError: [Errno 28] No space left on device"),
    fail(ExitCode.COMMUNICATION_ERROR, "NCCL watchdog timeout"),
    OOM_KILL,
)
PERMANENT = (
    fail(ExitCode.DATA_ERROR, "DataError: row 7 has no messages"),
    fail(ExitCode.CONFIG_ERROR, "ConfigError: bad learning rate"),
)


@dataclass(frozen=True)
class Script:
    attempts: tuple[Outcome, ...]

    @property
    def succeeds(self) -> bool:
        return self.attempts[-1].failure is None

    @property
    def reason(self) -> str:
        """The Failed condition's reason the job must end with (or Completed)."""
        last = self.attempts[-1].failure
        if last is None:
            return "Completed"
        if last in (FailureClass.DATA_ERROR, FailureClass.CONFIG_ERROR):
            return last.value
        return "RestartLimitExceeded"


def script(rng: random.Random) -> Script:
    """Up to MAX_RESTARTS counted failures (and any preemptions) then an ending."""
    ending = rng.choices(["succeed", "permanent", "exhausted"], weights=[6, 2, 2])[0]
    before: list[Outcome] = []
    for _ in range(rng.randint(0, 3)):
        outcome = rng.choice(TRANSIENT)
        if outcome.counted and sum(o.counted for o in before) >= MAX_RESTARTS:
            outcome = TRANSIENT[1]  # a preemption instead: never exceed the budget by accident
        before.append(outcome)
    if ending == "succeed":
        return Script((*before, SUCCEED))
    if ending == "permanent":
        return Script((*before, rng.choice(PERMANENT)))
    counted = sum(o.counted for o in before)
    more = [fail(ExitCode.UNKNOWN, "RuntimeError: chaos")] * (MAX_RESTARTS + 1 - counted)
    return Script((*before, *more))


def finished(jobs: Jobs) -> dict[str, dict[str, Any]]:
    """The status of every job that Succeeded or Failed, by name."""
    items = json.loads(jobs.kubectl("get", "sftjobs", "-o", "json").stdout)["items"]
    statuses = {j["metadata"]["name"]: j.get("status") or {} for j in items}
    return {name: s for name, s in statuses.items() if s.get("phase") in ("Succeeded", "Failed")}


class Steerer:
    """Steers every bound, unsteered trainer pod of the namespace by its job's script."""

    def __init__(self, cluster: Cluster, namespace: str, scripts: dict[str, Script]) -> None:
        self.core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        self.namespace, self.scripts = namespace, scripts
        self.stop = threading.Event()
        self.rng = random.Random(SEED)
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sweep()
            except Exception as err:  # keep steering; report at the end
                self.errors.append(repr(err))
            self.stop.wait(0.5)

    def sweep(self) -> None:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=c.LABEL_JOB).items
        for pod in pods:
            meta = pod.metadata
            if (
                (meta.annotations or {}).get(c.SIM_OUTCOME)
                or meta.deletion_timestamp
                or not pod.spec.node_name
            ):
                continue
            attempts = self.scripts[meta.labels[c.LABEL_JOB]].attempts
            attempt = int(meta.labels[c.LABEL_ATTEMPT])
            outcome = attempts[attempt - 1] if attempt <= len(attempts) else SUCCEED
            body = {
                "metadata": {"annotations": {**outcome.steer, c.SIM_RUN_FOR: f"{self.rng.randint(1, 3)}s"}}
            }
            self.core.patch_namespaced_pod(meta.name, self.namespace, body)


def test_a_hundred_jobs_with_random_failures_and_five_operator_kills_all_end_as_scripted(
    cluster: Cluster, jobs: Jobs, operator: Operator
) -> None:
    rng = random.Random(SEED)
    scripts = {f"ft-{i:03d}": script(rng) for i in range(JOBS)}
    steerer = Steerer(cluster, jobs.namespace, scripts)
    thread = threading.Thread(target=steerer.run, daemon=True)
    thread.start()
    policy = {"maxRestarts": MAX_RESTARTS, "backoffSeconds": 1, "maxBackoffSeconds": 2}
    try:
        jobs.apply(*(sftjob(name, gpu={"type": "Any"}, restartPolicy=policy) for name in scripts))
        for threshold in KILL_AT_FINISHED:  # kills spread over the run, while most jobs are mid-way
            wait_for(
                f"{threshold} finished jobs", lambda n=threshold: len(finished(jobs)) >= n, 120, every=1.0
            )
            time.sleep(rng.uniform(0.0, 2.0))
            operator.kill()
            time.sleep(rng.uniform(0.0, 1.0))
            operator.start()
        statuses: dict[str, dict[str, Any]] = wait_for(
            "every job to finish", lambda: len(done := finished(jobs)) == JOBS and done, 240, every=2.0
        )
    finally:
        steerer.stop.set()
        thread.join(timeout=10)
    assert steerer.errors == []

    wrong = {}
    for name, want in scripts.items():
        status = statuses[name]
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        got = {
            "phase": status["phase"],
            "reason": "Completed" if status["phase"] == "Succeeded" else failed["reason"],
            "restarts": status["restarts"],
            "classes": [a.get("reason") for a in status["attempts"]],
        }
        expected = {
            "phase": "Succeeded" if want.succeeds else "Failed",
            "reason": want.reason,
            "restarts": len(want.attempts) - 1,
            "classes": [o.failure.value if o.failure else None for o in want.attempts],
        }
        if got != expected:
            wrong[name] = (got, expected)
        if status["phase"] == "Failed":
            assert failed["message"], f"{name} failed without saying why"
    assert wrong == {}, f"{len(wrong)} job(s) ended otherwise than scripted: {wrong}"

    time.sleep(3)  # any late duplicate creation would show by now
    # Pods the operator deleted may linger in Terminating while KWOK catches up: they are not orphans.
    pods = [p for p in jobs.pods() if not p["metadata"].get("deletionTimestamp")]
    last_pods = {f"{name}-{len(want.attempts)}-0" for name, want in scripts.items()}
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(last_pods), "one pod per job: its last"
    assert all(p["status"]["phase"] in ("Succeeded", "Failed") for p in pods), "a finished job's pod runs"
    # Deleting all hundred goes through the garbage collector (the operator adds no finalizer). A pod
    # whose DELETE a killed operator left half done is finished by KWOK, as a kubelet would.
    jobs.delete_all()
