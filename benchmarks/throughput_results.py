"""Writing the trainer throughput benchmark's results: JSON, a Markdown table and a PNG bar chart.

Every file records the GPU, driver, library versions and the exact command, so a number can be traced
back to how it was measured.
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

from sftjob_trainer.preflight import read_driver_info


def environment(
    device: torch.device,
    peak: float | None,
    mode: str,
    steps: int,
    discard: int,
    max_accumulation: int | None,
) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in ("torch", "transformers", "peft", "liger-kernel", "bitsandbytes", "sftjob"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    driver = read_driver_info() if device.type == "cuda" else None
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
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
    ("ratioToSeed", "x seed"),
    ("verdict", "MFU target"),
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
        f"Command: `{meta['command']}`; driver {meta['driver']}, CUDA {meta['cuda']},"
        f" {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; bf16 matmul peak"
        f" {meta['matmulPeakTflops']} TFLOP/s; {meta['steps']} steps,"
        f" first {meta['discardedSteps']} discarded.",
        "",
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(_cell(k, r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
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
