"""How an attempt ends, from its pods' verdicts: its outcome and cause, and its ``status.attempts`` record.

:mod:`sftjob_operator.classify` judges each trainer pod on its own. All pods of an attempt restart together,
so one failure ends it, and when a rank dies its peers fail too (NCCL errors, torchrun's SIGTERM): the
attempt takes the most specific cause among its pods, and waits for a peer still stopping (up to its
torchrun's shutdown timeout) to give its own account. The record it leaves then tells the restart policy
whether a node never joined the rendezvous, the reconcile whether the pods left can still save their
checkpoint, and the event what failed. Pure functions: the reconcile loop gathers the inputs and records
the result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime

from sftjob.attempts import AttemptRecord
from sftjob.failures import FailureClass
from sftjob_operator.classify import RUNNING, Classification, Obj, Outcome, finished_at, running_since

# torchrun's rendezvous gave up on a peer that never came (rank 0: "Timed out after 600 seconds waiting for
# clients. 1/2 clients joined."; the others: "The client socket has timed out after 600000ms while trying
# to connect to (host, port)."): a CommunicationError, yet no sign of a broken link or a bad node.
PEER_NEVER_JOINED = re.compile(r"waiting for clients|timed out after \S+ while trying to connect to", re.I)


# Root causes first: when one pod of a multi-node attempt dies, its peers see NCCL errors or are
# killed by torchrun, so the least specific classes come last. A CommunicationError is last of all: it is
# what the healthy ranks say when another one dies (a segfault is Unknown), so it is the cause only when
# no pod says anything else.
ROOT_CAUSE_ORDER: tuple[FailureClass, ...] = (
    FailureClass.NODE_LOST,
    FailureClass.GPU_UNAVAILABLE,
    FailureClass.DRIVER_MISMATCH,
    FailureClass.IMAGE_PULL_ERROR,
    FailureClass.CONFIG_ERROR,
    FailureClass.MODEL_LOAD_ERROR,
    FailureClass.DATA_ERROR,
    FailureClass.DIVERGED,
    FailureClass.DEADLINE_EXCEEDED,
    FailureClass.HOST_OOM,
    FailureClass.CUDA_OOM,
    FailureClass.STORAGE_ERROR,
    FailureClass.NETWORK_ERROR,
    FailureClass.PREEMPTED,
    FailureClass.STALLED,
    FailureClass.UNKNOWN,
    FailureClass.COMMUNICATION_ERROR,
)


# Failures a healthy rank reports when another rank dies (an Unknown is also the SIGTERM torchrun sends the
# ranks of a pod nothing asked to stop): while a peer pod's trainer still runs, the attempt waits for the
# peer's own account (a CudaOOM, a crash). Its torchrun may be stopping its other ranks, stuck in a CUDA or
# NCCL wait on the dead peer where no Python handler runs, for up to its --shutdown-timeout: the pod's grace
# less pods.TORCHRUN_SHUTDOWN_MARGIN_SECONDS, so the wait lasts the pod's grace after the first pod ended.
PEER_SYMPTOMS = frozenset({FailureClass.COMMUNICATION_ERROR, FailureClass.UNKNOWN})
# The grace of a pod that does not say (Kubernetes' default, which the API server writes into every pod).
DEFAULT_GRACE_SECONDS = 30.0


def classify_attempt(pods: Sequence[Classification]) -> Classification:
    """One attempt's outcome from its pods': any failure ends it (all pods restart together) and the
    most specific failure is its cause; it succeeded only when every pod did."""
    failures = [p for p in pods if p.outcome is Outcome.FAILED]
    if failures:
        return min(failures, key=lambda p: ROOT_CAUSE_ORDER.index(p.failure_class or FailureClass.UNKNOWN))
    if pods and all(p.outcome is Outcome.SUCCEEDED for p in pods):
        return pods[0]
    return RUNNING


def peers_settling(
    outcome: Classification, verdicts: Sequence[Classification], pods: Mapping[int, Obj], *, now: datetime
) -> float | None:
    """Seconds to wait before taking ``outcome`` as the attempt's: its failure is one a rank reports when
    another rank dies (``PEER_SYMPTOMS``) and a peer pod's trainer still runs, within that pod's grace
    (its torchrun's shutdown timeout and the margin after it) of the first failed pod's end. The peer may be
    the one that died (its torchrun still stopping its other ranks): judged now, its cause would be lost
    with the pod. A peer still Pending has nothing to say. None: decide now."""
    if outcome.failure_class not in PEER_SYMPTOMS:
        return None
    peers = [v.node_rank for v in verdicts if v.outcome is Outcome.RUNNING and v.node_rank is not None]
    running = [pods[rank] for rank in peers if rank in pods]
    graces = [_grace(p) for p in running if running_since(p.get("status") or {}) is not None]
    if not graces:
        return None
    ranks = [v.node_rank for v in verdicts if v.over and v.node_rank is not None]
    ended = [finished_at(pods[rank]) for rank in ranks if rank in pods]
    first = min((t for t in ended if t is not None), default=None)
    if first is None:
        return None
    left = max(graces) - (now - first).total_seconds()
    return left if left > 0 else None


def _grace(pod: Obj) -> float:
    """The pod's grace period: its torchrun's ``--shutdown-timeout`` plus the margin (pods.py)."""
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return float(grace) if isinstance(grace, int | float) else DEFAULT_GRACE_SECONDS


def end_record(
    record: AttemptRecord,
    outcome: Classification,
    *,
    end_time: datetime,
    progress_step: int | None,
    checkpoint_step: int | None,
) -> AttemptRecord:
    """The ``status.attempts`` entry for an attempt that has just ended.

    ``progress_step`` and ``checkpoint_step`` come from the trainer's last progress and checkpoint
    annotations; the steps between them are the work a failed attempt loses (None for a success).
    """
    saved = checkpoint_step if checkpoint_step is not None else (record.resumed_from_step or 0)
    failed = outcome.outcome is Outcome.FAILED
    lost = None if progress_step is None or not failed else max(0, progress_step - saved)
    return record.model_copy(
        update={
            "end_time": end_time,
            "succeeded": outcome.outcome is Outcome.SUCCEEDED,
            "reason": outcome.failure_class,
            "exit_code": outcome.exit_code,
            "message": outcome.message,
            "node": outcome.node or record.node,
            "node_rank": outcome.node_rank,
            "lost_steps": lost,
        }
    )


def peer_never_joined(record: AttemptRecord) -> bool:
    """The attempt ended because a node never joined torchrun's rendezvous (it was Pending, pulling its
    image, or waiting for GPUs), not because communication broke."""
    if record.reason is not FailureClass.COMMUNICATION_ERROR:
        return False
    return PEER_NEVER_JOINED.search(record.message) is not None


# An attempt that ended so leaves ranks that are all alive and save their SIGTERM checkpoint together.
SAVED_TOGETHER = frozenset({FailureClass.PREEMPTED, FailureClass.DEADLINE_EXCEEDED})


def cut_short(record: AttemptRecord | None) -> bool:
    """The attempt failed with a rank dead, gone or hung: the collective SIGTERM save of its other pods
    cannot complete, so they need no grace to save (``Actions.quick_delete_pods``)."""
    return record is not None and record.failed and record.reason not in SAVED_TOGETHER


def describe_failure(record: AttemptRecord) -> str:
    """The one-line event message for a failed attempt: number, node, class, exit code, message."""
    where = f" on {record.node}" if record.node else ""
    code = f" (exit code {record.exit_code})" if record.exit_code is not None else ""
    lost = f"; {record.lost_steps} step(s) since the last checkpoint" if record.lost_steps else ""
    text = f": {record.message}" if record.message else ""
    cls = record.reason or FailureClass.UNKNOWN
    return f"attempt {record.attempt}{where} failed with {cls}{code}{text}{lost}"
