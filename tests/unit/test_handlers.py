"""A pass applied through a fake API: a status transition is counted and posted once, right after its
status write, even when what follows (creating the next attempt's pods) fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from sftjob.job_status import SFTJobStatus
from sftjob_operator import handlers
from sftjob_operator.expectations import Expectations
from sftjob_operator.ghosts import Tombstones
from sftjob_operator.kube import Conflict, Forbidden, Rejected
from sftjob_operator.observe import JobView
from tests.unit.reconcile_cases import CTX, NODES, NOW, SPEC, UID, pod, preempted_status, terminated

KEY = ("team", "job")


class FakeKube:
    """The API as the handlers use it; ``refuse`` raises for the pods it names."""

    def __init__(self, refuse: Callable[[str], Exception | None] = lambda name: None) -> None:
        self.refuse, self.version = refuse, 1
        self.status: dict[str, object] = {}
        self.events: list[tuple[str, str]] = []
        self.conflict = False
        self.unchanged = False  # a write that changes nothing keeps the job's resourceVersion
        self.released: list[str] = []  # pods whose Kueue finalizer was taken off
        self.workloads: dict[str, dict[str, Any]] = {}  # Kueue's Workloads by name
        self.workloads_read: list[str] = []
        self.refuse_other: dict[str, Exception] = {}  # by kind, for children that are not pods
        self.sent: list[str] = []  # the kinds of the children created (or found there), in order
        self.deleted: list[tuple[str, int | None]] = []  # pods deleted, with their grace
        self.refuse_job_delete: Exception | None = None
        self.jobs_deleted = 0

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return call(*args)

    def write_status(self, namespace: str, name: str, version: str, old: Any, new: SFTJobStatus) -> str:
        if self.conflict:
            raise Conflict(version)
        if not self.unchanged:
            self.status, self.version = new.to_patch(), self.version + 1
        return str(self.version)

    def ensure(self, manifest: dict[str, Any]) -> bool:
        name = manifest["metadata"]["name"]
        self.sent.append(manifest["kind"])
        error = self.refuse(name) if manifest["kind"] == "Pod" else self.refuse_other.get(manifest["kind"])
        if error is not None:
            raise error
        return True

    def delete_pod(
        self, namespace: str, name: str, uid: str, grace_period_seconds: int | None = None
    ) -> bool:
        self.deleted.append((name, grace_period_seconds))
        return True

    def delete_job(self, namespace: str, name: str, uid: str) -> bool:
        if self.refuse_job_delete is not None:
            raise self.refuse_job_delete
        self.jobs_deleted += 1
        return self.jobs_deleted == 1  # a second delete finds the job gone (404)

    def post_event(self, manifest: dict[str, Any]) -> None:
        self.events.append((manifest["type"], manifest["reason"]))

    def release_pod(self, namespace: str, name: str, uid: str) -> None:
        self.released.append(name)

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None  # not there: the operator makes it

    def read_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.workloads_read.append(name)
        if name not in self.workloads:
            raise ApiException(status=429, reason="Too Many Requests")
        return self.workloads[name]


def fresh_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers' shared state as a new operator has it, the pass's clock at NOW."""
    monkeypatch.setattr(handlers.Runtime, "context", CTX, raising=False)
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations())
    monkeypatch.setattr(handlers.Runtime, "outdated", {})
    monkeypatch.setattr(handlers.Runtime, "queue_reasons", {})
    monkeypatch.setattr(handlers, "_now", lambda: NOW)


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FakeKube]:
    def make(refuse: Callable[[str], Exception | None] = lambda name: None) -> FakeKube:
        fake = FakeKube(refuse)
        monkeypatch.setattr(handlers.Runtime, "kube", fake, raising=False)
        return fake

    fresh_runtime(monkeypatch)
    return make


