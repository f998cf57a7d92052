"""The trainer throughput benchmark's results: each run's row from before it starts to its end (which
run it is, a stop's mark, a copy of an identical run), the verdicts on each row (ratio to the seed
config, or to the anchors' seed where the run measured none, MFU target, peak memory against the
planner's estimate and the card), or why a row gets none, and the files: JSON, a Markdown table, a PNG.

Every file records the GPU, driver, Python and library versions and the exact command (and the GPU
session's, hack/gpu-check.sh), so a number can be traced back to how it was measured.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from throughput_runs import GLOBAL_BATCH, Run  # beside this module

from sftjob.gpus import profile_for_type
from sftjob.memory import CUDA_CONTEXT_GIB
from sftjob_trainer.preflight import read_driver_info

# Issue 8's targets for the planned configs: (model, method, cap GiB) -> MFU, at the plan's own settings.
TARGETS = {("1.1B", "full", 80.0): 0.55, ("1.1B", "full", 46.0): 0.50, ("7B", "lora", 46.0): 0.50}
# Issue 4: a planned config's measured peak memory lies within this fraction of the estimate.
ESTIMATE_TOLERANCE = 0.15
# A run cut off by the time limit is judged on its finished steps from this many on: the optimizer's
# states exist from the end of the first, so the second is the first to reach the steady peak.
PEAK_STEPS = 2
# What liger_kernels_in calls Liger's loss: no logits in memory, as a plan with Liger is estimated.
LIGER_LOSS = "fused linear cross-entropy"
# The seed rows of shared/research/h200-anchors.md (HF Trainer, the seed guide's arguments: fp16, batch
# 4 x accumulation 8, padded; lengths 32..2,048; one H200, 2026-11-29), real tokens/s: what a row measured
# on an H200 is compared with where its own run has no seed row.
ANCHOR_SEEDS = {("1.1B", "full"): 6556.0, ("7B", "lora"): 3659.0}
ANCHOR_GPU = "H200"
ANCHOR_SOURCE = (
    "shared/research/h200-anchors.md seed row (HF Trainer, fp16, 4 x 8, padded, lengths 32..2048, H200)"
)
# What --fake-peak puts in a CPU dry run's rows: never a measurement, and the rows say so.
FAKE_PEAK_SOURCE = "dry-run fake"
FAKE_PEAK_NOTE = "peak memory made up (dry run): its verdicts test the code, not the plan"
# What finish_rows derives; cleared first, so rows copied between runs or finished twice stay right.
DERIVED = (
    "ratioToSeed",
    "ratioToAnchorSeed",
    "anchorSource",
    "peakVsEstimate",
    "withinEstimate",
    "cardGiB",
    "fitsCard",
    "targetMfu",
    "meetsTarget",
    "verdict",
    "notJudged",
)


def identity(run: Run, card_gib: float | None) -> dict[str, Any]:
    """A run's row before it starts: which run it is, so a stop at any point leaves a row that says so."""
    return {
        "model": run.model,
        "method": run.method,
        "config": run.config,
        "planFor": run.plan_for,
        "capGiB": run.cap_gib or card_gib,
        "tokensPerSecond": None,
        "mfu": None,
        "peakGiB": None,
    }


def add_note(row: dict[str, Any], note: str) -> None:
    row["note"] = "; ".join(filter(None, (row.get("note"), note)))


def stopped(row: dict[str, Any], steps: int) -> None:
    """Mark a row the time limit stopped before it ended: what its finished steps measured, if any."""
    if "status" not in row:
        done = row.get("stepsDone", 0)
        row["status"] = "partial" if done else "timeout"
        add_note(row, f"stopped by the time limit after {done} of {steps} steps")


def copied(source: Run, measured: dict[str, Any], run: Run, fields: dict[str, Any]) -> dict[str, Any]:
    """The row of a run whose settings are identical to an earlier run's: that run's numbers, this run's
    own settings and plan (so its verdicts see, say, that its accumulation was capped), and a note."""
    note = f"identical configuration to {source.name}: measured once, this row compares nothing new"
    print(f"{run.name}: {note}", flush=True)
    own = {"config": run.config, "planFor": run.plan_for, "sameAs": source.name, "wallSeconds": 0.0}
    return measured | fields | own | {"note": "; ".join(filter(None, (measured.get("note"), note)))}


