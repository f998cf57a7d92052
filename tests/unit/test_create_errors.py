"""Creating, patching and deleting children through a fake client: what each API answer means, and that
every call has a timeout and every delete a uid precondition."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ReadTimeoutError

from sftjob import constants as c
from sftjob.job_status import SFTJobStatus
from sftjob_operator import kube as kube_module
from sftjob_operator.kube import REQUEST_TIMEOUT, CreateFailed, Forbidden, Kube, NameTaken, Rejected

JOB_UID = "uid-new"


def api_error(status: int, message: str) -> ApiException:
    return ApiException(status=status, reason="reason", body=json.dumps({"message": message}))


class FakeApi:
    """Any ``<verb>_namespaced_<kind>`` call is recorded; ``errors[verb]`` is raised; a read returns
    ``existing``."""

    def __init__(self, errors: dict[str, Exception] | None = None, existing: dict[str, Any] | None = None):
        self.errors, self.existing = errors or {}, existing or {}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, args, kwargs))
            error = self.errors.get(method.split("_")[0])
            if error is not None:
                raise error
            if method.startswith("read_"):
                return SimpleNamespace(data=json.dumps(self.existing).encode())
            return {"metadata": {"resourceVersion": "2"}}

        return call

    def verbs(self) -> list[str]:
        return [method.split("_")[0] for method, _, _ in self.calls]


def fake_kube(api: FakeApi) -> Kube:
    kube = Kube(client.ApiClient())
    kube.core = kube.rbac = kube.custom = cast(Any, api)
    return kube


def owned_by(uid: str | None) -> dict[str, Any]:
    refs = [] if uid is None else [{"kind": "SFTJob", "name": "job", "uid": uid, "controller": True}]
    return {"metadata": {"name": "job-config", "namespace": "team", "ownerReferences": refs}}


def config_map(owner: str | None = JOB_UID) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", **owned_by(owner), "data": {}}


def test_a_create_answered_with_a_server_error_is_a_create_failure_that_names_the_status() -> None:
    kube = fake_kube(FakeApi({"create": api_error(500, 'failed calling webhook "policy.example.com"')}))
    with pytest.raises(CreateFailed) as raised:
        kube.ensure(config_map())
    assert not isinstance(raised.value, Forbidden)
    assert str(raised.value) == 'ConfigMap job-config: failed calling webhook "policy.example.com" (HTTP 500)'


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (api_error(403, "exceeded quota: gpus"), Forbidden),
        (api_error(429, "Too many requests, please try again later."), CreateFailed),
        (api_error(503, "the server is currently unable to handle the request"), CreateFailed),
        (
            ReadTimeoutError(cast(Any, None), "/api/v1/namespaces/team/configmaps", "Read timed out."),
            CreateFailed,
        ),
        (api_error(422, "data: Too long"), Rejected),
    ],
)
def test_every_create_failure_but_an_invalid_manifest_may_pass_later(error: Exception, kind: type) -> None:
    with pytest.raises(kind):
        fake_kube(FakeApi({"create": error})).ensure(config_map())


def test_a_child_of_this_job_that_exists_is_taken_and_one_that_follows_the_attempt_is_patched() -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by(JOB_UID))
    assert fake_kube(api).ensure(config_map()) is False
    assert api.verbs() == ["create", "read", "patch"]


def test_a_config_map_that_exists_gets_the_rendered_data_whole_so_keys_the_new_render_lacks_go() -> None:
    stale = {"config.json": "attempt 6", "config-A40.json": "attempt 6", "config-L40S.json": "attempt 6"}
    existing = {**owned_by(JOB_UID), "data": stale}
    api = FakeApi({"create": api_error(409, "already exists")}, existing=existing)
    fake_kube(api).ensure({**config_map(), "data": {"config.json": "attempt 7"}})
    _, (_, _, body), _ = api.calls[-1]
    assert isinstance(body, list)  # the client sends a list as application/json-patch+json
    assert apply_json_patch(existing, body)["data"] == {"config.json": "attempt 7"}


def test_a_role_that_exists_gets_the_rendered_rules_whole() -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by(JOB_UID))
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"], "resourceNames": ["job-2-0"]}]
    fake_kube(api).ensure(
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", **owned_by(JOB_UID), "rules": rules}
    )
    _, (_, _, body), _ = api.calls[-1]
    assert apply_json_patch({**owned_by(JOB_UID), "rules": []}, body)["rules"] == rules


def apply_json_patch(target: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 for what ``ensure`` sends: "add" of a top-level field (which replaces a field there)."""
    result = dict(target)
    for op in operations:
        assert op["op"] == "add" and op["path"].count("/") == 1
        result[op["path"][1:]] = op["value"]
    return result


