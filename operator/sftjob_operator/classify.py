"""Sort each attempt's trainer pods into running, succeeded, or failed with a FailureClass.

Pure functions over the objects as the API server returns them (camelCase dicts): the pod (or None
once it has vanished), its node (or None once deleted), and the caller's ``now`` and last progress
time. No clocks, no I/O: the reconcile loop gathers the inputs and records the result in
``status.attempts``. What the container's termination message says (the trainer's exit code, hidden
behind torchrun's 1, and a summary) is read by :mod:`sftjob_operator.termination`; why a container has not
started, by :mod:`sftjob_operator.not_started`; how the attempt ends from its pods' verdicts, by
:mod:`sftjob_operator.attempt_end`. ``docs/failures.md`` explains every class to users.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sftjob.failures import COMMUNICATION_PROBE, EXIT_CODE_CLASS, ExitCode, FailureClass
from sftjob_operator.not_started import unmounted_failure, waiting_failure
from sftjob_operator.pods import CONTAINER
from sftjob_operator.termination import (
    CUDA_OOM_SIGNATURE,
    GPU_FAULT_SIGNATURE,
    gpu_runtime_failure,
    message_class,
    read_message,
)

Obj = Mapping[str, Any]

# A node whose Ready condition has been False/Unknown this long takes its pods with it. Kubernetes
# itself waits 300 s (the default unreachable toleration) before evicting them.
NODE_LOST_GRACE_SECONDS = 120.0
MESSAGE_MAX_CHARS = 300

START_FAILURES = frozenset({"StartError", "ContainerCannotRun"})  # terminated before the process ran
# Kubelet admission failures that mean the node advertised GPUs it could not hand out.
GPU_ADMISSION_REASONS = frozenset({"UnexpectedAdmissionError", "OutOfnvidia.com/gpu"})
# DisruptionTarget reasons that mean the node went away rather than someone asking the pod to leave.
NODE_GONE_DISRUPTIONS = frozenset({"DeletionByTaintManager", "DeletionByPodGC"})

# Kueue's stops that are no preemption (its TerminationTarget reasons, jobframework's StopReason, and
# "WorkloadEvictedDueTo" + the Workload's eviction reason for a pod group): the attempt failed, and a new
# attempt at once would only be stopped again (a free restart would also reset Kueue's own requeue backoff).
KUEUE_FAILURES = {
    "WorkloadEvictedDueToPodsReadyTimeout": "its pods were not all running within Kueue's waitForPodsReady"
    " timeout (a rank Pending for GPUs, or a long image pull)",
    "NoMatchingWorkload": "Kueue found no Workload matching the pods",
}
# Pod reasons that mean the kubelet stopped the pod (node shutdown, node affinity or preemption at admission).
STOP_REASONS = frozenset({"Terminated", "Shutdown", "NodeAffinity", "Preempting"})
# What a trainer says while its pod is being stopped: its SIGTERM code, or the broken collectives of ranks
# stopping at once. On a pod asked to stop they are a preemption, not the trainer's failure.
STOPPING_SYMPTOMS = frozenset({FailureClass.PREEMPTED, FailureClass.COMMUNICATION_ERROR})
# The trainer's SIGTERM code on a pod nothing asked to stop: torchrun stops a pod's other ranks when one
# dies without a message (a segfault), and those ranks then report the SIGTERM.
UNASKED_SIGTERM = (
    "the trainer was stopped (SIGTERM) though nothing asked its pod to stop: torchrun stops a pod's ranks"
    " when one of them dies (see the pod's log for the first rank that failed)"
)

# The trainer's documented failure codes: the container's own code when it is one of these, else the
# code the trainer tagged its message with (torchrun, the container's PID 1, exits 1 for any of them).
TRAINER_FAILURE_CODES = frozenset(code for code in EXIT_CODE_CLASS if code != ExitCode.UNKNOWN)


class Outcome(StrEnum):
    RUNNING = "Running"  # still going (or still Pending): nothing to decide yet
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class Classification:
    """How one pod (or a whole attempt) stands: a failure carries its class, code, message and node."""

    outcome: Outcome
    failure_class: FailureClass | None = None
    exit_code: int | None = None
    message: str = ""
    node: str | None = None
    node_rank: int | None = None  # the pod's, set by the pass that knows it (``_Pass.classify``)

    @property
    def over(self) -> bool:
        """The attempt is over: record it and decide what comes next (delete any pods still running)."""
        return self.outcome is not Outcome.RUNNING


RUNNING = Classification(Outcome.RUNNING)


def classify_pod(
    pod: Obj | None,
    node: Obj | None,
    *,
    now: datetime,
    node_name: str | None = None,
    last_progress: datetime | None = None,
    stall_timeout_seconds: float | None = None,
    node_lost_grace_seconds: float = NODE_LOST_GRACE_SECONDS,
    own_image: bool = False,
    mount_give_up_seconds: float | None = None,
) -> Classification:
    """Classify one trainer pod.

    ``pod`` is None when the pod the attempt created no longer exists; ``node_name`` then names the
    node it was on (from ``status.attempts``). ``node`` is the Node the pod is bound to, or None when
    that node does not exist. ``last_progress`` is the ``updated`` time of the pod's progress report.
    ``own_image``: the job sets ``spec.image``, so a module its trainer cannot import is its ConfigError
    (and an image fault's message names ``spec.image``, not the operator's ``--image``).
    ``mount_give_up_seconds``: how long a pod may wait for its volumes (None: as long as it takes).
    """
    if pod is None:
        if node_name is not None and (node is None or _not_ready_for(node, now) is not None):
            return _failed(FailureClass.NODE_LOST, None, f"pod vanished with node {node_name}", node_name)
        return _failed(FailureClass.PREEMPTED, None, "pod was deleted outside the operator", node_name)

    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    node_name = spec.get("nodeName") or node_name
    node_gone = node_name is not None and node_lost(node, now, grace_seconds=node_lost_grace_seconds)
    terminated = _terminated_state(status)
    phase = status.get("phase")

    # The trainer finished: the pod may still be Running (a sidecar that does not stop on its own), or have
    # Failed without a reason of its own because another container did (a sidecar OOMKilled on the way).
    finished = terminated is not None and terminated.get("exitCode") == 0
    if phase == "Succeeded" or (finished and (phase != "Failed" or not status.get("reason"))):
        return Classification(Outcome.SUCCEEDED, exit_code=0, node=node_name)
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp") is not None
    if phase == "Failed" or terminated is not None:
        return _classify_ended(
            status, terminated, node_name, node_gone, deleting=deleting, own_image=own_image
        )

    waiting = waiting_failure(pod, now, own_image=own_image)
    waiting = waiting or unmounted_failure(pod, now, mount_give_up_seconds)
    if waiting is not None:
        return _failed(waiting[0], None, waiting[1], node_name)
    if node_gone:
        return _failed(FailureClass.NODE_LOST, None, f"node {node_name} is gone or NotReady", node_name)
    if phase == "Running" and stall_timeout_seconds is not None and not deleting:
        since = max((t for t in (last_progress, running_since(status)) if t is not None), default=None)
        if since is not None and (now - since).total_seconds() > stall_timeout_seconds:
            return _failed(
                FailureClass.STALLED,
                None,
                f"no progress reported for {int((now - since).total_seconds())} s"
                f" (stall timeout {int(stall_timeout_seconds)} s)",
                node_name,
            )
    return RUNNING


def finished_at(pod: Obj) -> datetime | None:
    """When the pod's trainer container ended (None: it has not, or the pod does not say)."""
    terminated = _terminated_state(pod.get("status") or {})
    return parse_time(terminated.get("finishedAt")) if terminated else None


