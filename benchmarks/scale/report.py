"""The results document: machine facts, versions, the exact command, every stage, targets and ratios.

``build`` assembles the JSON; ``markdown`` renders the same as tables. Targets are the issue's (on two
cores); they are reported with the measured value and never asserted.
"""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from typing import Any

from scale import REPO_ROOT

MB = 1_000_000
TARGET_P99_SECONDS = 1.0  # create -> pods created, at 1,000 live jobs
TARGET_JOBS_PER_SECOND = 50.0
TARGET_RSS_BYTES = 250 * MB  # at 5,000 live jobs
TARGET_GROWTH = 1.5  # API requests per job at the largest stage / at the smallest: "O(1)"
# Idle requests per live job per minute: a job that needs nothing costs a request less than every 20 min.
TARGET_IDLE_PER_JOB_MINUTE = 0.05


def versions(bin_dir_name: str) -> dict[str, str]:
    found = {"python": platform.python_version(), "controlPlane": bin_dir_name}
    for package in ("kopf", "kubernetes", "pydantic"):
        found[package] = metadata.version(package)
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    found["sftjob"] = commit.stdout.strip() or "unknown"
    return found


def _stage_at(stages: list[dict[str, Any]], live: int) -> dict[str, Any] | None:
    """The first stage with at least ``live`` jobs."""
    return next((s for s in stages if s["liveJobs"] >= live), None)


