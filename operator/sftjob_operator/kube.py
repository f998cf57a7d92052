"""Thin Kubernetes API I/O for the reconcile's actions, through the official client.

Children are created by name and a 409 means "already there": ConfigMaps and Roles, whose content
follows the attempt, are then patched to the rendered content; everything else is left as it is.
The status is written with the job's ``resourceVersion`` as a precondition, so a pass that decided
from a stale view loses with a 409 and the next pass decides again from fresh state.

The client blocks, so the reconcile loops call it through :meth:`Kube.run` on the operator's own
thread pool, as wide as the client's HTTP connection pool (``API_CONCURRENCY``), rather than through
asyncio's small default executor (which kopf shares).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from sftjob import constants as c
from sftjob.job_status import SFTJobStatus

log = logging.getLogger(__name__)
Manifest = dict[str, Any]
T = TypeVar("T")
# Concurrent API calls: the client's HTTP connections and the threads that make the calls.
API_CONCURRENCY = 32
# Kinds whose content the operator keeps equal to what it renders (the attempt's plan, its pod names).
FOLLOWS_ATTEMPT = frozenset({"ConfigMap", "Role"})


class Conflict(Exception):
    """The job changed since the pass read it (at ``resource_version``): decide again from fresh state."""

    def __init__(self, resource_version: str) -> None:
        super().__init__(resource_version)
        self.resource_version = resource_version


class Rejected(Exception):
    """The API server refused a child as invalid (HTTP 422): retrying the same manifest cannot help."""


class Forbidden(Exception):
    """The API server refused to create a child now (HTTP 403: a ResourceQuota, Pod Security admission,
    a webhook): the same manifest may be admitted later, so it is retried with a backoff."""


def connect() -> client.ApiClient:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    settings = client.Configuration.get_default_copy()
    settings.connection_pool_maxsize = API_CONCURRENCY
    return client.ApiClient(settings)


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.executor = ThreadPoolExecutor(API_CONCURRENCY, thread_name_prefix="sftjob-api")

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` (one of the blocking methods below) on the API threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(call, *args))

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it now (camelCase), or None when it does not exist."""
        try:
            response: Any = self.core.read_namespaced_pod(name, namespace, _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return cast(dict[str, Any], json.loads(response.data))

    def write_status(
        self, namespace: str, name: str, resource_version: str, old: Mapping[str, Any], new: SFTJobStatus
    ) -> str:
        """Merge-patch the status subresource (keys the new status dropped are set to null); returns the
        job's new resourceVersion."""
        body = new.to_patch()
        dropped = {k: None for k in old if k in _STATUS_KEYS and k not in body}
        patch = {"metadata": {"resourceVersion": resource_version}, "status": {**body, **dropped}}
        try:
            written = self.custom.patch_namespaced_custom_object_status(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, name, patch
            )
        except ApiException as err:
            if err.status == 409:
                raise Conflict(resource_version) from err
            raise
        return str(cast(dict[str, Any], written)["metadata"]["resourceVersion"])

    def ensure(self, manifest: Manifest) -> bool:
        """Create the child; True when it was created now, False when it already existed."""
        kind, meta = manifest["kind"], manifest["metadata"]
        create, patch = self._verbs(kind)
        try:
            create(meta["namespace"], manifest)
            return True
        except ApiException as err:
            if err.status == 422:
                raise Rejected(f"{kind} {meta['name']}: {_message(err)}") from err
            if err.status == 403:
                raise Forbidden(f"{kind} {meta['name']}: {_message(err)}") from err
            if err.status != 409:
                raise
        if kind in FOLLOWS_ATTEMPT:
            patch(meta["name"], meta["namespace"], manifest)
        return False

    def post_event(self, manifest: Manifest) -> None:
        """Events are a courtesy to whoever reads them: one that cannot be posted is logged, not raised."""
        try:
            body: Any = manifest  # the client sends a dict as it is
            self.core.create_namespaced_event(body["metadata"]["namespace"], body, _preload_content=False)
        except ApiException as err:
            log.warning("could not post event %s: %s", manifest["reason"], _message(err))

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    def delete_job(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, name, propagation_policy="Background"
            )
        except ApiException as err:
            if err.status != 404:
                raise

    def _verbs(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The client's create and patch calls for a child kind (``create_namespaced_config_map``...)."""
        api = self.rbac if kind in ("Role", "RoleBinding") else self.core
        snake = _SNAKE[kind]
        return getattr(api, f"create_namespaced_{snake}"), getattr(api, f"patch_namespaced_{snake}")


_SNAKE = {
    "ConfigMap": "config_map",
    "Pod": "pod",
    "Service": "service",
    "ServiceAccount": "service_account",
    "PersistentVolumeClaim": "persistent_volume_claim",
    "Role": "role",
    "RoleBinding": "role_binding",
}
_STATUS_KEYS = frozenset(f.alias or n for n, f in SFTJobStatus.model_fields.items())


def _message(err: ApiException) -> str:
    try:
        return str(json.loads(err.body or "{}").get("message") or err.reason)
    except ValueError:
        return str(err.reason)
