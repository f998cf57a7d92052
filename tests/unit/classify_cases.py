"""Pods, nodes and container states as the API server reports them, for the classification tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sftjob.attempts import AttemptRecord
from sftjob_operator.classify import Classification, classify_pod

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
NODE = "gpu-a800-0"
RECORD = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))


def ts(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


def node(ready: str = "True", since_seconds: float = 3600) -> dict[str, Any]:
    return {
        "metadata": {"name": NODE},
        "status": {
            "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": ts(since_seconds)}]
        },
    }


def pod(
    phase: str = "Running",
    *,
    state: dict[str, Any] | None = None,
    reason: str | None = None,
    message: str | None = None,
    disruption: str | None = None,
    deleting: bool = False,
    init_state: dict[str, Any] | None = None,
    created_seconds_ago: float = 3600,
    kubelet_took_it_seconds_ago: float | None = None,
) -> dict[str, Any]:
    """A trainer pod; ``kubelet_took_it_seconds_ago`` sets ``status.startTime`` (unset: still unbound)."""
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False"}],
        "containerStatuses": [
            {"name": "trainer", "image": "ghcr.io/sftjob/trainer:0.1.0", "state": state or {}}
        ],
    }
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    if kubelet_took_it_seconds_ago is not None:
        status["startTime"] = ts(kubelet_took_it_seconds_ago)
    if init_state:
        status["initContainerStatuses"] = [{"name": "fetch", "image": "busybox", "state": init_state}]
    metadata: dict[str, Any] = {
        "name": "job-1-0",
        "namespace": "default",
        "creationTimestamp": ts(created_seconds_ago),
    }
    if deleting:
        metadata["deletionTimestamp"] = ts(5)
    return {"metadata": metadata, "spec": {"nodeName": NODE}, "status": status}


def running(started_seconds_ago: float = 60) -> dict[str, Any]:
    return {"running": {"startedAt": ts(started_seconds_ago)}}


def exited(code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": code, "reason": reason, "finishedAt": ts(1)}
    if message:
        terminated["message"] = message
    return {"terminated": terminated}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


def classify(p: dict[str, Any] | None, n: dict[str, Any] | None = None, **kw: Any) -> Classification:
    return classify_pod(p, node() if n is None else n, now=NOW, **kw)


# What containerd and the NVIDIA Container Toolkit say when a GPU node cannot create or start a container.
_RUNC = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create"
    " failed: unable to start container process: error during container init: error running hook #0: error"
    " running hook: exit status 1, stdout: , stderr: Auto-detected mode as 'legacy'"
)
NVML_MISMATCH = (
    f"{_RUNC}\nnvidia-container-cli: initialization error: nvml error: driver/library version mismatch:"
    " unknown"
)
UNKNOWN_DEVICE = (
    f"{_RUNC} nvidia-container-cli: device error: GPU-3b1c2d4e-5f60-7182-93a4-b5c6d7e8f901: unknown device:"
    " unknown"
)
NO_NVML = (
    f"{_RUNC}\nnvidia-container-cli: initialization error: load library failed: libnvidia-ml.so.1: cannot"
    " open shared object file: no such file or directory: unknown"
)
# The image's NVIDIA_REQUIRE_CUDA asks for a newer CUDA than the node's driver has.
REQUIRE_CUDA = (
    f"{_RUNC}\nnvidia-container-cli: requirement error: unsatisfied condition: cuda>=12.9, please update your"
    " driver to a newer version, or use an earlier cuda container: unknown"
)
# The image holds a driver file the toolkit mounts from the node (the image's fault, on every node) ...
DRIVER_FILE_IN_IMAGE = (
    f"{_RUNC}\nnvidia-container-cli: mount error: file creation failed: /run/containerd/io.containerd.runtime"
    ".v2.task/k8s.io/4f2a/rootfs/usr/bin/nvidia-smi: file exists: unknown"
)
# ... but a host socket the toolkit cannot create is the node's.
PERSISTENCED_SOCKET = (
    f"{_RUNC}\nnvidia-container-cli: mount error: file creation failed: /run/containerd/io.containerd.runtime"
    ".v2.task/k8s.io/4f2a/rootfs/run/nvidia-persistenced/socket: no such device or address: unknown"
)
CDI_UNRESOLVABLE = (
    'failed to generate container "4f2a" spec: failed to inject CDI devices: unresolvable CDI devices'
    " nvidia.com/gpu=GPU-3b1c2d4e-5f60-7182-93a4-b5c6d7e8f901"
)
# ... and when the container could not start for a reason of the image's own.
NO_PYTHON = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create"
    ' failed: unable to start container process: exec: "python": executable file not found in $PATH:'
    " unknown"
)
