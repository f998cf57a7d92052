"""An SFTJob deleted and created again under the same name while its predecessor's pod is still
terminating (held here by a finalizer): the new job takes none of the predecessor's objects for its
own, says in its status what it waits for, and starts its own first attempt once the garbage collector
has removed them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from operator_harness import Jobs, sftjob, wait_for

pytestmark = pytest.mark.e2e

HOLD = "sftjob.test/hold"


def controller_uid(obj: dict[str, Any]) -> str | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r["uid"] for r in refs if r.get("controller")), None)


def read_pod(jobs: Jobs, name: str) -> dict[str, Any] | None:
    out = jobs.kubectl("get", "pod", name, "-o", "json", "--ignore-not-found").stdout
    return json.loads(out) if out.strip() else None


@contextmanager
def held(jobs: Jobs, pod: str) -> Iterator[Callable[[], None]]:
    """Hold ``pod`` in Terminating once deleted (a finalizer, as a slow kubelet would); yields the
    release, which also runs on the way out."""
    jobs.kubectl("patch", "pod", pod, "--type=merge", "-p", json.dumps({"metadata": {"finalizers": [HOLD]}}))

    def release() -> None:
        patch = '[{"op": "remove", "path": "/metadata/finalizers"}]'
        jobs.kubectl("patch", "pod", pod, "--type=json", "-p", patch, check=False)

    try:
        yield release
    finally:
        release()


def test_a_job_created_again_while_its_predecessors_pod_terminates_waits_for_it_then_starts_afresh(
    jobs: Jobs,
) -> None:
    jobs.apply(sftjob("again"))
    pod = jobs.running_pods("again")[0]["metadata"]["name"]
    old_uid = jobs.get("again")["metadata"]["uid"]
    with held(jobs, pod) as release:
        jobs.kubectl(
            "delete", "sftjob", "again"
        )  # the garbage collector deletes its children in the background
        wait_for(
            "the garbage collector to delete the old pod",
            lambda: (p := read_pod(jobs, pod)) and p["metadata"].get("deletionTimestamp"),
            timeout=120,
        )
        jobs.apply(sftjob("again"))
        new_uid = jobs.get("again")["metadata"]["uid"]
        assert new_uid != old_uid

        def waiting() -> dict[str, Any] | None:
            cond = jobs.condition("again", "Scheduled")
            return (
                cond if cond.get("reason") == "FailedCreate" and old_uid in cond.get("message", "") else None
            )

        wait_for("the new job to say what it waits for", waiting, timeout=30)
        time.sleep(5)  # long enough for a pass that took the old pod for its own to show it
        status = jobs.status("again")
        assert status["attempt"] == 1 and "progress" not in status, status
        assert [(a["attempt"], a.get("endTime")) for a in status["attempts"]] == [(1, None)]
        old = read_pod(jobs, pod)
        assert old is not None and controller_uid(old) == old_uid
        release()

    jobs.wait_phase("again", "Running", timeout=120)
    mine = read_pod(jobs, pod)
    assert mine is not None and controller_uid(mine) == new_uid
    assert mine["metadata"]["labels"]["sftjob.io/controller-uid"] == new_uid
    status = jobs.status("again")
    assert [(a["attempt"], a.get("reason")) for a in status["attempts"]] == [(1, None)]
    assert status.get("restarts", 0) == 0