def _classify_ended(
    status: Obj,
    terminated: Obj | None,
    node_name: str | None,
    node_gone: bool,
    *,
    deleting: bool,
    own_image: bool,
) -> Classification:
    pod_reason = status.get("reason") or ""
    pod_message = status.get("message") or ""
    # Kueue marks the pods it stops (preemption, eviction) TerminationTarget, not DisruptionTarget.
    disruption = _condition(status, "DisruptionTarget")
    kueue = _condition(status, "TerminationTarget")
    if kueue and kueue.get("status") == "True" and kueue.get("reason") in KUEUE_FAILURES:
        tagged = read_message((terminated or {}).get("message") or "").exit_code
        own = tagged if tagged in TRAINER_FAILURE_CODES else None
        if own is None or EXIT_CODE_CLASS[own] in STOPPING_SYMPTOMS:  # else the trainer's own failure decides
            why = f"stopped by Kueue ({kueue.get('reason')}: {kueue.get('message')})"
            return _failed(FailureClass.UNKNOWN, own, f"{why}: {KUEUE_FAILURES[kueue['reason']]}", node_name)
        kueue = None
    if (disruption is None or disruption.get("status") != "True") and kueue and kueue.get("status") == "True":
        disruption = {**kueue, "reason": f"stopped by Kueue ({kueue.get('reason')}: {kueue.get('message')})"}
    disruption_reason = (
        disruption.get("reason", "") if disruption and disruption.get("status") == "True" else ""
    )
    said = read_message((terminated or {}).get("message") or "")
    code: int | None = terminated.get("exitCode") if terminated else None
    if code not in TRAINER_FAILURE_CODES and said.exit_code in TRAINER_FAILURE_CODES:
        code = said.exit_code  # the trainer's own code, behind torchrun's 1 (or a signal after it)
    text = said.summary
    # Something asked the pod to stop (the operator deletes only the pods of attempts already ended):
    # whatever its trainer said while stopping, or a kill at the end of the grace period, follows from it.
    stopped_by = disruption_reason or (pod_reason if pod_reason in STOP_REASONS else "")
    stopped_by = stopped_by or ("the pod was deleted outside the operator" if deleting else "")

    def fail(cls: FailureClass, message: str) -> Classification:
        return _failed(cls, code, message, node_name)

    if pod_reason in GPU_ADMISSION_REASONS:
        return fail(FailureClass.GPU_UNAVAILABLE, f"{pod_reason}: {pod_message}")
    if terminated is not None and terminated.get("reason") == "OOMKilled":
        return fail(
            FailureClass.HOST_OOM, text or "container killed by the kernel OOM killer at its memory limit"
        )
    if code is not None and code in TRAINER_FAILURE_CODES:
        cls = EXIT_CODE_CLASS[code]
        # On a node that is gone, a trainer stopping (its SIGTERM code, its peers' broken collectives) went
        # with the node, as a pod deleted there does below, unless a reason of its own stopped the pod
        # first (a node shutdown, a preemption).
        stopped_first = bool(disruption_reason or pod_reason in STOP_REASONS)
        if (
            cls in STOPPING_SYMPTOMS
            and node_gone
            and (disruption_reason in NODE_GONE_DISRUPTIONS or not stopped_first)
        ):
            return fail(FailureClass.NODE_LOST, _node_lost_message(node_name, disruption_reason, text))
        if cls in STOPPING_SYMPTOMS and stopped_by:
            said_stopped = cls is FailureClass.PREEMPTED and text  # e.g. "checkpoint saved at step N"
            return fail(
                FailureClass.PREEMPTED, text if said_stopped else _disruption_message(stopped_by, code, text)
            )
        if cls is FailureClass.PREEMPTED:  # a SIGTERM nothing sent to the pod: torchrun stopping its ranks
            return fail(FailureClass.UNKNOWN, f"{UNASKED_SIGTERM}: {text}" if text else UNASKED_SIGTERM)
        if (
            cls is FailureClass.COMMUNICATION_ERROR
            and CUDA_OOM_SIGNATURE.search(said.text)
            and not text.startswith(COMMUNICATION_PROBE)  # the trainer's own verdict on its start-up probe
        ):
            cls = FailureClass.CUDA_OOM  # NCCL ran out of GPU memory (a trainer older than its OOM words)
        elif cls is FailureClass.COMMUNICATION_ERROR and GPU_FAULT_SIGNATURE.search(said.text):
            cls = FailureClass.GPU_UNAVAILABLE  # NCCL failed because a GPU or its NVLinks did
        return fail(cls, text or f"trainer exited with code {code} ({ExitCode(code).name})")
    if terminated is not None and terminated.get("reason") in START_FAILURES:
        runtime = gpu_runtime_failure(terminated["reason"], said.text, own_image=own_image)
        if runtime is not None:
            return fail(*runtime)
    signalled = code is not None and code > 128
    if pod_reason == "Evicted":
        memory = "memory" in pod_message and "ephemeral" not in pod_message
        return fail(FailureClass.HOST_OOM if memory else FailureClass.PREEMPTED, f"evicted: {pod_message}")
    if disruption_reason in NODE_GONE_DISRUPTIONS and node_gone:
        return fail(FailureClass.NODE_LOST, _node_lost_message(node_name, disruption_reason, ""))
    if disruption_reason or pod_reason in STOP_REASONS:
        return fail(FailureClass.PREEMPTED, _disruption_message(disruption_reason or pod_reason, code, text))
    if node_gone and (code is None or signalled):
        return fail(FailureClass.NODE_LOST, _node_lost_message(node_name, "", ""))
    if deleting and (code is None or signalled):
        return fail(FailureClass.PREEMPTED, _disruption_message(stopped_by, code, text))
    said_so = message_class(said, own_image=own_image)
    if said_so is not None:
        return fail(*said_so)
    if code is not None and code > 128:
        return fail(FailureClass.UNKNOWN, text or f"trainer killed by {_signal_name(code)}")
    detail = text or pod_message or (f"exited with code {code}" if code is not None else "pod failed")
    return fail(FailureClass.UNKNOWN, detail)


