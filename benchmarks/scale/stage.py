"""One stage of the benchmark: create a batch of jobs at a rate, wait until they run, measure.

Stages are cumulative (100, then 900 more to reach 1,000, ...), so stage k is measured with the jobs
of the earlier stages still live: latencies and API requests are per job of that stage, memory is the
controller's at the end of it. A stage ends when every pod runs and every job object says so (the
controller has caught up); then a quiet window with no creates shows what the controller spends on
live jobs that need nothing (polling would show up here as requests that grow with the live jobs).

A burst offered faster than the control plane can go measures throughput, and its latencies are mostly
queueing: the last job waits for every job before it. The latency a user sees on a busy cluster is the
probe's: after the quiet window, a few more jobs offered at a rate the cluster sustains, measured with
the stage's jobs live (how clusterloader2 separates its pod-startup SLO from its throughput tests).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scale import apimetrics, procstat
from scale.creator import create_at_rate
from scale.subjects import Subject
from scale.watch import Tracker
from scale.workload import gpu_type_for, job_name

POLL_SECONDS = 0.5
PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Settings:
    rate: float  # creates offered per second
    workers: int  # concurrent create requests at most
    settle_timeout: float  # seconds after the last create to wait for every job to run
    steady_seconds: float  # the quiet window after the stage
    probe: int = 0  # jobs in the probe after each stage's quiet window (0: none)
    probe_rate: float = 10.0  # the probe's creates per second


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50/p95/p99 and max, in seconds; ``n`` is how many values there were."""
    ordered = sorted(values)
    out: dict[str, float | int | None] = {"n": len(ordered)}
    for p in PERCENTILES:
        out[f"p{p}"] = round(ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)], 3) if ordered else None
    out["max"] = round(ordered[-1], 3) if ordered else None
    return out


def run_stage(
    subject: Subject,
    tracker: Tracker,
    fetch_api: Callable[[], str],
    pids: dict[str, int],
    first: int,
    last: int,
    settings: Settings,
) -> dict[str, Any]:
    """Create jobs ``first`` .. ``last - 1``, wait until their pods run and the controller shows them
    running (the job is ``ready``), then return the stage's figures."""
    names = [job_name(i) for i in range(first, last)]
    types = {job_name(i): gpu_type_for(i) for i in range(first, last)}
    load0 = procstat.load_average()
    api0, use0, ops0 = apimetrics.parse(fetch_api()), procstat.usages(pids), subject.counters()
    created = create_at_rate(lambda n: subject.create(n, types[n]), names, settings.rate, settings.workers)
    wanted = set(created.sent)
    _wait_running(tracker, wanted, settings.settle_timeout)
    settled = time.monotonic()
    api1, use1, ops1 = apimetrics.parse(fetch_api()), procstat.usages(pids), subject.counters()
    time.sleep(settings.steady_seconds)
    api2, use2 = apimetrics.parse(fetch_api()), procstat.usages(pids)

    requests, background = apimetrics.split(apimetrics.delta(api0, api1))
    quiet, quiet_background = apimetrics.split(apimetrics.delta(api1, api2))
    stage_seconds = settled - created.started
    live = last
    controller = subject.controller
    return {
        "liveJobs": live,
        "createdJobs": len(created.sent),
        "createErrors": len(created.errors),
        "createErrorSample": next(iter(created.errors.values()), None),
        "offeredRate": settings.rate,
        "createRate": round(created.rate, 1),
        "createToPodCreated": _latencies(created.sent, tracker.times("podCreated")),
        "createToPodScheduled": _latencies(created.sent, tracker.times("podScheduled")),
        "createToPodRunning": _latencies(created.sent, tracker.times("podRunning")),
        "createToReady": _latencies(created.sent, tracker.times("ready")),
        "jobsPerSecond": _throughput(created.started, created.sent, tracker.times("podCreated")),
        "readyPerSecond": _throughput(created.started, created.sent, tracker.times("ready")),
        "stageSeconds": round(stage_seconds, 1),
        "controller": {
            "process": controller,
            "cpuSeconds": _cpu(use0, use1, controller),
            "cpuSecondsPerJob": _ratio(_cpu(use0, use1, controller), len(wanted)),
            "rssMiB": _mib(use1, controller, peak=False),
            "peakRssMiB": _mib(use1, controller, peak=True),
        },
        "cpuSecondsByProcess": procstat.cpu_delta(use0, use1),
        "apiRequests": sum(requests.values()),
        "apiRequestsPerJob": _ratio(sum(requests.values()), len(wanted)),
        "apiRequestsPerJobByVerb": apimetrics.per(requests, len(wanted)),
        "backgroundRequestsPerSecond": _ratio(sum(background.values()), stage_seconds, digits=2),
        "subjectCounters": {k: round(ops1[k] - ops0.get(k, 0.0), 3) for k in ops1},
        "steadyState": {
            "seconds": settings.steady_seconds,
            "apiRequestsPerSecond": round(sum(quiet.values()) / settings.steady_seconds, 2),
            "apiRequestsPerLiveJobPerMinute": _ratio(
                sum(quiet.values()) * 60 / settings.steady_seconds, live, digits=4
            ),
            "byVerbPerSecond": apimetrics.per(quiet, settings.steady_seconds),
            "backgroundRequestsPerSecond": _ratio(
                sum(quiet_background.values()), settings.steady_seconds, digits=2
            ),
            "controllerCpuCores": _ratio(_cpu(use1, use2, controller), settings.steady_seconds, digits=4),
        },
        "loadAverage": {"start": load0, "end": procstat.load_average()},
    }


