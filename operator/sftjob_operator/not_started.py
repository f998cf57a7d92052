"""Trainer pods bound to a node whose container has not started, and when that is a failure of the attempt.

The kubelet shows why a container waits (its image cannot be had or keeps failing to pull, a Secret or
ConfigMap is missing, the runtime cannot create it) and whether the pod's sandbox, its volumes and network,
is ready; each way has its own give-up time, counted from when the kubelet took the pod. Pure functions over
the pod as the API server returns it; :mod:`sftjob_operator.classify` turns their verdict into the pod's
classification.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sftjob.failures import FailureClass
from sftjob_operator.observe import SANDBOX_CONDITION
from sftjob_operator.pods import CONTAINER
from sftjob_operator.termination import gpu_runtime_failure

Obj = Mapping[str, Any]
Failure = tuple[FailureClass, str]  # the class, and the message that says why

# Waiting reasons of a container that cannot start. An image the kubelet will never pull ends the attempt
# at once, and so does a pull whose error says the image cannot be had (no such image or tag, no access).
IMAGE_UNUSABLE = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# (Not a bare "not found" or "denied": a layer that failed to unpack on the node says those too.)
IMAGE_PULL_FINAL = re.compile(
    r"failed to resolve reference .*: not found|code = NotFound|manifest unknown|name unknown"
    r"|repository does not exist|pull access denied|\bdenied: |unauthorized|forbidden|\b40[134]\b",
    re.IGNORECASE,
)
# A 401/403 while downloading a layer is no verdict on the image: a registry token that expired during a
# long download, a pre-signed CDN URL that did. Only the reference and manifest stages say it cannot be had.
IMAGE_LAYER_DOWNLOAD = re.compile(r"/blobs/|failed to copy", re.IGNORECASE)
# Other pull failures (a registry's 429 or 5xx, a timeout) may pass: the kubelet shows ImagePullBackOff right
# after the first failed pull and retries with a backoff growing to 5 minutes. Once the pod has failed to
# start this long after the kubelet took it (a large image's pull included), the attempt ends as a
# NetworkError: restarted with a backoff and counted against maxRestarts, never failed for good. ErrImagePull
# itself, one failed pull between two back-offs, is always given the kubelet's retry.
IMAGE_PULL_BACKOFF = "ImagePullBackOff"
IMAGE_PULL_WAITING = frozenset({"ErrImagePull", IMAGE_PULL_BACKOFF})
IMAGE_PULL_GIVE_UP_SECONDS = 900.0
# A Secret, ConfigMap or key the pod refers to is missing: final, unless it is being created just now.
# Anything else (the kubelet's "failed to sync secret cache" while the API server is slow) may pass too.
CONFIG_WAITING = "CreateContainerConfigError"
CONFIG_MISSING = re.compile(r"\bnot found\b|couldn't find key", re.IGNORECASE)
CONFIG_MISSING_GIVE_UP_SECONDS = 180.0
CONFIG_GIVE_UP_SECONDS = 600.0
# The container runtime could not create or start the container: with the GPU runtime at fault, the node's
# (termination.gpu_runtime_failure). The kubelet retries a failed create, so one that still fails this long
# after it took the pod ends the attempt (the GPU runtime's classes). The pod status has no clock for the
# end of the pull, so another create error ("context deadline exceeded", a container name "reserved" by
# the create that timed out) waits as long as a pull may take as well, then ends the attempt as Unknown.
CREATE_WAITING = frozenset({"CreateContainerError", "RunContainerError"})
CREATE_GIVE_UP_SECONDS = 300.0
CREATE_OTHER_GIVE_UP_SECONDS = IMAGE_PULL_GIVE_UP_SECONDS + CREATE_GIVE_UP_SECONDS
# A bound pod whose kubelet has not yet mounted its volumes or set up its network (its sandbox) says
# PodReadyToStartContainers False; the image is pulled only after that. A multi-node attempt's other ranks
# wait for it in the rendezvous, holding their GPUs, so once it has waited this long after the kubelet took
# it the attempt ends as a StorageError: usually a ReadWriteOnce claim attached to another node ("Multi-Attach
# error" in the pod's events), which does not resolve on its own while that node keeps it.
MOUNT_GIVE_UP_SECONDS = 600.0


def waiting_failure(pod: Obj, now: datetime, *, own_image: bool) -> Failure | None:
    """A container that cannot start and will not: its image cannot be had, or its Secret or ConfigMap is
    missing; a failure that may pass once it has lasted its give-up time. ``own_image``: the job sets
    ``spec.image`` (:func:`~sftjob_operator.termination.gpu_runtime_failure` names the image to fix). Only
    the containers the trainer waits for count: every init container (a native sidecar among them starts
    before it) and the trainer itself, not a sidecar a webhook added beside it, which the attempt runs
    without."""
    status = pod.get("status") or {}
    waited = _waited(pod, now, since_created=True)
    trainer = [cs for cs in status.get("containerStatuses") or [] if cs.get("name") == CONTAINER]
    for cs in [*(status.get("initContainerStatuses") or []), *trainer]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason, message = waiting.get("reason", ""), waiting.get("message", "")
        said = f"{reason}: {message or cs.get('image')}"
        final = IMAGE_PULL_FINAL.search(message) and not IMAGE_LAYER_DOWNLOAD.search(message)
        if reason in IMAGE_UNUSABLE or (reason in IMAGE_PULL_WAITING and final):
            return FailureClass.IMAGE_PULL_ERROR, said
        if reason == IMAGE_PULL_BACKOFF and waited > IMAGE_PULL_GIVE_UP_SECONDS:
            return FailureClass.NETWORK_ERROR, _still(said, waited)
        if reason == CONFIG_WAITING:
            missing = CONFIG_MISSING.search(message) is not None
            if waited > (CONFIG_MISSING_GIVE_UP_SECONDS if missing else CONFIG_GIVE_UP_SECONDS):
                return FailureClass.CONFIG_ERROR, _still(said, waited)
        if reason in CREATE_WAITING:
            runtime = gpu_runtime_failure(reason, message, own_image=own_image)
            if waited > (CREATE_GIVE_UP_SECONDS if runtime else CREATE_OTHER_GIVE_UP_SECONDS):
                cls, what = runtime or (FailureClass.UNKNOWN, said)
                return cls, _still(what, waited)
    return None


def unmounted_failure(pod: Obj, now: datetime, give_up_seconds: float | None) -> Failure | None:
    """A Pending pod whose sandbox is still not ready ``give_up_seconds`` after the kubelet took it (None:
    it may wait as long as it takes)."""
    status = pod.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == SANDBOX_CONDITION), None)
    if give_up_seconds is None or status.get("phase") != "Pending" or (ready or {}).get("status") != "False":
        return None
    waited = _waited(pod, now, since_created=False)
    if waited <= give_up_seconds:
        return None
    said = (
        f"{SANDBOX_CONDITION} False: the kubelet has not mounted the pod's volumes (or set up its network);"
        " the pod's events say why, e.g. a Multi-Attach error for a ReadWriteOnce claim another node holds"
    )
    return FailureClass.STORAGE_ERROR, _still(said, waited)


def _waited(pod: Obj, now: datetime, *, since_created: bool) -> float:
    """Seconds since the kubelet took the pod (before it pulls or mounts), not since its creation: a pod may
    wait for GPUs long. ``since_created``: since its creation when no kubelet took it yet."""
    status, metadata = pod.get("status") or {}, pod.get("metadata") or {}
    raw = status.get("startTime") or (metadata.get("creationTimestamp") if since_created else None)
    return 0.0 if not raw else (now - datetime.fromisoformat(raw)).total_seconds()


def _still(message: str, waited: float) -> str:
    return f"{message} (the pod has not started in {int(waited // 60)} min)"
