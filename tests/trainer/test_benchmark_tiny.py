"""The trainer throughput benchmark's CPU mode: the harness works end to end (not the numbers)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.trainer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ROW_KEYS = {"model", "method", "config", "gpu", "capGiB", "tokensPerSecond", "mfu", "peakGiB"}


def test_tiny_benchmark_writes_json_and_markdown_with_every_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")
    assert benchmark.main(["--tiny", "--out", str(tmp_path)]) == 0

    results = json.loads((tmp_path / "trainer-throughput-tiny.json").read_text())
    rows = results["rows"]
    assert {r["config"] for r in rows} == {"seed", "plain", "plain+liger", "planned"}
    assert all(set(r) >= ROW_KEYS for r in rows if r["status"] == "ok")
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= 5 and all(r["tokensPerSecond"] > 0 for r in ok)
    assert next(r for r in rows if r["method"] == "qlora")["status"] == "skipped"  # no GPU here
    assert results["meta"]["command"] and results["meta"]["versions"]["torch"]
    table = (tmp_path / "trainer-throughput-tiny.md").read_text()
    assert "| tiny | full | planned | A800 |" in table


def test_profile_flag_writes_a_table_of_the_slowest_ops_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")
    assert benchmark.main(["--tiny", "--profile", "--only", "tiny/full/seed", "--out", str(tmp_path)]) == 0

    table = (tmp_path / "trainer-throughput-tiny-profile-tiny-full-seed.txt").read_text()
    assert "aten::mm" in table and "# of Calls" in table
