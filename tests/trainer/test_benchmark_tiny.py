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
    lora = next(r for r in rows if r["method"] == "lora" and r["config"] == "planned")
    assert lora["status"] == "ok" and lora["sequence"] != "padded"  # packed LoRA, as planned on a GPU
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


def test_a_time_limit_during_profiling_keeps_the_runs_numbers_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")

    def interrupted(path: Path, step: object) -> None:
        raise KeyboardInterrupt  # what `timeout --signal=INT` raises

    monkeypatch.setattr(benchmark, "profiled_step", interrupted)
    args = ["--tiny", "--profile", "--only", "^tiny/full/(seed|plain)$", "--out", str(tmp_path)]
    assert benchmark.main(args) == 130

    rows = json.loads((tmp_path / "trainer-throughput-tiny.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["seed"]  # written, and the next run never started
    assert rows[0]["status"] == "ok" and rows[0]["tokensPerSecond"] > 0
    assert "profile cut short" in rows[0]["note"]


def planned_row(**changes: object) -> dict[str, object]:
    row = {
        "model": "7B",
        "method": "lora",
        "config": "planned",
        "planFor": "A40",
        "capGiB": 46.0,
        "accumulation": 32,
        "accumulationCapped": False,
        "requestedGlobalBatch": 32,
        "tokensPerSecond": 12_000.0,
        "mfu": 0.45,
        "peakGiB": 38.0,
        "peakReservedGiB": 40.0,
    }
    return row | changes


@pytest.mark.parametrize(
    ("changes", "verdict"),
    [
        ({}, "misses 50% by 5.0 pts"),
        ({"requestedGlobalBatch": 8}, "n/a (global batch 8)"),
        ({"accumulationCapped": True, "accumulation": 4}, "n/a (accumulation capped at 4)"),
    ],
)
def test_mfu_targets_are_judged_only_at_the_plans_own_settings(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, object], verdict: str
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("throughput_results")
    rows = [planned_row(**changes)]
    results.finish_rows(rows)
    assert rows[0]["verdict"] == verdict
    assert ("meetsTarget" in rows[0]) == verdict.startswith("misses")


def test_a_planned_peak_must_fit_the_card_itself_not_only_the_46_gib_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("throughput_results")
    rows = [planned_row(peakReservedGiB=43.0), planned_row(peakReservedGiB=45.5)]  # A40: 44.35 GiB
    results.finish_rows(rows)
    assert [r["fitsCard"] for r in rows] == [True, False]
    assert rows[0]["cardGiB"] == 44.35


def test_the_plans_check_measures_every_methods_46_gib_plan_before_the_80_gib_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runs = importlib.import_module("throughput_runs").MODES["plans"].runs
    assert [r.name for r in runs[:3]] == [
        "1.1B/full/planned-A40",
        "7B/lora/planned-A40",
        "7B/qlora/planned-A40",
    ]
    assert {r.plan_for for r in runs[-3:]} == {"A800"}