def fake_peak(row: dict[str, Any]) -> dict[str, Any]:
    """A CPU dry run's made-up peak (``--fake-peak``, only with ``--tiny``): 5% over the planner's
    estimate where the row has one, so the verdict code runs; ``peakSource`` and the note mark it."""
    allocated = round((row.get("predictedAllocatorGiB") or 1.0) * 1.05, 6)
    note = row.get("note") or ""
    return {
        "peakGiB": allocated,
        "peakReservedGiB": round(allocated * 1.1, 6),
        "peakSource": FAKE_PEAK_SOURCE,
        "note": note if FAKE_PEAK_NOTE in note else "; ".join(filter(None, (note, FAKE_PEAK_NOTE))),
    }


def finish_rows(rows: list[dict[str, Any]], gpu: str | None = None) -> None:
    """Ratio to the seed config of the same model and method in the same run, or where the run has
    none, on an H200 (``gpu``), to the anchors' seed (``ratioToAnchorSeed``, ``anchorSource``); for
    planned rows the peak against the planner's estimate, whether it fits the card planned for, and the
    MFU target's verdict. Only rows with numbers (``ok``, or ``partial``: cut off by a time limit) are
    judged, and of those not the ones whose numbers say nothing about the plan: ``notJudged`` says why."""
    seeds = {(r["model"], r["method"]): r.get("tokensPerSecond") for r in rows if r["config"] == "seed"}
    for r in rows:
        for key in DERIVED:
            r.pop(key, None)
        seed = seeds.get((r["model"], r["method"]))
        rate = r.get("tokensPerSecond")
        r["ratioToSeed"] = round(rate / seed, 2) if seed and rate else None
        anchor = ANCHOR_SEEDS.get((r["model"], r["method"]))
        if not seed and anchor and rate and ANCHOR_GPU in (gpu or ""):
            r["ratioToAnchorSeed"] = round(rate / anchor, 2)
            r["anchorSource"] = f"{ANCHOR_SOURCE}: {anchor:,.0f} tokens/s"
        if r.get("status") not in ("ok", "partial"):  # an OOM's peak is only what came before it
            continue
        if reason := _not_judged(r):
            r["notJudged"] = reason
            continue
        estimate, measured = r.get("predictedAllocatorGiB"), r.get("peakGiB")
        if estimate and measured:
            r["peakVsEstimate"] = round(measured / estimate - 1, 3)
            r["withinEstimate"] = abs(r["peakVsEstimate"]) <= ESTIMATE_TOLERANCE
        if r["config"] == "planned":
            _judge_plan(r)


def _not_judged(r: dict[str, Any]) -> str | None:
    """Why a measured row's numbers say nothing about its plan (its estimate, card and MFU target)."""
    if r.get("predictedAllocatorGiB") and r.get("liger") and LIGER_LOSS not in (r.get("ligerKernels") or []):
        return "planned with Liger, ran without its fused linear cross-entropy"
    if r.get("status") == "partial" and r.get("stepsDone", 0) < PEAK_STEPS:
        return f"cut off before step {PEAK_STEPS} ended, the first at the full peak"
    return None


def _judge_plan(r: dict[str, Any]) -> None:
    """The caps (80/46 GiB) are a little above the cards' capacity: ``fitsCard`` checks the allocator's
    reserved peak against the card planned for, less what the planner keeps for the CUDA context."""
    reserved = r.get("peakReservedGiB")
    if r.get("planFor") and reserved is not None:
        r["cardGiB"] = profile_for_type(r["planFor"]).memory_gib
        r["fitsCard"] = reserved <= r["cardGiB"] - CUDA_CONTEXT_GIB
    target = TARGETS.get((r["model"], r["method"], r["capGiB"]))
    if target is None or r.get("mfu") is None:
        return
    r["targetMfu"] = target
    off_plan = []  # the targets are for the plan's settings: MFU rises with accumulation
    if r.get("requestedGlobalBatch") != GLOBAL_BATCH:
        off_plan.append(f"global batch {r.get('requestedGlobalBatch')}")
    if r.get("accumulationCapped"):
        off_plan.append(f"accumulation capped at {r['accumulation']}")
    if off_plan:
        r["verdict"] = f"n/a ({' / '.join(off_plan)})"
        return
    r["meetsTarget"] = r["mfu"] >= target
    shortfall = (target - r["mfu"]) * 100
    r["verdict"] = (
        f"meets {target:.0%}" if r["meetsTarget"] else f"misses {target:.0%} by {shortfall:.1f} pts"
    )