def _failed(cls: FailureClass, code: int | None, message: str, node: str | None) -> Classification:
    return Classification(Outcome.FAILED, cls, code, _trim(message), node)


def _trainer_state(status: Obj) -> Obj:
    """The state of the pod's trainer container (``pods.CONTAINER``), empty while the kubelet reports none.
    Any other container (a sidecar a mutating webhook injected: istio-proxy, a log shipper, a Vault agent)
    neither ends the attempt nor says how it ended: one that exits 0 is no success, one OOMKilled under its
    own limit no HostOOM of the trainer's."""
    statuses: list[Obj] = status.get("containerStatuses") or []
    trainer = next((cs for cs in statuses if cs.get("name") == CONTAINER), None)
    return (trainer or {}).get("state") or {}


def _terminated_state(status: Obj) -> Obj | None:
    """The trainer container's terminated state (None: it has not ended)."""
    return _trainer_state(status).get("terminated") or None


def running_since(status: Obj) -> datetime | None:
    """When the pod's trainer container started running (None: not running)."""
    return parse_time((_trainer_state(status).get("running") or {}).get("startedAt"))


def _condition(obj_status: Obj, type_: str) -> Obj | None:
    return next((c for c in obj_status.get("conditions") or [] if c.get("type") == type_), None)


def node_lost(node: Obj | None, now: datetime, *, grace_seconds: float = NODE_LOST_GRACE_SECONDS) -> bool:
    """The node (None: deleted) is gone or NotReady longer than the grace: its pods are lost with it,
    and its kubelet can no longer stop them or confirm their deletion."""
    return node is None or (_not_ready_for(node, now) or 0.0) > grace_seconds


