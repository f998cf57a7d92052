"""The trainer throughput benchmark as hack/gpu-check.sh runs it: stops at any point keep a row that
names its run, each run's wall limit, the plans on the tiny shape (the dry run), the fallback to the
anchors' seed, and what the results record about the session."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

# The benchmark's main() installs SIGINT/SIGTERM handlers of its own.
pytestmark = [pytest.mark.trainer, pytest.mark.usefixtures("signal_handlers_restored")]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmark(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("trainer_throughput")


def rows_of(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads(path.read_text())["rows"]
    return rows


@pytest.mark.parametrize("where", ["llama_namespace", "configure"])
def test_a_stop_before_a_run_has_begun_leaves_a_timeout_row_that_names_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, benchmark: Any, where: str
) -> None:
    real = getattr(benchmark, where)
    calls: list[str] = []

    def stopped_for_plain(*args: Any) -> Any:  # the seed runs; the plain run is stopped as it begins
        calls.append(where)
        plain_begins = args[0].config == "plain" if where == "configure" else len(calls) == 2
        if plain_begins:
            raise KeyboardInterrupt  # what `timeout --signal=INT` raises
        return real(*args)

    monkeypatch.setattr(benchmark, where, stopped_for_plain)
    args = ["--tiny", "--only", "^tiny/full/(seed|plain)$", "--out", str(tmp_path)]
    assert benchmark.main(args) == 130

    seed, plain = rows_of(tmp_path / "trainer-throughput-tiny.json")
    assert seed["status"] == "ok" and seed["tokensPerSecond"] > 0
    assert (plain["config"], plain["model"], plain["method"], plain["status"]) == (
        "plain",
        "tiny",
        "full",
        "timeout",
    )
    assert "stopped by the time limit after 0 of 2 steps" in plain["note"]


def test_a_stop_while_the_benchmark_starts_up_ends_it_with_130_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, benchmark: Any
) -> None:
    def interrupted(device: object) -> None:
        raise KeyboardInterrupt  # the budget ran out during the imports or the self-checks

    monkeypatch.setattr(benchmark, "attention_check", interrupted)
    assert benchmark.main(["--tiny", "--out", str(tmp_path)]) == 130
    assert not list(tmp_path.iterdir())


def test_a_run_past_its_wall_limit_with_steps_left_is_partial_with_its_timed_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, benchmark: Any
) -> None:
    tiny = benchmark.MODES["tiny"]
    monkeypatch.setitem(benchmark.MODES, "tiny", dataclasses.replace(tiny, steps=5))
    args = ["--tiny", "--run-seconds", "0.001", "--only", "^tiny/full/(seed|plain)$", "--out", str(tmp_path)]
    assert benchmark.main(args) == 0

    rows = rows_of(tmp_path / "trainer-throughput-tiny.json")
    assert [r["config"] for r in rows] == ["seed", "plain"]  # the limit stops a run, not the benchmark
    for row in rows:
        assert (row["status"], row["stepsDone"], row["timedSteps"]) == ("partial", 2, 1)
        assert "stopped by --run-seconds 0.001 after 2 of 5 steps" in row["note"]
        assert row["tokensPerSecond"] > 0


def test_the_dry_run_judges_the_tiny_plans_on_a_marked_fake_peak_and_copies_the_l40s_plan(
    tmp_path: Path, benchmark: Any
) -> None:
    only = "^tiny/full/(planned-A40|seed|planned-L40S)$"
    assert benchmark.main(["--tiny", "--plans", "--fake-peak", "--only", only, "--out", str(tmp_path)]) == 0

    results = json.loads((tmp_path / "trainer-throughput-tiny-plans.json").read_text())
    assert (results["meta"]["mode"], results["meta"]["fakePeak"]) == ("tiny-plans", True)
    a40, seed, l40s = results["rows"]
    assert a40["status"] == "ok" and a40["requestedGlobalBatch"] == 8
    assert a40["peakSource"] == "dry-run fake" and "peak memory made up (dry run)" in a40["note"]
    assert a40["peakVsEstimate"] == 0.05 and a40["withinEstimate"] and a40["fitsCard"]
    assert a40["ratioToSeed"] and seed["config"] == "seed" and seed["peakSource"] == "dry-run fake"
    assert l40s["sameAs"] == "tiny/full/planned-A40" and l40s["planFor"] == "L40S"


@pytest.mark.parametrize(
    "args", [["--fake-peak"], ["--fake-peak", "--plans"], ["--plans", "--quick"]], ids=" ".join
)
def test_flags_that_would_mix_made_up_numbers_or_step_counts_into_gpu_results_are_refused(
    benchmark: Any, args: list[str]
) -> None:
    with pytest.raises(SystemExit):
        benchmark.main(args)


def test_the_plans_cap_the_planned_rows_accumulation_but_keep_the_seed_guides_four_by_eight(
    benchmark: Any,
) -> None:
    plans = benchmark.MODES["plans"]
    fields = {r.name: benchmark.configure(r, plans)[1] for r in plans.runs if r.model == "1.1B"}
    assert all(f["accumulation"] <= 2 for name, f in fields.items() if "planned" in name)
    assert fields["1.1B/full/planned-A40"]["accumulationCapped"]
    seed = fields["1.1B/full/seed"]
    assert (seed["microBatch"], seed["accumulation"], seed["accumulationCapped"]) == (4, 8, False)


def test_rows_without_a_seed_of_their_own_are_compared_with_the_anchors_seed_only_on_an_h200(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("throughput_results")

    def row(model: str, method: str, config: str, rate: float) -> dict[str, Any]:
        return {
            "model": model,
            "method": method,
            "config": config,
            "capGiB": 80.0,
            "status": "ok",
            "tokensPerSecond": rate,
        }

    rows = [row("1.1B", "full", "planned", 65_560.0), row("7B", "lora", "planned", 7_318.0)]
    results.finish_rows(rows, "NVIDIA H200")
    assert [(r["ratioToSeed"], r["ratioToAnchorSeed"]) for r in rows] == [(None, 10.0), (None, 2.0)]
    assert "6,556 tokens/s" in rows[0]["anchorSource"] and "3,659 tokens/s" in rows[1]["anchorSource"]

    results.finish_rows(rows, "cpu")
    assert not {"ratioToAnchorSeed", "anchorSource"} & (set(rows[0]) | set(rows[1]))

    with_seed = [row("1.1B", "full", "planned", 65_560.0), row("1.1B", "full", "seed", 6_556.0)]
    results.finish_rows(with_seed, "NVIDIA H200")
    assert with_seed[0]["ratioToSeed"] == 10.0 and "ratioToAnchorSeed" not in with_seed[0]


def test_the_results_name_python_pydantic_and_the_gpu_sessions_own_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    results = importlib.import_module("throughput_results")
    session = "SFTJOB_GPU_CHECK_SECONDS=500 hack/gpu-check.sh"
    monkeypatch.setenv("SFTJOB_GPU_CHECK_COMMAND", session)
    meta = results.environment(torch.device("cpu"), None, "tiny", 2, 1, None) | {"workload": "issue"}
    assert meta["python"].count(".") == 2 and meta["versions"]["pydantic"]
    assert meta["sessionCommand"] == session

    results.write_results([], meta, tmp_path, "session")
    assert json.loads((tmp_path / "session.json").read_text())["meta"]["sessionCommand"] == session
    assert f"Session: `{session}`" in (tmp_path / "session.md").read_text()