def environment(
    device: torch.device,
    peak: float | None,
    mode: str,
    steps: int,
    discard: int,
    max_accumulation: int | None,
) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in ("torch", "transformers", "peft", "liger-kernel", "bitsandbytes", "pydantic", "sftjob"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    driver = read_driver_info() if device.type == "cuda" else None
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        # hack/gpu-check.sh's own invocation, its SFTJOB_GPU_CHECK_* settings included, where it ran this.
        "sessionCommand": os.environ.get("SFTJOB_GPU_CHECK_COMMAND"),
        "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": driver.version if driver else None,
        "cuda": torch.version.cuda,
        "versions": versions,
        "matmulPeakTflops": round(peak / 1e12, 1) if peak else None,
        "mode": mode,
        "steps": steps,
        "discardedSteps": discard,
        "maxAccumulation": max_accumulation,
        "allocatorConfig": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }


COLUMNS = (
    ("model", "model"),
    ("method", "method"),
    ("config", "config"),
    ("planFor", "plan for"),
    ("capGiB", "cap GiB"),
    ("microBatch", "micro"),
    ("accumulation", "accum"),
    ("sequence", "seq"),
    ("tokensPerSecond", "tokens/s"),
    ("mfu", "MFU"),
    ("peakGiB", "peak GiB"),
    ("predictedPeakGiB", "planned GiB"),
    ("peakVsEstimate", "peak vs estimate"),
    ("fitsCard", "fits card"),
    ("ratioToSeed", "x seed"),
    ("ratioToAnchorSeed", "x anchor seed"),
    ("verdict", "MFU target"),
    ("notJudged", "not judged"),
    ("workload", "workload"),
    ("status", "status"),
    ("note", "note"),
)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return ""
    if key == "mfu":
        return f"{value:.1%}"
    if key == "peakVsEstimate":
        return f"{value:+.0%}"
    if key == "tokensPerSecond":
        return f"{value:,.0f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, stem: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r["gpu"] = meta["gpu"]
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Trainer throughput ({meta['mode']}), {meta['gpu']}, {meta['date']}",
        "",
        f"Command: `{meta['command']}`; Python {meta['python']}, driver {meta['driver']},"
        f" CUDA {meta['cuda']},"
        f" {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; bf16 matmul peak"
        f" {meta['matmulPeakTflops']} TFLOP/s; {meta['steps']} steps,"
        f" first {meta['discardedSteps']} discarded; workload {meta['workload']}.",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_cell(k, r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    if meta.get("sessionCommand"):
        lines += ["", f"Session: `{meta['sessionCommand']}`."]
    if sources := sorted({r["anchorSource"] for r in rows if r.get("anchorSource")}):
        lines += ["", "x anchor seed: over " + "; ".join(sources) + "."]
    paths[1].write_text("\n".join(lines) + "\n")
    png = _plot(rows, meta, out / f"{stem}.png")
    return paths + ([png] if png else [])


def _plot(rows: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> Path | None:
    try:  # optional: the plot is skipped where matplotlib is not installed
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return None
    done = [r for r in rows if r.get("tokensPerSecond")]
    if not done:
        return None
    labels = [
        f"{r['model']} {r['method']}\n{r['config']}{'-' + r['planFor'] if r['planFor'] else ''}" for r in done
    ]
    fig, ax = plt.subplots(figsize=(max(6, len(done) * 0.9), 4.5))
    ax.bar(range(len(done)), [r["tokensPerSecond"] for r in done], color="#4c72b0")
    ax.set_xticks(range(len(done)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("real tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"Trainer throughput on {meta['gpu']} ({meta['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