def _not_ready_for(node: Obj, now: datetime) -> float | None:
    """Seconds the node has been NotReady (Ready False or Unknown), or None when it is Ready."""
    ready = _condition(node.get("status") or {}, "Ready")
    if ready is not None and ready.get("status") == "True":
        return None
    since = parse_time(ready.get("lastTransitionTime")) if ready else None
    return float("inf") if since is None else max(0.0, (now - since).total_seconds())


def _node_lost_message(node_name: str | None, disruption_reason: str, text: str) -> str:
    lost = (
        f"node {node_name} lost ({disruption_reason})"
        if disruption_reason
        else f"node {node_name} is gone or NotReady"
    )
    return f"{lost}: {text}" if text else lost


def _disruption_message(reason: str, code: int | None, text: str) -> str:
    how = f", trainer {'killed by ' + _signal_name(code) if code > 128 else f'exited {code}'}" if code else ""
    return f"{reason}{how}" + (f": {text}" if text else "")


def _signal_name(code: int) -> str:
    try:
        return f"{signal.Signals(code - 128).name} (exit code {code})"
    except ValueError:
        return f"exit code {code}"


def _trim(text: str) -> str:
    """One line, short enough for status and events."""
    line = " ".join(text.split())
    return line if len(line) <= MESSAGE_MAX_CHARS else line[: MESSAGE_MAX_CHARS - 1] + "…"


def parse_time(value: str | None) -> datetime | None:
    """An RFC 3339 timestamp as the API server writes it, or None."""
    return datetime.fromisoformat(value) if value else None
