"""Ghost pods: kopf keeps a trainer pod in its index until it sees the pod's DELETED event, so a pod
deleted during a watch gap stays indexed for good. Once its delete finds no pod of its uid, the job's
passes leave it out, so the next attempt does not wait for it to stop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from sftjob.job_status import SFTJobStatus
from sftjob_operator import handlers, metrics
from sftjob_operator.expectations import Expectations
from sftjob_operator.ghosts import Tombstones
from sftjob_operator.observe import JobView
from sftjob_operator.workqueue import WorkQueue
from tests.unit.reconcile_cases import CTX, NODES, NOW, SPEC, UID, pod, preempted_status

KEY = ("team", "job")
TWO_NODES = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
A800: dict[str, Any] = NODES["a800-0"]
INDEXED_NODES = {**NODES, "a800-1": {**A800, "metadata": {**A800["metadata"], "name": "a800-1"}}}


class FakeKube:
    """The API as a pass uses it; a delete of a pod in ``gone`` answers 404."""

    def __init__(self) -> None:
        self.gone = {"pod-1-0"}  # rank 0 of attempt 1, deleted during a watch gap
        self.status: dict[str, Any] = {}
        self.version = 1
        self.created: list[str] = []
        self.deleted: list[tuple[str, str]] = []

    async def run(self, call: Any, *args: Any) -> Any:
        return call(*args)

    def write_status(self, namespace: str, name: str, version: str, old: Any, new: SFTJobStatus) -> str:
        self.status, self.version = new.to_patch(), self.version + 1
        return str(self.version)

    def ensure(self, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["metadata"]["name"])
        return True

    def delete_pod(
        self, namespace: str, name: str, uid: str, grace_period_seconds: int | None = None
    ) -> bool:
        self.deleted.append((name, uid))
        return uid not in self.gone

    def post_event(self, manifest: dict[str, Any]) -> None:
        pass

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None  # not there: the operator makes it


@pytest.fixture(autouse=True)
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    api = FakeKube()
    monkeypatch.setattr(handlers.Runtime, "kube", api, raising=False)
    monkeypatch.setattr(handlers.Runtime, "context", CTX, raising=False)
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations())
    monkeypatch.setattr(handlers.Runtime, "queue", WorkQueue())
    monkeypatch.setattr(handlers.Runtime, "gone_pods", Tombstones())
    monkeypatch.setattr(handlers.Runtime, "outdated", {})
    monkeypatch.setattr(handlers, "_now", lambda: NOW)
    yield api
    metrics.track_job(*KEY, None)


def run_pass(api: FakeKube, pods: list[dict[str, Any]]) -> None:
    """One pass over the job as ``api`` holds it, with ``pods`` in the pod index."""
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1,
            "resourceVersion": str(api.version), "creationTimestamp": "2026-01-01T11:00:00Z"}  # fmt: skip
    job = JobView.of({"metadata": meta, "spec": TWO_NODES, "status": api.status})
    nodes = {name: [node] for name, node in INDEXED_NODES.items()}

    async def run() -> None:
        await handlers._pass(job, {KEY: pods}, nodes)  # type: ignore[arg-type]

    asyncio.run(run())


def test_a_pod_whose_delete_finds_it_gone_no_longer_holds_back_the_next_attempt(runtime: FakeKube) -> None:
    api = runtime
    run_pass(api, [])
    survivor = pod(rank=0, node="a800-0")  # deleted during a watch gap: the index keeps it
    preempted = pod(rank=1, phase="Failed", node="a800-1", status=preempted_status("preempted"))
    run_pass(api, [survivor, preempted])
    assert api.deleted == [("job-1-0", "pod-1-0")]
    assert len(handlers.Runtime.queue) == 1  # decided again at once
    assert api.status["attempt"] == 1
    api.created.clear()
    run_pass(api, [survivor, preempted])
    assert api.status["attempt"] == 2 and {"job-2-0", "job-2-1"} <= set(api.created)
    assert ("job-1-0", "pod-1-0") not in api.deleted[1:]  # never deleted again


def test_a_gone_pods_tombstone_is_dropped_once_the_index_no_longer_holds_it(runtime: FakeKube) -> None:
    api = runtime
    run_pass(api, [])
    survivor = pod(rank=0, node="a800-0")
    preempted = pod(rank=1, phase="Failed", node="a800-1", status=preempted_status("preempted"))
    run_pass(api, [survivor, preempted])
    assert len(handlers.Runtime.gone_pods) == 1
    run_pass(api, [preempted])
    assert len(handlers.Runtime.gone_pods) == 0


def test_a_pod_still_there_when_deleted_is_not_left_out(
    runtime: FakeKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = runtime
    api.gone.clear()
    run_pass(api, [])
    survivor = pod(rank=0, node="a800-0")
    preempted = pod(rank=1, phase="Failed", node="a800-1", status=preempted_status("preempted"))
    run_pass(api, [survivor, preempted])
    run_pass(api, [survivor, preempted])
    assert len(handlers.Runtime.gone_pods) == 0
    assert api.status["attempt"] == 1  # still waiting for it to stop
    assert api.deleted == [("job-1-0", "pod-1-0")] * 2
