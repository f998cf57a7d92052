"""An operator killed with SIGKILL at random points while jobs are being created never duplicates a pod
and never loses a job: deterministic child names, the attempt number recorded before its pods exist,
and indexes that are complete before the first pass."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
from operator_harness import Jobs, Operator, sftjob, wait_for

pytestmark = pytest.mark.e2e

JOBS = 50
MULTI_NODE_EVERY = 10  # every tenth job runs on two nodes


def test_sigkills_during_fifty_creations_leave_exactly_one_pod_set_per_job(
    jobs: Jobs, operator: Operator
) -> None:
    rng = random.Random(20261130)
    manifests = [
        sftjob(
            f"chaos-{i:02d}", gpu={"type": "Any", "count": 1, "nodes": 2 if i % MULTI_NODE_EVERY == 0 else 1}
        )
        for i in range(JOBS)
    ]

    def create() -> None:
        for manifest in manifests:
            jobs.apply(manifest)
            time.sleep(rng.uniform(0.0, 0.1))

    creator = threading.Thread(target=create)
    creator.start()
    kills = 0
    while creator.is_alive() or kills < 3:
        time.sleep(rng.uniform(0.3, 2.0))
        operator.kill()
        kills += 1
        time.sleep(rng.uniform(0.0, 0.5))
        operator.start()
    creator.join()

    expected = {m["metadata"]["name"]: m["spec"]["gpu"]["nodes"] for m in manifests}

    def all_created() -> bool:
        per_job = Counter(p["metadata"]["labels"]["sftjob.io/job"] for p in jobs.pods())
        return all(per_job[name] >= n for name, n in expected.items())

    wait_for("every job's pods", all_created, timeout=120, every=1.0)
    time.sleep(3)  # any duplicate creation would have happened by now
    pods = jobs.pods()
    sets = Counter(
        (p["metadata"]["labels"]["sftjob.io/job"], p["metadata"]["labels"]["sftjob.io/node-rank"])
        for p in pods
    )
    assert len(pods) == sum(expected.values()), f"{len(pods)} pods for {sum(expected.values())} expected"
    assert all(n == 1 for n in sets.values())
    assert {p["metadata"]["labels"]["sftjob.io/attempt"] for p in pods} == {"1"}
    for name in expected:
        assert [a["attempt"] for a in jobs.status(name).get("attempts", [])] == [1], name
