"""SFTJobOperatorNotReconciling over made-up series of the operator's reconcile counter: an operator that is
up and scraped but whose every pass fails is alerted; one failing some passes, or idle, is not. The job
alerts (SFTJobFailed, SFTJobRestartsClimbing, SFTJobOOMReplans) count only this release's operator."""

from __future__ import annotations

from pathlib import Path

from helmchart import NAMESPACE, RELEASE
from promrules import fires, promtool_test, quiet

NOT_RECONCILING = "SFTJobOperatorNotReconciling"
# The ServiceMonitor's scrape of the chart's metrics Service: its job label is the Service's name.
SCRAPE_LABELS = f'job="{RELEASE}-sftjob-operator-metrics",namespace="{NAMESPACE}",pod="{RELEASE}-op-1"'
PASSES = "sftjob_operator_reconcile_total"


def failing(minute: int, failed: int) -> dict[str, object]:
    return fires(
        minute,
        NOT_RECONCILING,
        {},
        f"{failed} reconcile passes failed in the last 5 minutes and none succeeded for 15 minutes: "
        "SFTJobs are not updated, failed attempts are not restarted.",
    )


def test_an_operator_whose_passes_all_fail_is_alerted_15_minutes_after_its_last_success(
    tmp_path: Path,
) -> None:
    # Passes succeed until 30m, then every one fails (e.g. an API error on each status write).
    series = {
        f'{PASSES}{{result="success"}}': "0+10x30 300x60",
        f'{PASSES}{{result="error"}}': "0x30 0+20x60",
        f'{PASSES}{{result="refused"}}': "0x90",
    }
    checks = [quiet(30, NOT_RECONCILING), quiet(44, NOT_RECONCILING), failing(45, 100), failing(80, 100)]
    promtool_test(tmp_path, series, SCRAPE_LABELS, checks)


def test_an_operator_whose_creates_are_all_refused_from_its_start_is_alerted(tmp_path: Path) -> None:
    # An upgrade left the RBAC without pod create: every pass of the new operator is refused.
    series = {
        f'{PASSES}{{result="success"}}': "0x40",
        f'{PASSES}{{result="error"}}': "0x40",
        f'{PASSES}{{result="refused"}}': "0+4x40",
    }
    checks = [quiet(5, NOT_RECONCILING), quiet(10, NOT_RECONCILING), failing(11, 20)]
    promtool_test(tmp_path, series, SCRAPE_LABELS, checks)


def test_an_operator_failing_some_passes_while_others_succeed_is_not_alerted(tmp_path: Path) -> None:
    # One job's passes keep failing (its status says why) while the others reconcile.
    series = {
        f'{PASSES}{{result="success"}}': "0+10x90",
        f'{PASSES}{{result="error"}}': "0+2x90",
        f'{PASSES}{{result="refused"}}': "0+2x90",
    }
    promtool_test(tmp_path, series, SCRAPE_LABELS, [quiet(m, NOT_RECONCILING) for m in (20, 60, 90)])


def test_an_idle_operator_without_jobs_is_not_alerted(tmp_path: Path) -> None:
    series = {f'{PASSES}{{result="{result}"}}': "0x90" for result in ("success", "error", "refused")}
    promtool_test(tmp_path, series, SCRAPE_LABELS, [quiet(m, NOT_RECONCILING) for m in (20, 90)])


def test_another_releases_failing_operator_is_not_alerted_as_this_one(tmp_path: Path) -> None:
    other = 'job="other-sftjob-operator-metrics",namespace="other",pod="other-op-1"'
    series = {f'{PASSES}{{result="error"}}': "0+20x60", f'{PASSES}{{result="success"}}': "0x60"}
    promtool_test(tmp_path, series, other, [quiet(30, NOT_RECONCILING), quiet(60, NOT_RECONCILING)])


# The job alerts over the operator's job counters, with two releases' operators scraped by one Prometheus
# (one release per team, docs/install.md): only this release's counters reach this release's rules.
OTHER_OPERATOR = 'job="other-sftjob-operator-metrics",namespace="team-b",pod="other-op-1"'
SCRAPE = 'endpoint="metrics"'  # carried by both releases' series


def both_releases(this: str, other: str, *counters: str) -> dict[str, str]:
    """Each of ``counters`` (a series name, labels of its own allowed) from both operators: this
    release's samples ``this``, the other's ``other``."""
    return {
        f"{name[:-1]},{scrape}}}" if name.endswith("}") else f"{name}{{{scrape}}}": values
        for name in counters
        for scrape, values in ((SCRAPE_LABELS, this), (OTHER_OPERATOR, other))
    }


def test_another_releases_failed_job_is_not_alerted_by_this_release_but_its_own_is(tmp_path: Path) -> None:
    # The other team's job fails at 10m, one of this team's at 40m.
    series = both_releases("0x40 1x40", "0x10 1x70", 'sftjob_jobs_finished_total{result="Failed"}')
    checks = [
        quiet(15, "SFTJobFailed"),
        quiet(35, "SFTJobFailed"),
        fires(
            45,
            "SFTJobFailed",
            {},
            "1 SFTJob(s) ended Failed in the last 10 minutes. kubectl get sftjobs -A shows which; the Failed "
            "condition says why.",
        ),
    ]
    promtool_test(tmp_path, series, SCRAPE, checks)


def test_another_releases_restarts_are_not_alerted_by_this_release_but_its_own_are(tmp_path: Path) -> None:
    # The other team's jobs restart after CUDA OOMs from 10m on (six within the hour, re-planned each
    # time); this team's from 70m on: three in the hour reach the default threshold (3) at 72m.
    series = both_releases(
        "0x70 1 2 3 3x60",
        "0x10 1+1x5 6x120",
        'sftjob_restarts_total{failure_class="CudaOOM"}',
        "sftjob_oom_replans_total",
    )
    checks = [
        quiet(40, "SFTJobRestartsClimbing"),
        quiet(65, "SFTJobRestartsClimbing"),
        quiet(40, "SFTJobOOMReplans"),
        quiet(65, "SFTJobOOMReplans"),
        fires(
            100,
            "SFTJobRestartsClimbing",
            {"failure_class": "CudaOOM"},
            "3 restarts for CudaOOM in the last hour.",
        ),
        fires(
            100,
            "SFTJobOOMReplans",
            {},
            "3 CUDA OOM re-plans in the last hour: the planner's memory estimate was too low for these jobs, "
            "and each re-plan costs a restart.",
        ),
    ]
    promtool_test(tmp_path, series, SCRAPE, checks)
