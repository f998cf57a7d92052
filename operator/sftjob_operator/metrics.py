"""The operator's Prometheus metrics (names fixed in the cross-team contract) and how a pass feeds them.

Served by prometheus_client on their own port (default 8080), apart from kopf's liveness endpoint.
Everything job-level is derived by comparing a job's status before and after a pass, so the numbers
come from the same state the API server holds, not from a separate event stream.
"""

from __future__ import annotations

from collections import Counter as Tally
from datetime import datetime
from importlib.metadata import version
from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from sftjob.failures import FailureClass
from sftjob.job_status import SFTJobStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STARTUP_BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 28800, 86400)  # GPU queues
STEP_BUCKETS = (0, 1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)

# success; error: an API or programming error; refused: the API server refused a child (a quota, RBAC).
RECONCILE_RESULTS = ("success", "error", "refused")
RECONCILES = Counter("sftjob_operator_reconcile_total", "Reconcile passes by result.", ["result"])
RECONCILE_SECONDS = Histogram(
    "sftjob_operator_reconcile_duration_seconds",
    "Time of one reconcile pass, API calls included.",
    buckets=LATENCY_BUCKETS,
)
JOBS = Gauge("sftjob_jobs", "SFTJobs by phase and the GPU type they run on.", ["phase", "gpu_type"])
JOBS_FINISHED = Counter(
    "sftjob_jobs_finished_total", "SFTJobs that ended, by result (Succeeded or Failed).", ["result"]
)
PODS_CREATED = Counter("sftjob_operator_pods_created_total", "Trainer pods the operator created.")
RESTARTS = Counter(
    "sftjob_restarts_total", "Attempts started after a failure, by its class.", ["failure_class"]
)
OOM_REPLANS = Counter("sftjob_oom_replans_total", "Attempts started with a re-planned config after CUDA OOM.")
TIME_TO_SCHEDULED = Histogram(
    "sftjob_job_time_to_scheduled_seconds",
    "Job creation to all first-attempt pods bound.",
    buckets=STARTUP_BUCKETS,
)
TIME_TO_TRAINING = Histogram(
    "sftjob_job_time_to_training_started_seconds",
    "Job creation to first-attempt pods Running.",
    buckets=STARTUP_BUCKETS,
)
RECOVERY_SECONDS = Histogram(
    "sftjob_recovery_duration_seconds",
    "A failed attempt's end to the next attempt Running.",
    buckets=STARTUP_BUCKETS,
)
LOST_STEPS = Histogram(
    "sftjob_restart_lost_steps",
    "Steps since the last checkpoint when an attempt failed.",
    buckets=STEP_BUCKETS,
)
WATCH_EVENTS = Counter(
    "sftjob_operator_watch_events_total", "Watch events the operator handled, by kind.", ["kind"]
)
BUILD_INFO = Gauge("sftjob_operator_build_info", "The operator's version.", ["version"])

FINISHED_PHASES = ("Succeeded", "Failed")

_job_states: dict[tuple[str, str], tuple[str, str]] = {}  # (namespace, name) -> (phase, GPU type)
_job_counts: Tally[tuple[str, str]] = Tally()


def serve(port: int) -> WSGIServer:
    """Start the metrics endpoint (port 0 picks a free one). It listens on IPv6 and IPv4 together, so an
    IPv6-only cluster scrapes it too, and on IPv4 alone where the kernel has no IPv6."""
    BUILD_INFO.labels(version=version("sftjob")).set(1)
    create_series()
    try:
        server, _thread = start_http_server(port, addr="::")
    except OSError:
        server, _thread = start_http_server(port)
    return server


def create_series() -> None:
    """Create every labelled counter's series at 0, so that increase() sees the first job end, the first
    restart of each class and the first failed pass: a series that appears already at 1 has no increase
    to show (and SFTJobOperatorNotReconciling finds a success series that stays 0)."""
    for result in RECONCILE_RESULTS:
        RECONCILES.labels(result=result)
    for result in FINISHED_PHASES:
        JOBS_FINISHED.labels(result=result)
    for failure_class in FailureClass:
        RESTARTS.labels(failure_class=str(failure_class))


def observe_pass(*, old: SFTJobStatus, new: SFTJobStatus, created: datetime, now: datetime) -> None:
    """Count what changed between a job's status before and after a pass."""
    if new.phase in FINISHED_PHASES and old.phase not in FINISHED_PHASES:
        JOBS_FINISHED.labels(result=new.phase).inc()
    if _flipped_true(old, new, "Scheduled") and new.attempt == 1:
        TIME_TO_SCHEDULED.observe((now - created).total_seconds())
    if new.phase == "Running" and old.phase != "Running":
        if new.attempt == 1:
            TIME_TO_TRAINING.observe((now - created).total_seconds())
        previous = next((r for r in new.attempts if r.attempt == new.attempt - 1), None)
        if previous is not None and previous.failed and previous.end_time is not None:
            RECOVERY_SECONDS.observe((now - previous.end_time).total_seconds())
    ended_before = {r.attempt for r in old.attempts if r.failed}
    for record in new.attempts:
        if record.failed and record.attempt not in ended_before and record.lost_steps is not None:
            LOST_STEPS.observe(record.lost_steps)
    if new.restarts > old.restarts:
        failed = [r for r in new.attempts if r.failed and r.attempt < new.attempt]
        cause = failed[-1].reason if failed else None
        RESTARTS.labels(failure_class=str(cause or "Unknown")).inc(new.restarts - old.restarts)
        started = next((r for r in new.attempts if r.attempt == new.attempt), None)
        if started is not None and started.ladder_step and str(cause) == "CudaOOM":
            OOM_REPLANS.inc()


def track_job(namespace: str, name: str, status: SFTJobStatus | None) -> None:
    """Keep ``sftjob_jobs`` equal to the jobs the operator currently knows (None: the job is gone).

    Constant time per call: only the one job's old and new (phase, GPU type) series move."""
    key = (namespace, name)
    before = _job_states.pop(key, None)
    after = (status.phase, status.gpu.type or "Unknown") if status is not None else None
    if after is not None:
        _job_states[key] = after
    if before == after:
        return
    if before is not None:
        _job_counts[before] -= 1
        if _job_counts[before] == 0:  # no job left in that state: drop the series
            del _job_counts[before]
            JOBS.remove(*before)
        else:
            JOBS.labels(*before).set(_job_counts[before])
    if after is not None:
        _job_counts[after] += 1
        JOBS.labels(*after).set(_job_counts[after])


def _flipped_true(old: SFTJobStatus, new: SFTJobStatus, type: str) -> bool:
    def true(s: SFTJobStatus) -> bool:
        return any(c.type == type and c.status == "True" for c in s.conditions)

    return true(new) and not true(old)