def run_pass(
    kube: FakeKube,
    pods: list[dict[str, Any]],
    *,
    spec: dict[str, Any] = SPEC,
    nodes_up: dict[str, dict[str, Any]] = NODES,
) -> Exception | None:
    """One pass over the job as ``kube`` holds it; the error it raised, if any."""
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1,
            "resourceVersion": str(kube.version), "creationTimestamp": "2026-01-01T11:00:00Z"}  # fmt: skip
    job = JobView.of({"metadata": meta, "spec": spec, "status": kube.status})
    nodes = {name: [node] for name, node in nodes_up.items()}
    try:
        asyncio.run(handlers._pass(job, {KEY: pods}, nodes))  # type: ignore[arg-type]
    except Exception as err:
        return err
    return None


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def refuse_second_attempt(name: str) -> Exception | None:
    return Forbidden(f"Pod {name}: exceeded quota") if name == "job-2-0" else None


def test_a_restart_whose_pod_is_refused_still_posts_and_counts_the_failure_and_the_new_attempt(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    api = kube(refuse_second_attempt)
    assert run_pass(api, []) is None
    api.events.clear()
    restarts = sample("sftjob_restarts_total", failure_class="Preempted")
    preempted = [pod(phase="Failed", status=preempted_status("preempted (SIGTERM)"))]
    assert isinstance(run_pass(api, preempted), Forbidden)
    assert api.status["attempt"] == 2
    assert api.events == [("Warning", "Preempted"), ("Normal", "PodsCreated"), ("Warning", "FailedCreate")]
    assert sample("sftjob_restarts_total", failure_class="Preempted") == restarts + 1
    monkeypatch.setattr(handlers, "_now", lambda: NOW + timedelta(seconds=5))
    assert isinstance(run_pass(api, preempted), Forbidden)  # the retry has no transition left to say
    assert api.events[3:] == [] and sample("sftjob_restarts_total", failure_class="Preempted") == restarts + 1


def test_a_pod_rejected_as_invalid_fails_the_job_and_counts_it_failed(kube: Callable[..., FakeKube]) -> None:
    api = kube(lambda name: Rejected(f"Pod {name}: spec.containers[0].image: Required value"))
    failed = sample("sftjob_jobs_finished_total", result="Failed")
    assert run_pass(api, []) is None
    assert api.status["phase"] == "Failed"
    assert api.events == [("Normal", "PodsCreated"), ("Warning", "ChildRejected")]
    assert sample("sftjob_jobs_finished_total", result="Failed") == failed + 1
    assert run_pass(api, []) is None
    assert sample("sftjob_jobs_finished_total", result="Failed") == failed + 1


def test_an_invalid_child_fails_the_job_though_another_of_its_batch_was_refused_for_now(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    api.refuse_other = {
        "ServiceAccount": Forbidden("exceeded quota"),
        "ConfigMap": Rejected("data: Too long"),
    }
    assert run_pass(api, []) is None
    assert api.status["phase"] == "Failed" and ("Warning", "ChildRejected") in api.events


def test_a_refused_create_still_lets_the_force_delete_of_the_old_pod_on_a_lost_node_go_out(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    api = kube(refuse_second_attempt)  # a GPU quota the lost node's pod still counts against
    assert run_pass(api, []) is None
    monkeypatch.setattr(handlers, "_now", lambda: NOW + timedelta(seconds=10))
    assert run_pass(api, [pod()]) is None and api.status["phase"] == "Running"  # attempt 1 on l40s-0
    lost = {name: node for name, node in NODES.items() if name != "l40s-0"}  # then its node is gone
    for minutes in (5, 6):  # the retry too
        monkeypatch.setattr(handlers, "_now", lambda minutes=minutes: NOW + timedelta(minutes=minutes))
        assert isinstance(run_pass(api, [pod()], nodes_up=lost), Forbidden)
        assert api.status["attempt"] == 2
    assert api.deleted == [("job-1-0", 0), ("job-1-0", 0)]  # with force, at each pass


def test_a_pod_rejected_as_invalid_ends_its_attempt_and_leaves_no_pod_waiting_for_the_scheduler(
    kube: Callable[..., FakeKube],
) -> None:
    why = "Pod job-1-0: spec.containers[0].image: Required value"
    api = kube(lambda name: Rejected(why))
    assert run_pass(api, []) is None
    [record] = api.status["attempts"]  # type: ignore[misc]
    assert (record["endTime"], record["message"], record.get("succeeded", False)) == (
        "2026-01-01T12:00:00Z",
        why,
        False,
    )
    assert (_scheduled(api)["status"], _scheduled(api)["reason"]) == ("False", "ChildRejected")


ALL_KINDS = [
    "ServiceAccount",
    "Role",
    "ConfigMap",
    "NetworkPolicy",
    "PersistentVolumeClaim",
    "RoleBinding",
    "Pod",
]


def test_a_pod_refused_for_minutes_is_sent_again_alone_not_with_every_other_child_of_its_attempt(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    api = kube(lambda name: Forbidden(f"Pod {name}: exceeded quota: gpu, requested 1, used 1, limited 1"))
    clock = [0.0]
    monkeypatch.setattr(handlers.Runtime, "expectations", Expectations(clock=lambda: clock[0]))
    for at in (0, 31, 61, 91, 121, 301):  # the backoff's cap is 30 s
        clock[0] = at
        monkeypatch.setattr(handlers, "_now", lambda at=at: NOW + timedelta(seconds=at))
        api.sent.clear()
        assert isinstance(run_pass(api, []), Forbidden)
        assert api.sent == (ALL_KINDS if at == 0 else ["Pod"])


def test_a_pod_refused_for_a_missing_service_account_sends_the_attempts_other_children_again(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    api = kube(
        lambda name: Forbidden(
            f'pods "{name}" is forbidden: error looking up service account team/job-trainer:'
            ' serviceaccount "job-trainer" not found (HTTP 403)'
        )
    )
    assert isinstance(run_pass(api, []), Forbidden)  # someone deleted it right after its create
    monkeypatch.setattr(handlers, "_now", lambda: NOW + timedelta(seconds=5))
    api.sent.clear()
    assert isinstance(run_pass(api, []), Forbidden)
    assert api.sent == ALL_KINDS


def test_the_ttls_deletion_is_said_once_when_the_delete_went_through_not_at_each_retry(
    kube: Callable[..., FakeKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handlers.Runtime, "gone", Tombstones())
    spec = {**SPEC, "ttlSecondsAfterFinished": 60}
    api = kube()
    done = pod(phase="Succeeded", status=terminated(0, "Completed"))
    for pods in ([], [pod()], [done]):
        assert run_pass(api, pods, spec=spec) is None
    assert api.status["phase"] == "Succeeded"
    api.events.clear()
    monkeypatch.setattr(handlers, "_now", lambda: NOW + timedelta(seconds=120))
    api.refuse_job_delete = ApiException(status=403, reason="Forbidden")
    for _ in range(2):
        assert isinstance(run_pass(api, [done], spec=spec), ApiException)
    assert api.events == []
    api.refuse_job_delete = None
    assert run_pass(api, [done], spec=spec) is None  # deleted
    assert run_pass(api, [done], spec=spec) is None  # before the DELETED event: the delete finds it gone
    assert api.jobs_deleted == 2 and api.events == [("Normal", "Finished")]


def test_a_status_write_lost_to_a_conflict_posts_and_counts_nothing(kube: Callable[..., FakeKube]) -> None:
    api = kube()
    assert run_pass(api, []) is None
    api.events.clear()
    api.conflict = True
    restarts = sample("sftjob_restarts_total", failure_class="Preempted")
    preempted = [pod(phase="Failed", status=preempted_status("preempted (SIGTERM)"))]
    assert isinstance(run_pass(api, preempted), Conflict)
    assert api.events == [] and sample("sftjob_restarts_total", failure_class="Preempted") == restarts


def test_a_status_write_answered_with_the_version_it_was_given_does_not_hold_back_the_next_pass(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    assert run_pass(api, []) is None
    assert KEY in handlers.Runtime.outdated  # waits for the version that shows the write
    handlers.Runtime.outdated.clear()
    api.unchanged = True  # the server already held this status: no newer version will come
    assert run_pass(api, [pod(phase="Failed", status=preempted_status("preempted (SIGTERM)"))]) is None
    assert KEY not in handlers.Runtime.outdated


def test_the_pods_of_a_deleted_job_that_kueue_still_held_are_released(kube: Callable[..., FakeKube]) -> None:
    from sftjob import constants as c
    from sftjob_operator.observe import trim_pod

    api = kube()
    queued = pod(phase="Pending", node=None)
    queued["metadata"] |= {"deletionTimestamp": "2026-01-01T12:00:00Z", "finalizers": [c.KUEUE_FINALIZER]}
    ran = pod(rank=1)  # a pod that ran: Kueue takes its finalizer off itself once it has stopped
    ran["metadata"] |= {"deletionTimestamp": "2026-01-01T12:00:00Z", "finalizers": [c.KUEUE_FINALIZER]}
    indexed = {KEY: [trim_pod(queued), trim_pod(ran)]}
    asyncio.run(handlers._reconcile(KEY, {}, indexed, {}))  # type: ignore[arg-type]  # the job is gone
    assert api.released == ["job-1-0"]


def _held(rank: int, owner: str = UID) -> dict[str, object]:
    from sftjob import constants as c
    from sftjob_operator.observe import trim_pod

    queued = pod(rank=rank, phase="Pending", node=None, owner=owner)
    queued["metadata"] |= {"deletionTimestamp": "2026-01-01T12:00:00Z", "finalizers": [c.KUEUE_FINALIZER]}
    return trim_pod(queued)


def test_an_earlier_jobs_queued_pods_are_released_when_a_job_of_its_name_exists_again(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    assert run_pass(api, [_held(0, owner="uid-of-the-deleted-job")]) is None
    assert api.released == ["job-1-0"]


def test_the_queued_pods_of_a_job_deleted_in_the_foreground_are_released(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1, "resourceVersion": "1",
            "deletionTimestamp": "2026-01-01T12:00:00Z", "finalizers": ["foregroundDeletion"]}  # fmt: skip
    deleting = JobView.of({"metadata": meta, "spec": SPEC, "status": {}})
    asyncio.run(handlers._pass(deleting, {KEY: [_held(0)]}, {}))  # type: ignore[arg-type]
    assert api.released == ["job-1-0"]


def _gated(group: str) -> dict[str, Any]:
    gated = pod(phase="Pending", node=None)
    gated["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = group
    gated["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]
    return gated


def _scheduled(api: FakeKube) -> dict[str, Any]:
    return next(c for c in api.status["conditions"] if c["type"] == "Scheduled")  # type: ignore[attr-defined]


def test_a_queued_attempt_says_why_kueue_holds_it_in_kueues_own_words_read_once_in_a_while(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    why = (
        "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu, 4 more needed"
    )
    api.workloads["job-1a2b3c4d-1"] = {
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "message": why}]}
    }
    assert run_pass(api, []) is None  # the attempt starts: its pod is created
    assert run_pass(api, [_gated("job-1a2b3c4d-1")]) is None
    assert _scheduled(api)["reason"] == "Queued" and _scheduled(api)["message"].endswith(f": {why}")
    assert run_pass(api, [_gated("job-1a2b3c4d-1")]) is None
    assert api.workloads_read == ["job-1a2b3c4d-1"]  # the next pass reuses what the read said


def test_a_workload_that_cannot_be_read_leaves_the_reason_out_and_the_pass_goes_on(
    kube: Callable[..., FakeKube],
) -> None:
    api = kube()
    assert run_pass(api, []) is None
    assert run_pass(api, [_gated("job-1a2b3c4d-1")]) is None  # the read is refused (HTTP 429)
    assert _scheduled(api)["reason"] == "Queued"
    assert _scheduled(api)["message"].endswith("held by scheduling gates until their gates are removed")


def test_a_failed_workload_read_keeps_the_reason_the_last_read_gave() -> None:
    from sftjob_operator import lookups

    why = "insufficient unused quota for nvidia.com/gpu in flavor a800, 4 more needed"
    api, cache = FakeKube(), {KEY: ("g", why, 0.0)}  # what the last read said, due again
    started = time.monotonic()
    assert asyncio.run(lookups.queue_reason(api, cache, KEY, "g")) == why  # type: ignore[arg-type]
    assert api.workloads_read == ["g"]  # refused (HTTP 429): the reason stays, read again soon
    assert cache[KEY][1] == why and cache[KEY][2] <= time.monotonic() + lookups.WORKLOAD_RETRY_SECONDS
    assert cache[KEY][2] >= started + lookups.WORKLOAD_RETRY_SECONDS
