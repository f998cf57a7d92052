"""Helpers of ``benchmarks/operator_scale.py``: workload, creation, pod watch, process and API metrics."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