@pytest.mark.parametrize("owner", ["uid-old", None])
def test_an_object_of_the_childs_name_that_is_not_this_jobs_is_neither_taken_nor_patched(
    owner: str | None,
) -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by(owner))
    with pytest.raises(NameTaken) as raised:
        fake_kube(api).ensure(config_map())
    assert api.verbs() == ["create", "read"]
    assert str(raised.value).startswith("ConfigMap job-config already exists and belongs to ")
    assert (owner or "no SFTJob") in str(raised.value)


def claim(owner: str | None) -> dict[str, Any]:
    """The checkpoint claim as the builders make it: owned by the job, or (``keepOnDelete``) by no one,
    the job's uid in its labels either way."""
    meta = owned_by(owner)["metadata"] | {"labels": {c.LABEL_CONTROLLER_UID: JOB_UID}}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": {}}


def being_deleted(existing: dict[str, Any]) -> dict[str, Any]:
    meta = existing["metadata"] | {
        "deletionTimestamp": "2026-01-01T12:00:00Z",
        "finalizers": [PVC_PROTECTION],
    }
    return {**existing, "metadata": meta}


PVC_PROTECTION = "kubernetes.io/pvc-protection"


@pytest.mark.parametrize("kept", [True, False], ids=["kept-on-delete", "owned"])
def test_a_claim_kept_by_an_earlier_job_is_reused_whatever_this_jobs_keep_on_delete(kept: bool) -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by(None))
    assert (
        fake_kube(api).ensure(claim(None if kept else JOB_UID)) is False
    )  # its checkpoints are resumed from
    assert api.verbs() == ["create", "read"]


def test_a_job_that_keeps_its_claim_takes_one_it_kept_itself() -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=claim(None))
    assert fake_kube(api).ensure(claim(None)) is False


@pytest.mark.parametrize("kept", [True, False], ids=["kept-on-delete", "owned"])
def test_the_claim_of_a_deleted_job_that_did_not_keep_it_is_waited_for_not_taken(kept: bool) -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by("uid-old"))
    with pytest.raises(NameTaken) as raised:
        fake_kube(api).ensure(claim(None if kept else JOB_UID))
    assert "uid uid-old" in str(raised.value) and api.verbs() == ["create", "read"]


@pytest.mark.parametrize("owner", [None, "uid-old", JOB_UID], ids=["ownerless", "earlier-jobs", "this-jobs"])
@pytest.mark.parametrize("kept", [True, False], ids=["kept-on-delete", "owned"])
def test_a_claim_being_deleted_is_waited_for_so_no_pod_is_made_to_wait_on_it_forever(
    owner: str | None, kept: bool
) -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=being_deleted(owned_by(owner)))
    with pytest.raises(NameTaken) as raised:
        fake_kube(api).ensure(claim(None if kept else JOB_UID))
    said = str(raised.value)
    assert "is being deleted" in said and said.endswith("created again once it is gone")
    assert ("(owner uid uid-old)" in said) == (owner == "uid-old")  # whose, where it is another job's


def test_this_jobs_own_pod_being_deleted_is_taken_as_there_for_the_pass_to_judge() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", **owned_by(JOB_UID), "spec": {}}
    api = FakeApi({"create": api_error(409, "already exists")}, existing=being_deleted(owned_by(JOB_UID)))
    assert fake_kube(api).ensure(pod) is False


