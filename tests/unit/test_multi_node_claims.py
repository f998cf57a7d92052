"""A multi-node job mounts every volume on every node: a claim the spec names that no two nodes can mount
fails the job before its first attempt, and a pod still waiting for its volumes ends the attempt instead
of holding the other ranks in the rendezvous for a day."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from sftjob_operator import handlers
from sftjob_operator.classify import Outcome
from sftjob_operator.not_started import MOUNT_GIVE_UP_SECONDS, SANDBOX_CONDITION
from sftjob_operator.observe import JobView, trim_pod
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions
from tests.unit import classify_cases
from tests.unit.reconcile_cases import CTX, NODES, SPEC, UID, condition, observed, pod, then
from tests.unit.test_create_errors import FakeApi, api_error, fake_kube
from tests.unit.test_handlers import FakeKube, fresh_runtime

KEPT = "job-checkpoints"  # the operator's own checkpoint claim of job "job"
TWO_NODES = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
A800: dict[str, Any] = NODES["a800-0"]
NODES_TWO_A800 = {**NODES, "a800-1": {**A800, "metadata": {**A800["metadata"], "name": "a800-1"}}}


def claim_spec(nodes: int = 2, **volumes: str) -> dict[str, Any]:
    """SPEC with the claims ``volumes`` names (field: claim) for checkpoints, output, model or dataset."""
    spec: dict[str, Any] = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": nodes}}
    for field, name in volumes.items():
        volume: dict[str, Any] = {"volume": {"persistentVolumeClaim": {"claimName": name}}}
        if field in ("model", "dataset"):
            volume |= {"path": "llama" if field == "model" else "chats.jsonl"}
        spec[field] = volume
    return spec


def pvc(*modes: str, bound: bool = True) -> dict[str, Any]:
    claim: dict[str, Any] = {"spec": {"accessModes": list(modes)}}
    if bound:
        claim["status"] = {"phase": "Bound", "accessModes": list(modes)}
    return claim


def pods_created(actions: Actions) -> list[str]:
    return [m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"]


def message(actions: Actions, type: str) -> str:
    return next(x.message for x in actions.status.conditions if x.type == type)


def test_a_multi_node_job_reads_its_claims_before_its_first_attempt_and_decides_nothing_until_then() -> None:
    obs = observed(spec=claim_spec(checkpoints="ckpt", model="weights"))
    asked = reconcile(obs, CTX)
    assert asked.read_claims == ["ckpt", "weights"]
    assert not asked.children and not asked.status_changed and not asked.events


def test_a_read_write_once_checkpoint_claim_fails_a_multi_node_job_before_any_pod_naming_the_claim() -> None:
    obs = observed(spec=claim_spec(checkpoints="ckpt"))
    failed = reconcile(replace(obs, claims={"ckpt": pvc("ReadWriteOnce")}), CTX)
    assert failed.status.phase == "Failed" and not pods_created(failed)
    assert condition(failed, "Admitted") == ("False", "InvalidSpec")
    said = message(failed, "Admitted")
    assert said.startswith(
        "spec.checkpoints.volume.persistentVolumeClaim.claimName: claim ckpt has accessModes"
    )
    assert "ReadWriteOnce" in said and "needs ReadWriteMany" in said and "Multi-Attach error" in said


@pytest.mark.parametrize(
    ("field", "modes", "needs"),
    [
        ("output", ("ReadOnlyMany",), "needs ReadWriteMany: the trainer writes there"),
        ("model", ("ReadWriteOncePod",), "needs ReadOnlyMany or ReadWriteMany"),
        ("dataset", ("ReadWriteOnce",), "needs ReadOnlyMany or ReadWriteMany"),
    ],
)
def test_an_output_claim_must_be_writable_on_every_node_and_a_model_or_dataset_claim_readable(
    field: str, modes: tuple[str, ...], needs: str
) -> None:
    obs = observed(spec=claim_spec(2, **{field: "shared"}))
    failed = reconcile(replace(obs, claims={"shared": pvc(*modes), KEPT: None}), CTX)
    assert failed.status.phase == "Failed" and needs in message(failed, "Admitted")
    assert f"spec.{field}.volume.persistentVolumeClaim" in message(failed, "Admitted")


def test_a_checkpoint_claim_an_earlier_job_of_the_name_kept_for_one_node_fails_a_multi_node_job() -> None:
    obs = replace(observed(spec=claim_spec(2)), claims={})  # no checkpoints.volume: the operator's claim
    assert reconcile(obs, CTX).read_claims == [KEPT]
    failed = reconcile(replace(obs, claims={KEPT: pvc("ReadWriteOnce")}), CTX)
    said = message(failed, "Admitted")
    assert failed.status.phase == "Failed" and not pods_created(failed)
    assert said.startswith(f"the checkpoint claim {KEPT}, kept by an earlier job of this name, has")
    assert "delete it to have one made for several nodes, or set spec.checkpoints.volume" in said
    fresh = reconcile(replace(obs, claims={KEPT: None}), CTX)  # none left: the operator makes one
    assert pods_created(fresh) == ["job-1-0", "job-1-1"]


def test_claims_every_node_can_mount_start_the_attempt() -> None:
    obs = observed(spec=claim_spec(checkpoints="ckpt", model="weights", dataset="data"))
    claims = {
        "ckpt": pvc("ReadWriteMany"),
        "weights": pvc("ReadOnlyMany"),
        "data": pvc("ReadWriteOnce", "ReadOnlyMany", bound=False),  # the modes it asks for, until bound
    }
    actions = reconcile(replace(obs, claims=claims), CTX)
    assert pods_created(actions) == ["job-1-0", "job-1-1"] and not actions.read_claims


def test_a_claim_the_operator_could_not_read_holds_no_job_back() -> None:
    obs = observed(spec=claim_spec(checkpoints="ckpt"))
    actions = reconcile(replace(obs, claims={"ckpt": None}), CTX)
    assert pods_created(actions) == ["job-1-0", "job-1-1"]


def test_a_single_node_job_and_a_started_multi_node_job_read_no_claim() -> None:
    single = reconcile(observed(spec=claim_spec(nodes=1, checkpoints="ckpt")), CTX)
    assert pods_created(single) == ["job-1-0"] and not single.read_claims
    obs = observed(spec=claim_spec(checkpoints="ckpt"))
    first = reconcile(replace(obs, claims={"ckpt": pvc("ReadWriteMany")}), CTX)
    later = reconcile(replace(obs, status=first.status.to_patch()), CTX)  # claims are not read again
    assert not later.read_claims and later.status.phase != "Failed"


def test_a_claim_read_is_none_when_the_claim_is_missing_or_forbidden_and_raises_otherwise() -> None:
    claim = pvc("ReadWriteMany")
    kube = fake_kube(FakeApi(existing=claim))
    assert kube.read_claim("team", "ckpt") == claim
    for status in (403, 404):
        assert fake_kube(FakeApi({"read": api_error(status, "no")})).read_claim("team", "ckpt") is None
    with pytest.raises(Exception, match="500"):
        fake_kube(FakeApi({"read": api_error(500, "etcd timeout")})).read_claim("team", "ckpt")


class ClaimsKube(FakeKube):
    def __init__(self, claims: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.claims, self.created = claims, list[str]()
        self.claims_read: list[str] = []

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.claims_read.append(name)
        return self.claims.get(name)

    def ensure(self, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["kind"])
        return True


@pytest.fixture
def claims_kube(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, dict[str, Any]]], ClaimsKube]:
    def make(claims: dict[str, dict[str, Any]]) -> ClaimsKube:
        fake = ClaimsKube(claims)
        monkeypatch.setattr(handlers.Runtime, "kube", fake, raising=False)
        return fake

    fresh_runtime(monkeypatch)
    return make


def test_the_handler_reads_the_claims_and_fails_the_job_in_the_same_pass(
    claims_kube: Callable[[dict[str, dict[str, Any]]], ClaimsKube],
) -> None:
    api = claims_kube({"ckpt": pvc("ReadWriteOnce")})
    meta = {"namespace": "team", "name": "job", "uid": UID, "generation": 1, "resourceVersion": "1"}
    job = JobView.of({"metadata": meta, "spec": claim_spec(checkpoints="ckpt"), "status": {}})
    nodes = {name: [node] for name, node in NODES.items()}
    asyncio.run(handlers._pass(job, {}, nodes))  # type: ignore[arg-type]
    assert api.claims_read == ["ckpt"] and api.status["phase"] == "Failed" and "Pod" not in api.created
    assert ("Warning", "InvalidSpec") in api.events


def _waiting_for_volumes(seconds: float) -> dict[str, Any]:
    stuck = classify_cases.pod(
        "Pending",
        state=classify_cases.waiting("ContainerCreating"),
        kubelet_took_it_seconds_ago=seconds,
    )
    stuck["status"]["conditions"].append({"type": SANDBOX_CONDITION, "status": "False"})
    return trim_pod(stuck)  # as the watch index and a direct read hand it to a pass


def test_a_multi_node_pod_still_waiting_for_its_volumes_after_ten_minutes_is_a_storage_error() -> None:
    give_up = MOUNT_GIVE_UP_SECONDS
    early = classify_cases.classify(_waiting_for_volumes(give_up - 30), mount_give_up_seconds=give_up)
    assert early.outcome is Outcome.RUNNING
    late = classify_cases.classify(_waiting_for_volumes(give_up + 30), mount_give_up_seconds=give_up)
    assert (late.outcome, late.failure_class) == (Outcome.FAILED, "StorageError")
    assert "Multi-Attach error" in late.message and "has not started in 10 min" in late.message


def test_a_single_node_pod_mounting_and_a_multi_node_pod_pulling_its_image_are_waited_for() -> None:
    assert classify_cases.classify(_waiting_for_volumes(3600)).outcome is Outcome.RUNNING  # no give-up set
    pulling = _waiting_for_volumes(3600)
    pulling["status"]["conditions"][-1]["status"] = "True"  # the sandbox is up: the image is being pulled
    pulled = classify_cases.classify(pulling, mount_give_up_seconds=MOUNT_GIVE_UP_SECONDS)
    assert pulled.outcome is Outcome.RUNNING


def test_a_two_node_attempt_with_a_rank_stuck_mounting_ends_and_its_running_rank_goes_quickly() -> None:
    obs = replace(observed(spec=TWO_NODES), nodes=NODES_TWO_A800, claims={KEPT: None})
    first = reconcile(obs, CTX)
    stuck = pod(rank=1, phase="Pending", node="a800-1", status={
        "startTime": "2026-01-01T11:45:00Z",
        "conditions": [{"type": SANDBOX_CONDITION, "status": "False"}],
        "containerStatuses": [{"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}],
    })  # fmt: skip
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), stuck]), CTX)
    record = ended.status.attempts[0]
    assert (record.reason, record.node) == ("StorageError", "a800-1")
    assert ended.quick_delete_pods == ["job-1-0", "job-1-1"] and not ended.delete_pods
