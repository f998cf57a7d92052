"""The trainer throughput benchmark's CPU mode: the harness works end to end (not the numbers)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

# The benchmark's main() installs SIGINT/SIGTERM handlers of its own.
pytestmark = [pytest.mark.trainer, pytest.mark.usefixtures("signal_handlers_restored")]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ROW_KEYS = {"model", "method", "config", "gpu", "capGiB", "tokensPerSecond", "mfu", "peakGiB", "workload"}
LIGER = ["fused linear cross-entropy", "RoPE", "LigerRMSNorm", "LigerSwiGLUMLP"]


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
    assert results["meta"]["workload"] == "issue: lengths 8..128, LoRA dropout 0.05"
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
        "predictedAllocatorGiB": 37.33,
        "liger": True,
        "ligerKernels": LIGER,
        "status": "ok",
        "stepsDone": 20,
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


def test_the_plans_check_measures_every_methods_plan_under_both_caps_then_the_seed_then_l40s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runs = importlib.import_module("throughput_runs").MODES["plans"].runs
    assert [r.name for r in runs] == [
        "1.1B/full/planned-A40",
        "7B/lora/planned-A40",
        "7B/qlora/planned-A40",
        "1.1B/full/planned-A800",
        "7B/lora/planned-A800",
        "7B/qlora/planned-A800",
        "1.1B/full/seed",
        "1.1B/full/plain",
        "1.1B/full/plain+liger",
        "1.1B/full/planned-L40S",
        "7B/lora/planned-L40S",
        "7B/qlora/planned-L40S",
    ]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"ligerKernels": []}, "planned with Liger, ran without its fused linear cross-entropy"),
        ({"status": "partial", "stepsDone": 1}, "cut off before step 2 ended, the first at the full peak"),
    ],
)
def test_rows_whose_numbers_say_nothing_about_their_plan_get_no_verdict_and_say_why(
    monkeypatch: pytest.MonkeyPatch, changes: dict[str, object], reason: str
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("throughput_results")
    rows = [planned_row(**changes), planned_row(status="partial", stepsDone=2)]
    results.finish_rows(rows)
    assert rows[0]["notJudged"] == reason
    assert not {"peakVsEstimate", "withinEstimate", "fitsCard", "verdict"} & set(rows[0])
    assert rows[1]["withinEstimate"] and rows[1]["verdict"] == "misses 50% by 5.0 pts"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_after_three_steps_leaves_a_partial_row_with_their_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: signal.Signals
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")
    tiny = benchmark.MODES["tiny"]
    plain = next(r for r in tiny.runs if r.name == "tiny/full/plain")
    monkeypatch.setitem(benchmark.MODES, "tiny", dataclasses.replace(tiny, runs=[plain], steps=6))
    started = []

    def stopped_at_the_fourth(*args: Any, **kwargs: Any) -> Any:
        started.append(1)
        if len(started) == 4:
            os.kill(os.getpid(), stop)  # what `timeout --signal=INT` (or a SIGTERM) sends
        return real_step(*args, **kwargs)

    real_step = benchmark.train_step
    monkeypatch.setattr(benchmark, "train_step", stopped_at_the_fourth)
    for number in (signal.SIGINT, signal.SIGTERM):  # as for a command started without job control
        signal.signal(number, signal.SIG_IGN)
    assert benchmark.main(["--tiny", "--out", str(tmp_path)]) == 130

    [row] = json.loads((tmp_path / "trainer-throughput-tiny.json").read_text())["rows"]
    assert row["status"] == "partial" and "after 3 of 6 steps" in row["note"]
    assert row["stepsDone"] == 3 and row["timedSteps"] == 2  # the first step is discarded
    assert row["tokensPerSecond"] > 0 and row["lastLoss"] > 0


def test_a_planned_row_identical_to_a_capped_run_keeps_its_own_settings_and_gets_no_mfu_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """7B LoRA at 46 GiB, accumulation capped at 4: the A40 plan's settings are plain+Liger's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")
    full = benchmark.MODES["full"]
    runs = [r for r in full.runs if r.name in ("7B/lora/plain+liger", "7B/lora/planned-A40")]
    monkeypatch.setitem(benchmark.MODES, "tiny", dataclasses.replace(full, runs=runs, samples=50))
    measured = []

    def measure(
        run: Any, mode: Any, device: Any, examples: Any, peak: Any, row: dict[str, Any], *_: Any
    ) -> None:
        measured.append(run.name)
        numbers = {"tokensPerSecond": 12_000.0, "mfu": 0.42, "peakGiB": 33.8, "peakReservedGiB": 36.0}
        row |= benchmark.configure(run, mode)[1] | numbers | {"status": "ok", "ligerKernels": LIGER}

    monkeypatch.setattr(benchmark, "measure", measure)
    assert benchmark.main(["--tiny", "--max-accumulation", "4", "--out", str(tmp_path)]) == 0

    rows = json.loads((tmp_path / "trainer-throughput-tiny-accum4.json").read_text())["rows"]
    assert measured == ["7B/lora/plain+liger"]
    liger, planned = rows
    assert (liger["accumulationCapped"], liger["accumulation"]) == (False, 4)
    assert (planned["accumulationCapped"], planned["accumulation"], planned["microBatch"]) == (True, 4, 1)
    assert planned["sameAs"] == "7B/lora/plain+liger" and planned["tokensPerSecond"] == 12_000.0
    assert planned["verdict"] == "n/a (accumulation capped at 4)" and "meetsTarget" not in planned
    table = (tmp_path / "trainer-throughput-tiny-accum4.md").read_text()
    assert (
        "identical configuration to 7B/lora/plain+liger: measured once, this row compares nothing new"
        in table
    )


def test_the_anchor_workload_samples_plans_and_labels_rows_as_the_anchors_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    benchmark = importlib.import_module("trainer_throughput")
    anchors, issue = (benchmark.MODES["full"].with_workload(w) for w in ("anchors", "issue"))
    lora_a40 = next(r for r in anchors.runs if r.name == "7B/lora/planned-A40")
    planned = benchmark.configure(lora_a40, anchors)[1]
    assert (planned["sampleLengths"], planned["loraDropout"]) == ("32..2048", 0.0)
    # No dropout masks: the planner plans for the dropout the run trains with.
    assert planned["predictedAllocatorGiB"] < benchmark.configure(lora_a40, issue)[1]["predictedAllocatorGiB"]
    lengths = [len(e.input_ids) for e in benchmark.synthetic_examples(2000, 300, 32, 2048, 320)]
    assert min(lengths) == 32 and max(lengths) == 2048

    args = ["--tiny", "--workload", "anchors", "--only", "^tiny/lora/planned-A40$", "--out", str(tmp_path)]
    assert benchmark.main(args) == 0
    [row] = json.loads((tmp_path / "trainer-throughput-tiny-anchors.json").read_text())["rows"]
    assert (row["status"], row["workload"], row["sampleLengths"], row["loraDropout"]) == (
        "ok",
        "anchors",
        "32..128",  # the tiny mode's packed rows are 128 tokens
        0.0,
    )