def test_the_jobs_uids_are_listed_as_metadata_only_page_by_page() -> None:
    pages = [
        {"metadata": {"continue": "next"}, "items": [{"metadata": {"name": "a", "uid": "uid-a"}}]},
        {"metadata": {}, "items": [{"metadata": {"name": "b", "uid": "uid-b"}}]},
    ]

    class Lists(FakeApi):
        def list_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> SimpleNamespace:
            self.calls.append(("list", args, kwargs))
            return SimpleNamespace(data=json.dumps(pages[len(self.calls) - 1]).encode())

    api = Lists()
    assert fake_kube(api).job_uids("team") == {"uid-a", "uid-b"}
    assert [kwargs["_continue"] for _, _, kwargs in api.calls] == [None, "next"]
    for _, args, kwargs in api.calls:
        assert args[2:] == ("team", "sftjobs") and kwargs["_request_timeout"] == REQUEST_TIMEOUT
        assert kwargs["_headers"]["Accept"].startswith("application/json;as=PartialObjectMetadataList;")


def test_deletes_are_conditioned_on_the_uid_and_a_replaced_or_gone_pod_is_said_to_be_gone() -> None:
    assert fake_kube(FakeApi()).delete_pod("team", "job-1-0", "pod-uid") is True
    assert fake_kube(FakeApi()).delete_job("team", "job", JOB_UID) is True
    for status in (404, 409):
        api = FakeApi({"delete": api_error(status, "gone or replaced")})
        kube = fake_kube(api)
        assert kube.delete_pod("team", "job-1-0", "pod-uid") is False
        assert kube.delete_job("team", "job", JOB_UID) is False
        pod_options, job_options = (kwargs["body"] for _, _, kwargs in api.calls)
        assert pod_options.preconditions.uid == "pod-uid"
        assert (job_options.preconditions.uid, job_options.propagation_policy) == (JOB_UID, "Background")
    with pytest.raises(ApiException):
        fake_kube(FakeApi({"delete": api_error(500, "etcd timeout")})).delete_pod(
            "team", "job-1-0", "pod-uid"
        )


def merge(target: Any, patch: Any) -> Any:
    """What the API server does with a JSON merge patch (RFC 7386)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge(merged.get(key), value)
    return merged


def test_a_status_write_removes_the_fields_the_new_status_no_longer_has_at_any_depth() -> None:
    old = SFTJobStatus.model_validate({
        "phase": "Running", "attempt": 1,
        "gpu": {"summary": "1xA40", "type": "A40", "product": "NVIDIA-A40", "count": 1, "nodes": ["n1"]},
        "progress": {"step": 500, "totalSteps": 1000, "loss": 1.2, "etaSeconds": 3600, "summary": "500/1000"},
        "lastCheckpoint": {"step": 400, "path": "/ckpt/checkpoint-400", "evalLoss": 1.1},
    })  # fmt: skip
    new = SFTJobStatus.model_validate({
        "phase": "Restarting", "attempt": 2, "gpu": {"summary": "1xA40|L40S", "count": 1, "nodes": []},
        "progress": {"step": 450, "totalSteps": 1000, "summary": "450/1000"},
        "lastCheckpoint": {"step": 450, "path": "/ckpt/checkpoint-450"},
    })  # fmt: skip
    api = FakeApi()
    held = {**old.to_patch(), "kopf": {"progress": {}}}  # a field of someone else's stays theirs
    fake_kube(api).write_status("team", "job", "1", held, new)
    [(_, args, _)] = api.calls
    assert merge(held, args[-1]["status"]) == {**new.to_patch(), "kopf": {"progress": {}}}


def test_every_call_has_a_timeout() -> None:
    api = FakeApi(existing=owned_by(JOB_UID))
    kube = fake_kube(api)
    kube.ensure(config_map())
    kube.read_pod("team", "job-1-0")
    kube.delete_pod("team", "job-1-0", "pod-uid")
    kube.delete_job("team", "job", JOB_UID)
    kube.post_event({"metadata": {"namespace": "team"}, "reason": "Created"})
    kube.write_status("team", "job", "1", {}, SFTJobStatus())
    api.errors = {"create": api_error(409, "already exists")}
    kube.ensure(config_map())
    assert len(api.calls) == 9
    assert all(kwargs.get("_request_timeout") == REQUEST_TIMEOUT for _, _, kwargs in api.calls)


def test_the_client_keeps_its_connections_alive_with_tcp_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "load_incluster_config", lambda: None)
    api = kube_module.connect()
    assert api.configuration.keep_alive is True
    assert api.configuration.connection_pool_maxsize == kube_module.API_CONCURRENCY