def run_probe(subject: Subject, tracker: Tracker, first: int, settings: Settings) -> dict[str, Any]:
    """Create ``settings.probe`` jobs from index ``first`` at the probe's rate, wait until they run,
    return their latencies."""
    names = [job_name(i) for i in range(first, first + settings.probe)]
    types = {name: gpu_type_for(i) for i, name in enumerate(names, start=first)}
    created = create_at_rate(
        lambda n: subject.create(n, types[n]), names, settings.probe_rate, settings.workers
    )
    _wait_running(tracker, set(created.sent), settings.settle_timeout)
    return {
        "liveJobsBefore": first,
        "createdJobs": len(created.sent),
        "createErrors": len(created.errors),
        "offeredRate": settings.probe_rate,
        "createToPodCreated": _latencies(created.sent, tracker.times("podCreated")),
        "createToPodRunning": _latencies(created.sent, tracker.times("podRunning")),
        "createToReady": _latencies(created.sent, tracker.times("ready")),
    }


def _wait_running(tracker: Tracker, wanted: set[str], timeout: float) -> None:
    """Until every wanted job's pod runs and the job object says so, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(
        tracker.count(m, wanted) < len(wanted) for m in ("podRunning", "ready")
    ):
        time.sleep(POLL_SECONDS)


def _latencies(sent: dict[str, float], seen: dict[str, float]) -> dict[str, Any]:
    values = [seen[name] - t for name, t in sent.items() if name in seen]
    return {**percentiles(values), "missing": len(sent) - len(values)}


def _throughput(started: float, sent: dict[str, float], seen: dict[str, float]) -> float | None:
    """Jobs of this stage that got there, per second from the first create to the last of them."""
    times = [seen[name] for name in sent if name in seen]
    return round(len(times) / (max(times) - started), 1) if times and max(times) > started else None


def _cpu(before: dict[str, procstat.Usage], after: dict[str, procstat.Usage], name: str) -> float | None:
    if name not in before or name not in after:
        return None
    return round(after[name].cpu_seconds - before[name].cpu_seconds, 2)


def _mib(use: dict[str, procstat.Usage], name: str, *, peak: bool) -> float | None:
    if name not in use:
        return None
    return round((use[name].peak_rss_bytes if peak else use[name].rss_bytes) / procstat.MIB, 1)


def _ratio(value: float | None, divisor: float, digits: int = 3) -> float | None:
    return round(value / divisor, digits) if value is not None and divisor > 0 else None
