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


def test_a_claim_kept_on_delete_has_no_owner_so_any_claim_of_its_name_is_it() -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by("uid-old"))
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **owned_by(None), "spec": {}}
    assert fake_kube(api).ensure(claim) is False
    assert api.verbs() == ["create"]


def test_a_claim_kept_by_an_earlier_job_is_reused_by_one_that_does_not_keep_its_own() -> None:
    api = FakeApi({"create": api_error(409, "already exists")}, existing=owned_by(None))
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", **owned_by(JOB_UID), "spec": {}}
    assert fake_kube(api).ensure(claim) is False  # its checkpoints are resumed from, not refused
    assert api.verbs() == ["create", "read"]


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