def targets(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets against the operator's stages."""
    out: list[dict[str, Any]] = []
    at_1000, at_5000 = _stage_at(stages, 1000), _stage_at(stages, 5000)
    probe = at_1000.get("probe") if at_1000 else None
    if probe:
        p99 = probe["createToPodCreated"]["p99"]
        name = f"p99 create -> pods created at 1,000 live jobs (probe, {probe['offeredRate']:g} jobs/s)"
    else:
        p99 = at_1000["createToPodCreated"]["p99"] if at_1000 else None
        name = "p99 create -> pods created at 1,000 live jobs (burst)"
    out.append(_target(name, "<= 1 s", p99, "s", p99, 1.0, le=True))
    rates = [s["jobsPerSecond"] for s in stages if s["createdJobs"] >= 100 and s["jobsPerSecond"]]
    rate = min(rates) if rates else None
    out.append(
        _target("sustained jobs/s (slowest stage of >= 100 jobs)", ">= 50", rate, "/s", rate, 50, le=False)
    )
    rss = at_5000["controller"]["rssMiB"] if at_5000 else None
    rss_mb = round(rss * 1024 * 1024 / MB, 1) if rss is not None else None
    out.append(_target("operator RSS at 5,000 live jobs", "<= 250 MB", rss_mb, "MB", rss_mb, 250, le=True))
    per_job = [s["apiRequestsPerJob"] for s in stages if s["apiRequestsPerJob"]]
    growth = _div(per_job[-1], per_job[0]) if len(per_job) > 1 else None
    name = "API requests per job, largest stage / smallest (O(1))"
    out.append(_target(name, f"<= {TARGET_GROWTH}", growth, "x", growth, TARGET_GROWTH, le=True))
    # Polling shows as idle requests that grow with the live jobs; a ratio of two small rates is mostly
    # the control plane's own watch renewals, so the bound is on the rate per live job at the largest stage.
    last = stages[-1] if stages else None
    idle = last["steadyState"]["apiRequestsPerLiveJobPerMinute"] if last else None
    name = "quiet-window requests per live job per minute, largest stage (no polling)"
    out.append(
        _target(name, f"<= {TARGET_IDLE_PER_JOB_MINUTE}", idle, "", idle, TARGET_IDLE_PER_JOB_MINUTE, le=True)
    )
    return out


def _target(
    name: str, goal: str, shown: float | None, unit: str, value: float | None, bound: float, *, le: bool
) -> dict[str, Any]:
    met = None if value is None else (value <= bound if le else value >= bound)
    return {
        "target": name,
        "goal": goal,
        "measured": None if shown is None else f"{shown} {unit}".rstrip(),
        "met": met,
    }


LATENCIES = ("createToPodCreated", "createToPodRunning", "createToReady")


def ratios(operator: list[dict[str, Any]], floor: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operator / floor for stages of the same size."""
    rows = []
    for op, fl in zip(operator, floor, strict=False):
        row: dict[str, Any] = {"liveJobs": op["liveJobs"]}
        for key in LATENCIES:
            row[f"p99{key[0].upper()}{key[1:]}"] = _div(op[key]["p99"], fl[key]["p99"])
        if op.get("probe") and fl.get("probe"):
            row["probeP99CreateToPodCreated"] = _div(
                op["probe"]["createToPodCreated"]["p99"], fl["probe"]["createToPodCreated"]["p99"]
            )
        row["apiRequestsPerJob"] = _div(op["apiRequestsPerJob"], fl["apiRequestsPerJob"])
        row["controllerCpuSecondsPerJob"] = _div(
            op["controller"]["cpuSecondsPerJob"], fl["controller"]["cpuSecondsPerJob"]
        )
        rows.append(row)
    return rows


def _div(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def markdown(doc: dict[str, Any]) -> str:
    m, s = doc["machine"], doc["settings"]
    lines = [
        f"# Operator at scale — {doc['date']}",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Machine: {m['cores']} cores ({m['cpuModel']}), {m['memoryGiB']} GiB RAM, shared with other work; "
        f"load average at start {m['loadAverage']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
        + ".",
        "",
        f"Workload: {s['nodes']} fake GPU nodes {s['pools']} ({s['gpuCapacity']} GPUs), single-GPU LoRA "
        f"jobs cycling A800/A40/L40S, offered at {s['rate']}/s, stages up to {s['stages']} live jobs; "
        f"quiet window {s['steadySeconds']} s after each stage. Latencies are from the create request to "
        "the harness seeing the pod (watch), in seconds; *ready* is when the job object shows it "
        "running (SFTJob `status.phase` Running, Job `status.ready` 1). jobs/s: pods created per second "
        "over the stage. API requests exclude health checks, metric reads and KWOK's node heartbeats.",
        "",
    ]
    for name, result in doc["subjects"].items():
        lines += [f"## {name}: {result['description']}", "", *_stage_table(result["stages"]), ""]
        if any(st.get("probe") for st in result["stages"]):
            lines += [*_probe_table(result["stages"]), ""]
        last = result["stages"][-1] if result["stages"] else None
        if last:
            top = ", ".join(f"{k} {v}" for k, v in last["apiRequestsPerJobByVerb"].items())
            lines += [f"API requests per job at {last['liveJobs']} live jobs: {top}.", ""]
            quiet = ", ".join(f"{k} {v}" for k, v in last["steadyState"]["byVerbPerSecond"].items())
            lines += [f"Quiet window requests per second: {quiet or 'none'}.", ""]
            lines += [
                "Background (KWOK's node heartbeats: lease renewals and node status, left out of the figures"
                " above): "
                f"{last['backgroundRequestsPerSecond']} requests/s.",
                "",
            ]
    if doc.get("ratios"):
        lines += [
            "## operator / floor",
            "",
            "| live jobs | p99 to pods created | p99 to Running | p99 to ready | probe p99 to pods created "
            "| API req/job | controller CPU/job |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in doc["ratios"]:
            lines.append(
                f"| {r['liveJobs']} | {r['p99CreateToPodCreated']} | {r['p99CreateToPodRunning']} "
                f"| {r['p99CreateToReady']} | {r.get('probeP99CreateToPodCreated')} "
                f"| {r['apiRequestsPerJob']} | {r['controllerCpuSecondsPerJob']} |"
            )
        lines.append("")
    if doc.get("targets"):
        lines += ["## Targets (2 cores)", "", "| target | goal | measured | met |", "|---|---|---|---|"]
        for t in doc["targets"]:
            met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
            lines.append(f"| {t['target']} | {t['goal']} | {t['measured']} | {met} |")
        lines.append("")
    return "\n".join(lines)


def _stage_table(stages: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| live jobs | created/s | to pods created p50 / p95 / p99 | to scheduled p99 | to Running p99 "
        "| to ready p50 / p99 | jobs/s | controller CPU s (per job) | RSS MiB (peak) | API req/job "
        "| quiet req/s | load avg (end) |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stages:
        pc, ready, ctl = s["createToPodCreated"], s["createToReady"], s["controller"]
        missing = f" ({pc['missing']} missing)" if pc["missing"] else ""
        not_ready = f" ({ready['missing']} never)" if ready["missing"] else ""
        rows.append(
            f"| {s['liveJobs']} | {s['createRate']} | {pc['p50']} / {pc['p95']} / {pc['p99']}{missing} "
            f"| {s['createToPodScheduled']['p99']} | {s['createToPodRunning']['p99']} "
            f"| {ready['p50']} / {ready['p99']}{not_ready} | {s['jobsPerSecond']} "
            f"| {ctl['cpuSeconds']} ({ctl['cpuSecondsPerJob']}) | {ctl['rssMiB']} ({ctl['peakRssMiB']}) "
            f"| {s['apiRequestsPerJob']} | {s['steadyState']['apiRequestsPerSecond']} "
            f"| {s['loadAverage']['end'][0]} |"
        )
    return rows


def _probe_table(stages: list[dict[str, Any]]) -> list[str]:
    rows = [
        "Probes: after each stage's quiet window, jobs offered at a rate the cluster sustains, measured "
        "with the stage's jobs live (the latency a user sees on a busy cluster; the burst above measures "
        "throughput, and its latencies are mostly queueing).",
        "",
        "| live jobs | probe jobs at /s | to pods created p50 / p95 / p99 | to Running p99 "
        "| to ready p50 / p99 |",
        "|---:|---:|---|---:|---|",
    ]
    for s in stages:
        if not (p := s.get("probe")):
            continue
        pc, ready = p["createToPodCreated"], p["createToReady"]
        missing = f" ({pc['missing']} missing)" if pc["missing"] else ""
        rows.append(
            f"| {p['liveJobsBefore']} | {p['createdJobs']} at {p['offeredRate']:g} "
            f"| {pc['p50']} / {pc['p95']} / {pc['p99']}{missing} | {p['createToPodRunning']['p99']} "
            f"| {ready['p50']} / {ready['p99']} |"
        )
    return rows
