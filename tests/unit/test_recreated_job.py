"""A job deleted and created again under the same name while its predecessor's pods terminate: the new
job (a new uid) neither takes nor judges nor deletes them, and waits for the children of that name the
garbage collector is still removing. Also the order children are created in, and how a failed create
is said in the status."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob.job_status import SFTJobStatus
from sftjob_operator import builders, handlers, lookups
from sftjob_operator.expectations import Expectations
from sftjob_operator.kube import CreateFailed, NameTaken
from sftjob_operator.observe import JobView, trim_pod
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, NODES, NOW, SPEC, UID, observed, pod

KEY = ("team", "job")
OLD_UID = "uid-old"
Refuse = Callable[[dict[str, Any]], Exception | None]


class FakeKube:
    """The API as a pass uses it: ``refuse(manifest)`` is raised by that child's create."""

    def __init__(self, refuse: Refuse = lambda manifest: None, pods: dict[str, dict[str, Any]] | None = None):
        self.refuse, self.pods = refuse, pods or {}
        self.status: dict[str, Any] = {}
        self.created: list[str] = []  # kinds, in the order their creates were sent
        self.deleted: list[tuple[str, str]] = []
        self.events: list[tuple[str, str]] = []

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        await asyncio.sleep(0)  # let the other creates of a batch start
        return call(*args)

    def write_status(self, namespace: str, name: str, version: str, old: Any, new: SFTJobStatus) -> str:
        self.status = new.to_patch()
        return str(int(version) + 1)

    def ensure(self, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["kind"])
        error = self.refuse(manifest)
        if error is not None:
            raise error
        return True

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pods.get(name)

    def delete_pod(
        self, namespace: str, name: str, uid: str, grace_period_seconds: int | None = None
    ) -> bool:
        self.deleted.append((name, uid))
        return True

    def post_event(self, manifest: dict[str, Any]) -> None:
        self.events.append((manifest["reason"], manifest["message"]))


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeKube]]:
    def make(refuse: Refuse = lambda manifest: None, **kwargs: Any) -> FakeKube:
        fake = FakeKube(refuse, **kwargs)
        monkeypatch.setattr(handlers.Runtime, "kube", fake, raising=False)
        return fake

    monkeypatch.setattr(handlers.Runtime, "context", CTX, raising=False)
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations())
    monkeypatch.setattr(handlers, "_now", lambda: NOW)
    yield make


def run_pass(
    kube: FakeKube, pods: list[dict[str, Any]], status: dict[str, Any] | None = None
) -> Exception | None:
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1, "resourceVersion": "1",
            "creationTimestamp": "2026-01-01T11:59:00Z"}  # fmt: skip
    job = JobView.of(
        {"metadata": meta, "spec": SPEC, "status": status if status is not None else kube.status}
    )
    try:
        asyncio.run(handlers._pass(job, {KEY: pods}, {n: [node] for n, node in NODES.items()}))  # type: ignore[arg-type]
    except Exception as err:
        return err
    return None


def predecessors_pod() -> dict[str, Any]:
    """Attempt 3 of the earlier job of this name, 900 steps in, terminating after its job was deleted."""
    old = pod(
        attempt=3, owner=OLD_UID, annotations={c.ANNOTATION_PROGRESS: '{"step": 900, "totalSteps": 1000}'}
    )
    old["metadata"]["deletionTimestamp"] = "2026-01-01T11:58:50Z"
    return old


