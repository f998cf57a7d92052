"""Ghost jobs: kopf keeps an index entry until it sees the object's DELETED event, so a job deleted
during a watch gap stays in the index, possibly beside a job recreated under its name. A pass runs on
the newest entry, and an entry the API server answers 404 for is forgotten and never passed again."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from sftjob import constants as c
from sftjob.job_status import SFTJobStatus
from sftjob_operator import handlers, metrics
from sftjob_operator.expectations import Expectations
from sftjob_operator.ghosts import Tombstones
from sftjob_operator.observe import JobView
from sftjob_operator.reconcile import reconcile as decide
from sftjob_operator.workqueue import WorkQueue
from tests.unit.reconcile_cases import CTX, NODES, NOW, SPEC, observed

KEY = ("team", "job")


def not_found(kind: str = c.PLURAL, group: str = c.API_GROUP, name: str = "job") -> ApiException:
    err = ApiException(status=404, reason="Not Found")
    details = {"name": name, "group": group, "kind": kind}
    err.body = json.dumps({"kind": "Status", "code": 404, "reason": "NotFound", "details": details})
    return err


class FakeKube:
    """The API as a pass uses it, holding only the jobs named in ``uids`` (name → uid)."""

    def __init__(self, uids: dict[str, str]) -> None:
        self.uids = uids
        self.writes: list[tuple[str, str]] = []  # (name, resourceVersion the write was conditioned on)
        self.events: list[str] = []
        self.deletes: list[str] = []

    async def run(self, call: Any, *args: Any) -> Any:
        return call(*args)

    def write_status(self, namespace: str, name: str, version: str, old: Any, new: SFTJobStatus) -> str:
        self.writes.append((name, version))
        if name not in self.uids:
            raise not_found(name=name)
        return str(int(version) + 1)

    def ensure(self, manifest: dict[str, Any]) -> bool:
        return True

    def post_event(self, manifest: dict[str, Any]) -> None:
        self.events.append(manifest["reason"])

    def delete_job(self, namespace: str, name: str, uid: str) -> bool:
        self.deletes.append(name)
        return self.uids.get(name) == uid


def job(uid: str, created: str, version: str) -> JobView:
    meta = {"namespace": "team", "name": "job", "uid": uid, "generation": 1,
            "resourceVersion": version, "creationTimestamp": created}  # fmt: skip
    return JobView.of({"metadata": meta, "spec": SPEC, "status": {}})


GHOST = job("old", "2026-01-01T11:00:00Z", "100")
RECREATED = job("new", "2026-01-01T11:30:00Z", "900")


@pytest.fixture(autouse=True)
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(handlers.Runtime, "context", CTX, raising=False)
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations())
    monkeypatch.setattr(handlers.Runtime, "queue", WorkQueue())
    monkeypatch.setattr(handlers.Runtime, "gone", Tombstones())
    monkeypatch.setattr(handlers.Runtime, "outdated", {})
    monkeypatch.setattr(handlers.Runtime, "backoff", {})
    monkeypatch.setattr(handlers, "_now", lambda: NOW)
    yield
    metrics.track_job(*KEY, None)


def reconcile(api: FakeKube, *entries: JobView) -> None:
    """One pass over KEY with ``entries`` in the job index, as a worker runs it."""
    monkey = pytest.MonkeyPatch()
    monkey.setattr(handlers.Runtime, "kube", api, raising=False)
    nodes = {name: [node] for name, node in NODES.items()}
    try:
        asyncio.run(handlers._reconcile(KEY, {KEY: list(entries)}, {}, nodes))  # type: ignore[arg-type]
    finally:
        monkey.undo()


def counted(phase: str = "Pending") -> float:
    return REGISTRY.get_sample_value("sftjob_jobs", {"phase": phase, "gpu_type": "L40S"}) or 0.0


def test_a_job_deleted_during_a_watch_gap_is_forgotten_at_the_404_of_its_status_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = FakeKube(uids={})
    before = counted("Running")
    metrics.track_job(*KEY, SFTJobStatus(phase="Running", gpu={"type": "L40S"}))
    with caplog.at_level(logging.INFO, logger=handlers.__name__):
        reconcile(api, GHOST)
    assert handlers.Runtime.gone.select(KEY, [GHOST]) is None
    assert counted("Running") == before  # no longer counted in sftjob_jobs
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback, no backoff
    assert KEY not in handlers.Runtime.backoff


def test_a_finished_ghost_past_its_ttl_is_forgotten_at_the_404_of_its_delete_not_deleted_every_pass() -> None:
    # A finished job writes no status, so only its TTL delete can find it gone.
    meta = {"namespace": "team", "name": "job", "uid": "old", "generation": 1,
            "resourceVersion": "100", "creationTimestamp": "2026-01-01T10:00:00Z"}  # fmt: skip
    spec = {**SPEC, "ttlSecondsAfterFinished": 60}
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:00:00Z", "attempt": 1}
    written = decide(observed(spec=spec, status=done), CTX).status.to_patch()  # as the operator wrote it
    ghost = JobView.of({"metadata": meta, "spec": spec, "status": written})
    api = FakeKube(uids={})
    reconcile(api, ghost)
    assert api.deletes == ["job"] and handlers.Runtime.gone.select(KEY, [ghost]) is None
    reconcile(api, ghost)
    assert api.deletes == ["job"] and api.events.count("Finished") <= 1


def test_a_forgotten_ghost_is_never_passed_over_again() -> None:
    api = FakeKube(uids={})
    reconcile(api, GHOST)
    reconcile(api, GHOST)
    reconcile(api, GHOST)
    assert api.writes == [("job", "100")]


@pytest.mark.parametrize(
    "entries", [(GHOST, RECREATED), (RECREATED, GHOST)], ids=["ghost-first", "ghost-last"]
)
def test_a_job_recreated_under_the_name_of_a_ghost_is_the_one_reconciled_whatever_the_index_order(
    entries: tuple[JobView, JobView],
) -> None:
    api = FakeKube(uids={"job": "new"})
    reconcile(api, *entries)
    assert api.writes == [("job", "900")]
    assert len(handlers.Runtime.gone) == 0


def test_a_ghost_created_in_the_same_second_as_the_recreated_job_gives_way_to_the_later_version() -> None:
    ghost = job("old", "2026-01-01T11:30:00Z", "100")
    api = FakeKube(uids={"job": "new"})
    reconcile(api, RECREATED, ghost)
    assert api.writes == [("job", "900")]


def test_a_404_for_something_other_than_the_job_is_an_error_to_retry_not_a_gone_job() -> None:
    class ChildGone(FakeKube):
        def ensure(self, manifest: dict[str, Any]) -> bool:
            raise not_found(kind="configmaps", group="", name=manifest["metadata"]["name"])

    reconcile(ChildGone(uids={"job": "old"}), GHOST)
    assert len(handlers.Runtime.gone) == 0
    assert KEY in handlers.Runtime.backoff


def test_a_tombstoned_ghost_is_skipped_even_where_nothing_else_tells_it_from_the_live_job() -> None:
    ghost = job("old", "2026-01-01T11:30:00Z", "not-a-number")
    recreated = job("new", "2026-01-01T11:30:00Z", "also-opaque")
    tombstones = Tombstones()
    tombstones.bury(KEY, "old")  # as after the ghost's pass answered 404
    assert tombstones.select(KEY, [ghost, recreated]) == recreated
    assert tombstones.select(KEY, [recreated, ghost]) == recreated


def test_a_tombstone_is_kept_while_its_ghost_is_in_the_index_and_dropped_after() -> None:
    tombstones = Tombstones()
    tombstones.bury(KEY, "old")
    assert tombstones.select(KEY, [GHOST]) is None
    assert tombstones.select(KEY, [GHOST, RECREATED]) == RECREATED
    assert len(tombstones) == 1
    assert tombstones.select(KEY, [RECREATED]) == RECREATED
    assert len(tombstones) == 0
    tombstones.bury(KEY, "old")
    assert tombstones.select(KEY, []) is None
    assert len(tombstones) == 0


class Listing(FakeKube):
    """A FakeKube that also lists the uids of the jobs it holds, namespace by namespace."""

    def __init__(self, uids: dict[str, str], refuse: Exception | None = None) -> None:
        super().__init__(uids)
        self.listed: list[str] = []
        self.refuse = refuse
        self.meanwhile: Callable[[], None] = lambda: None  # what happens while the list is made

    def job_uids(self, namespace: str) -> set[str]:
        self.listed.append(namespace)
        self.meanwhile()
        if self.refuse is not None:
            raise self.refuse
        return set(self.uids.values())


def sweep(api: Listing, index: dict[tuple[str, str], list[JobView]]) -> None:
    monkey = pytest.MonkeyPatch()
    monkey.setattr(handlers.Runtime, "kube", api, raising=False)
    try:
        asyncio.run(handlers._bury_ghosts(index))  # type: ignore[arg-type]
    finally:
        monkey.undo()


def test_a_quiet_ghost_that_never_writes_is_found_by_the_sweep_and_no_longer_counted() -> None:
    done = {"phase": "Succeeded", "completionTime": "2026-01-01T11:00:00Z", "attempt": 1}
    written = decide(observed(status=done), CTX).status.to_patch()  # finished, no TTL: nothing to write
    meta = {"namespace": "team", "name": "job", "uid": "old", "generation": 1,
            "resourceVersion": "100", "creationTimestamp": "2026-01-01T10:00:00Z"}  # fmt: skip
    ghost = JobView.of({"metadata": meta, "spec": SPEC, "status": written})
    api = Listing(uids={})
    before = REGISTRY.get_sample_value("sftjob_jobs", {"phase": "Succeeded", "gpu_type": "Unknown"}) or 0.0
    reconcile(api, ghost)
    assert api.writes == [] and api.deletes == []  # nothing a pass does finds it gone
    assert (
        REGISTRY.get_sample_value("sftjob_jobs", {"phase": "Succeeded", "gpu_type": "Unknown"}) == before + 1
    )
    sweep(api, {KEY: [ghost]})
    assert api.listed == ["team"] and len(handlers.Runtime.queue) == 1  # its key queued for a last pass
    reconcile(api, ghost)  # the pass finds no job left: forgotten
    assert handlers.Runtime.gone.select(KEY, [ghost]) is None
    assert (
        REGISTRY.get_sample_value("sftjob_jobs", {"phase": "Succeeded", "gpu_type": "Unknown"}) or 0.0
    ) == before


def test_the_sweep_buries_only_the_ghost_beside_a_live_job_with_one_list_per_namespace() -> None:
    other = ("team", "other")
    api = Listing(uids={"job": "new", "other": "other-uid"})
    sweep(api, {KEY: [GHOST, RECREATED], other: [job("other-uid", "2026-01-01T11:00:00Z", "5")]})
    assert api.listed == ["team"]
    assert (
        handlers.Runtime.gone.select(KEY, [GHOST, RECREATED]) == RECREATED and len(handlers.Runtime.gone) == 1
    )


def test_a_job_created_while_the_sweep_lists_is_not_taken_for_a_ghost() -> None:
    api = Listing(uids={"job": "new"})
    index: dict[tuple[str, str], list[JobView]] = {KEY: [RECREATED]}
    late = job("late-uid", "2026-01-01T12:00:00Z", "950")
    api.meanwhile = lambda: index.update({("team", "late"): [late]})  # indexed after the list was made
    sweep(api, index)
    assert len(handlers.Runtime.gone) == 0 and len(handlers.Runtime.queue) == 0


def test_a_sweep_whose_list_fails_buries_nothing_and_raises_nothing(caplog: pytest.LogCaptureFixture) -> None:
    api = Listing(uids={}, refuse=ApiException(status=403, reason="Forbidden"))
    with caplog.at_level(logging.WARNING, logger=handlers.__name__):
        sweep(api, {KEY: [GHOST]})
    assert len(handlers.Runtime.gone) == 0 and "listing the SFTJobs of team" in caplog.text
