"""Thin Kubernetes API I/O for the reconcile's actions, through the official client.

Children are created by name. A 409 means "already there" once the object is read and its controller
is checked to be this job (the uid in its ownerReference): an object of that name that belongs to
someone else (an earlier SFTJob of the same name that the garbage collector is still removing) is left
alone and the create is tried again later. So is one the API server is deleting: a checkpoint claim
that ``pvc-protection`` keeps while an earlier job's pods stop would strand a pod created to use it. A
claim kept on delete has no owner, and is this job's whatever job made it, unless another one controls
it. A ConfigMap or Role of this job, whose content follows the attempt, then gets the rendered content
with a JSON patch that replaces it whole (a strategic merge never removes a key of a ConfigMap's
``data``: a card that no longer fits would keep its stale plan); everything else is left as it is. Any
other failure to create (403, 429, 5xx, a timeout) is :class:`CreateFailed`, which the caller says in
the job's status and retries; only a 422 (:class:`Rejected`) is final.

The status is written with the job's ``resourceVersion`` as a precondition, so a pass that decided
from a stale view loses with a 409 and the next pass decides again from fresh state. It is a merge
patch that nulls every field, at any depth, that the new status no longer has (a merge patch keeps
what it does not name). Deletes carry the
object's uid as a precondition, so they never remove a newer object that took the name meanwhile.

Every call has a timeout and the connections TCP keepalive: a call on a connection that died without
a word (an API server or load balancer restarted) fails within the timeout instead of holding one of
the API threads for the kernel's ~15 minutes of retransmissions. The client blocks, so the reconcile
loops call it through :meth:`Kube.run` on the operator's own thread pool, as wide as the client's HTTP
connection pool (``API_CONCURRENCY``), rather than through asyncio's small default executor (which
kopf shares).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar, cast

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from sftjob import constants as c
from sftjob.job_status import SFTJobStatus
from sftjob_operator.observe import controller_uid

log = logging.getLogger(__name__)
Manifest = dict[str, Any]
T = TypeVar("T")
# Concurrent API calls: the client's HTTP connections and the threads that make the calls.
API_CONCURRENCY = 32
# Every call's (connect, read) timeouts in seconds. Admission webhooks answer within 30 s at most; a
# create that timed out is tried again, and finds its object (409) if it was made after all.
REQUEST_TIMEOUT = (5.0, 30.0)
# Kinds whose content the operator keeps equal to what it renders (the attempt's plan, its pod names),
# and the field that holds it.
FOLLOWS_ATTEMPT = {"ConfigMap": "data", "Role": "rules"}
# Listing SFTJobs to find the ones gone (``job_uids``): metadata only, this many to a page.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
JOB_LIST_PAGE = 500


class Conflict(Exception):
    """The job changed since the pass read it (at ``resource_version``): decide again from fresh state."""

    def __init__(self, resource_version: str) -> None:
        super().__init__(resource_version)
        self.resource_version = resource_version


class Rejected(Exception):
    """The API server refused a child as invalid (HTTP 422): retrying the same manifest cannot help."""


class CreateFailed(Exception):
    """A child could not be created now (HTTP 403, 429, 5xx, a timeout, its name taken): the same
    manifest may be created later, so it is retried with a backoff."""


class Forbidden(CreateFailed):
    """HTTP 403: a ResourceQuota, Pod Security admission, a webhook, missing RBAC."""


class NameTaken(CreateFailed):
    """An object of the child's name exists and is not this job's: retried once it is gone."""


def connect() -> client.ApiClient:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    settings = client.Configuration.get_default_copy()
    settings.connection_pool_maxsize = API_CONCURRENCY
    settings.keep_alive = True  # TCP keepalive with client-go's timings (probes after 30 s idle)
    return client.ApiClient(settings)


class _Verbs(NamedTuple):
    """The client's calls for one child kind (``create_namespaced_config_map``...)."""

    create: Callable[..., Any]
    read: Callable[..., Any]
    patch: Callable[..., Any]


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.networking = client.NetworkingV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.executor = ThreadPoolExecutor(API_CONCURRENCY, thread_name_prefix="sftjob-api")
        self.workloads_forbidden = False  # said once: a warning per pass would flood the log

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` (one of the blocking methods below) on the API threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(call, *args))

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API server has it now (camelCase), or None when it does not exist."""
        try:
            response: Any = self.core.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return cast(dict[str, Any], json.loads(response.data))

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The PersistentVolumeClaim ``name`` (camelCase), or None where there is none to read: it does not
        exist (yet), or the operator may not get it."""
        try:
            response: Any = self.core.read_namespaced_persistent_volume_claim(
                name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as err:
            if err.status in (403, 404):
                return None
            raise
        return cast(dict[str, Any], json.loads(response.data))

    def read_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Kueue's Workload ``name`` (v1beta2: Kueue 0.15 and later), or None where there is none to read:
        not created yet, Kueue not installed or older, or the operator not allowed to get Workloads."""
        try:
            found: Any = self.custom.get_namespaced_custom_object(
                c.KUEUE_API_GROUP, c.KUEUE_API_VERSION, namespace, c.KUEUE_WORKLOADS, name,
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except ApiException as err:
            if err.status not in (403, 404):
                raise
            if err.status == 403 and not self.workloads_forbidden:
                self.workloads_forbidden = True
                log.warning(
                    "may not get Kueue's Workloads (%s/%s): Queued messages go without Kueue's reason;"
                    " grant get on workloads.kueue.x-k8s.io (the chart does)", namespace, name
                )  # fmt: skip
            return None
        return cast(dict[str, Any], found)

    def job_uids(self, namespace: str) -> set[str]:
        """The uids of the SFTJobs in ``namespace`` now: a consistent list of their metadata only
        (``PartialObjectMetadataList``), in pages, without their specs and statuses."""
        uids: set[str] = set()
        token: str | None = None
        while True:
            response: Any = self.custom.list_namespaced_custom_object(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, limit=JOB_LIST_PAGE, _continue=token,
                _headers={"Accept": METADATA_LIST}, _preload_content=False, _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
            page = json.loads(response.data)
            uids |= {str(item["metadata"]["uid"]) for item in page.get("items") or []}
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return uids

    def write_status(
        self, namespace: str, name: str, resource_version: str, old: Mapping[str, Any], new: SFTJobStatus
    ) -> str:
        """Merge-patch the status subresource from ``old`` (as the job holds it) to ``new``; returns the
        job's resourceVersion after the write (the one it had when the write changed nothing)."""
        ours = {k: v for k, v in old.items() if k in _STATUS_KEYS}
        patch = {
            "metadata": {"resourceVersion": resource_version},
            "status": merge_patch(ours, new.to_patch()),
        }
        try:
            written = self.custom.patch_namespaced_custom_object_status(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, name, patch, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as err:
            if err.status == 409:
                raise Conflict(resource_version) from err
            raise
        return str(cast(dict[str, Any], written)["metadata"]["resourceVersion"])

    def ensure(self, manifest: Manifest) -> bool:
        """Create the child; True when it was created now, False when this job's child of that name
        already existed. Raises :class:`Rejected` (422) or :class:`CreateFailed` (anything else)."""
        kind, meta = manifest["kind"], manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        verbs = self._verbs(kind)
        with _create_errors(f"{kind} {name}"):
            try:
                verbs.create(namespace, manifest, _request_timeout=REQUEST_TIMEOUT)
                return True
            except ApiException as err:
                if err.status != 409:
                    raise
            response = verbs.read(name, namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            _check_owner(kind, name, _job_uid(manifest), json.loads(response.data))
            field = FOLLOWS_ATTEMPT.get(kind)
            if field is not None:  # a list body goes out as a JSON patch; "add" replaces a field it finds
                content = [{"op": "add", "path": f"/{field}", "value": manifest[field]}]
                verbs.patch(name, namespace, content, _request_timeout=REQUEST_TIMEOUT)
        return False

    def post_event(self, manifest: Manifest) -> None:
        """Events are a courtesy to whoever reads them: one that cannot be posted is logged, not raised."""
        try:
            body: Any = manifest  # the client sends a dict as it is
            self.core.create_namespaced_event(
                body["metadata"]["namespace"], body, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except (ApiException, HTTPError) as err:
            log.warning("could not post event %s: %s", manifest["reason"], _describe(err))

    def delete_pod(
        self, namespace: str, name: str, uid: str, grace_period_seconds: int | None = None
    ) -> bool:
        """Delete the pod ``name`` if it is still the one with ``uid``, within its own grace period or
        ``grace_period_seconds`` (0: at once, for a pod on a lost node). Returns False when no pod with
        ``uid`` exists: none of that name (404), or a newer pod took the name (409, the precondition
        failed). The index may still hold it, for good if its DELETED event fell in a watch gap."""
        options = client.V1DeleteOptions(
            grace_period_seconds=grace_period_seconds, preconditions=client.V1Preconditions(uid=uid)
        )
        try:
            self.core.delete_namespaced_pod(name, namespace, body=options, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as err:
            if err.status not in (404, 409):
                raise
            log.debug("pod %s/%s (uid %s): nothing to delete (HTTP %d)", namespace, name, uid, err.status)
            return False
        return True

    def release_pod(self, namespace: str, name: str, uid: str) -> None:
        """Take Kueue's finalizer off the pod ``name`` if it is still the one with ``uid`` (a JSON patch
        that tests the uid); a pod gone or changed meanwhile is left to the next pass."""
        pod = self.read_pod(namespace, name)
        if pod is None or pod["metadata"].get("uid") != uid:
            return
        finalizers = pod["metadata"].get("finalizers") or []
        kept = [f for f in finalizers if f != c.KUEUE_FINALIZER]
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/uid", "value": uid},
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "replace", "path": "/metadata/finalizers", "value": kept},
        ]
        try:
            self.core.patch_namespaced_pod(name, namespace, patch, _request_timeout=REQUEST_TIMEOUT)
        except ApiException as err:
            if err.status not in (404, 409, 422):
                raise
            log.debug(
                "pod %s/%s: Kueue's finalizer left for the next pass (HTTP %d)", namespace, name, err.status
            )

    def delete_job(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the job with ``uid`` (its children go in the background); never a job created again
        under its name meanwhile. Returns False when no job with ``uid`` exists (404, or 409: a newer job
        took the name): the index entry is a ghost."""
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid), propagation_policy="Background"
        )
        try:
            self.custom.delete_namespaced_custom_object(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, name, body=options,
                _request_timeout=REQUEST_TIMEOUT,
            )  # fmt: skip
        except ApiException as err:
            if err.status not in (404, 409):
                raise
            return False
        return True

    def _verbs(self, kind: str) -> _Verbs:
        api, snake = getattr(self, _API.get(kind, "core")), _SNAKE[kind]
        return _Verbs(*(getattr(api, f"{verb}_namespaced_{snake}") for verb in ("create", "read", "patch")))


_API = {"Role": "rbac", "RoleBinding": "rbac", "NetworkPolicy": "networking"}  # the others: core
_SNAKE = {
    "ConfigMap": "config_map",
    "Pod": "pod",
    "Service": "service",
    "ServiceAccount": "service_account",
    "PersistentVolumeClaim": "persistent_volume_claim",
    "Role": "role",
    "RoleBinding": "role_binding",
    "NetworkPolicy": "network_policy",
}
_STATUS_KEYS = frozenset(f.alias or n for n, f in SFTJobStatus.model_fields.items())


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: ``new`` with a null for every key,
    at any depth, that ``old`` has and ``new`` lacks (a list is replaced whole, as merge patches do)."""
    patch = dict(new)
    for key, value in old.items():
        if key not in new:
            patch[key] = None
        elif isinstance(value, Mapping) and isinstance(new[key], Mapping):
            patch[key] = merge_patch(value, new[key])
    return patch


def _job_uid(manifest: Manifest) -> str:
    """The uid of the job ``manifest`` is a child of: its controller's, or (a claim kept on delete has no
    owner) the one in its labels."""
    labels = manifest["metadata"].get("labels") or {}
    return controller_uid(manifest) or str(labels.get(c.LABEL_CONTROLLER_UID, ""))


def _check_owner(kind: str, name: str, owner: str, existing: Mapping[str, Any]) -> None:
    """Raise :class:`NameTaken` unless ``existing`` (the object a create answered 409 for) is controlled
    by the job with uid ``owner``, or is a checkpoint claim with no owner: one an earlier job of this
    name kept on delete, whose checkpoints this job resumes from whatever its own ``keepOnDelete``.
    Anything but a pod that is being deleted is refused too, until it is gone: a pod created to use it
    would wait for it forever (an earlier job's claim, which ``pvc-protection`` keeps until that job's
    pods have stopped). This job's own pod being deleted is no such thing: the pass judges it once gone."""
    theirs = controller_uid(existing)
    if kind != "Pod" and (existing.get("metadata") or {}).get("deletionTimestamp"):
        whose = f" (owner uid {theirs})" if theirs is not None and theirs != owner else ""
        raise NameTaken(
            f"{kind} {name} already exists and is being deleted{whose}: created again once it is gone"
        )
    if theirs == owner or (theirs is None and kind == "PersistentVolumeClaim"):
        return
    if theirs is None:
        raise NameTaken(
            f"{kind} {name} already exists and belongs to no SFTJob: delete it or give the job another name"
        )
    raise NameTaken(
        f"{kind} {name} already exists and belongs to another owner (uid {theirs}), such as an earlier"
        " SFTJob of this name still being deleted: created once that one is gone"
    )


@contextmanager
def _create_errors(what: str) -> Iterator[None]:
    """The API and connection errors of creating ``what`` as :class:`Rejected` (422) or
    :class:`CreateFailed` (anything else), each saying what failed and the HTTP status."""
    try:
        yield
    except ApiException as err:
        text = f"{what}: {_describe(err)}"
        if err.status == 422:
            raise Rejected(text) from err
        if err.status == 403:
            raise Forbidden(text) from err
        raise CreateFailed(text) from err
    except HTTPError as err:  # urllib3: a timeout, a refused or reset connection
        raise CreateFailed(f"{what}: {_describe(err)}") from err


def _describe(err: ApiException | HTTPError) -> str:
    """The API server's message and the HTTP status, or what the connection said."""
    if not isinstance(err, ApiException):
        return f"{type(err).__name__}: {err}"
    try:
        message = json.loads(err.body or "{}").get("message") or err.reason
    except ValueError:
        message = err.reason
    return f"{message} (HTTP {err.status})"