def test_a_job_created_again_under_its_name_starts_at_attempt_one_beside_its_predecessors_pods(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    assert run_pass(api, [predecessors_pod()]) is None
    assert api.status["attempt"] == 1 and "progress" not in api.status
    assert [a["attempt"] for a in api.status["attempts"]] == [1]
    assert api.created.count("Pod") == 1 and not api.deleted


def test_a_child_name_an_earlier_job_still_holds_is_said_in_the_status_and_retried_never_judged(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = NameTaken("Pod job-1-0 already exists and belongs to another owner (uid uid-old), ...")
    api = kube(lambda m: taken if m["kind"] == "Pod" else None)
    assert run_pass(api, []) is taken
    scheduled = next(x for x in api.status["conditions"] if x["type"] == "Scheduled")
    assert (scheduled["reason"], scheduled["message"]) == ("FailedCreate", str(taken))
    assert ("FailedCreate", str(taken)) in api.events
    old = [pod(attempt=1, owner=OLD_UID)]  # the index shows the predecessor's pod of that very name
    for minutes in (1, 5, 30):
        monkeypatch.setattr(handlers, "_now", lambda m=minutes: NOW.replace(minute=m))
        assert run_pass(api, old) is taken
        assert api.status["attempt"] == 1 and "endTime" not in api.status["attempts"][0]


def test_a_pod_read_directly_that_is_an_earlier_jobs_is_not_this_jobs(kube: Callable[..., FakeKube]) -> None:
    kube(pods={"job-1-0": pod(owner=OLD_UID), "job-1-1": pod(rank=1)})
    job = JobView.of({"metadata": {"namespace": "team", "name": "job", "uid": UID}})
    found, gone = asyncio.run(lookups.look_up(handlers.Runtime.kube, job, ["job-1-0", "job-1-1", "job-1-2"]))
    assert [p["metadata"]["name"] for p in found] == ["job-1-1"]
    assert gone == {"job-1-0", "job-1-2"}


def test_pods_are_deleted_only_if_still_the_pod_the_pass_decided_about(kube: Callable[..., FakeKube]) -> None:
    api = kube()
    run_pass(api, [])
    stale = pod(attempt=1, phase="Running")
    stale["metadata"]["uid"] = "pod-uid-seen"
    suspended = {**SPEC, "suspend": True}
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 2, "resourceVersion": "2"}
    job = JobView.of({"metadata": meta, "spec": suspended, "status": api.status})
    asyncio.run(handlers._pass(job, {KEY: [stale]}, {n: [node] for n, node in NODES.items()}))  # type: ignore[arg-type]
    assert api.deleted == [("job-1-0", "pod-uid-seen")]


def test_the_role_binding_is_created_after_its_role_and_the_pods_after_both(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    assert run_pass(api, []) is None
    assert api.created[-2:] == ["RoleBinding", "Pod"]
    first = {"ServiceAccount", "Role", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    assert set(api.created[:-2]) == first


def test_a_role_that_could_not_be_created_holds_back_its_binding_and_the_pods(
    kube: Callable[..., FakeKube],
) -> None:
    refused = CreateFailed("Role job-trainer: etcdserver: request timed out (HTTP 500)")
    api = kube(lambda m: refused if m["kind"] == "Role" else None)
    assert run_pass(api, []) is refused
    assert "RoleBinding" not in api.created and "Pod" not in api.created
    scheduled = next(x for x in api.status["conditions"] if x["type"] == "Scheduled")
    assert (scheduled["reason"], scheduled["message"]) == ("FailedCreate", str(refused))


def test_a_pod_kept_in_the_index_carries_its_uid_and_its_controllers() -> None:
    body = pod()
    body["metadata"]["ownerReferences"] = [
        {"kind": "Other", "uid": "not-the-controller"},
        {"kind": "SFTJob", "name": "job", "uid": UID, "controller": True, "blockOwnerDeletion": True},
    ]
    trimmed = trim_pod(body)["metadata"]
    assert trimmed["uid"] == "pod-1-0"
    assert trimmed["ownerReferences"] == [{"uid": UID, "controller": True}]


def test_every_child_carries_the_jobs_uid_and_the_rendezvous_service_selects_by_it() -> None:
    two_nodes = {**SPEC, "gpu": {"type": "L40S", "nodes": 2}}
    children = reconcile(observed(spec=two_nodes), CTX).children
    assert children and all(m["metadata"]["labels"][c.LABEL_CONTROLLER_UID] == UID for m in children)
    service = builders.rendezvous_service(JobRef(namespace="team", name="job", uid=UID, attempt=1))
    assert service["spec"]["selector"] == {c.LABEL_JOB: "job", c.LABEL_CONTROLLER_UID: UID}
