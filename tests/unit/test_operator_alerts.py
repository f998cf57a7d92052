"""SFTJobOperatorNotReconciling and SFTJobCreatesRefused over made-up series of the operator's reconcile
counter: an operator that is up and scraped but whose every pass fails is alerted (critical for errors, a
warning for refused creates); one failing some passes, or idle, is not. The job alerts (SFTJobFailed,
SFTJobRestartsClimbing, SFTJobOOMReplans) count only this release's operator. Every operator alert carries
the namespace and job labels of its release's operator, so two teams' alerts stay apart in Alertmanager."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from helmchart import NAMESPACE, RELEASE, helm, one, template_args
from promrules import fires, promtool, promtool_test, quiet, rule

NOT_RECONCILING = "SFTJobOperatorNotReconciling"
REFUSED = "SFTJobCreatesRefused"
# The ServiceMonitor's scrape of the chart's metrics Service: its job label is the Service's name.
OPERATOR_JOB = f"{RELEASE}-sftjob-operator-metrics"
SCRAPE_LABELS = f'job="{OPERATOR_JOB}",namespace="{NAMESPACE}",pod="{RELEASE}-op-1"'
# What each operator alert carries of the scrape: which release's operator it is about.
OPERATOR = {"job": OPERATOR_JOB, "namespace": NAMESPACE}
PASSES = "sftjob_operator_reconcile_total"


def failing(minute: int, failed: int) -> dict[str, object]:
    return fires(
        minute,
        NOT_RECONCILING,
        OPERATOR,
        f"{failed} reconcile passes failed in the last 5 minutes and none succeeded for 15 minutes: "
        "SFTJobs are not updated, failed attempts are not restarted.",
    )


def refused(minute: int, passes: int) -> dict[str, object]:
    return fires(
        minute,
        REFUSED,
        OPERATOR,
        f"{passes} reconcile passes were refused in the last 5 minutes and none succeeded for 15 minutes: "
        "a quota, Pod Security, an admission webhook or missing RBAC refuses the pods (or other children) "
        "of the jobs this operator serves, so they do not start.",
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
    promtool_test(tmp_path, series, SCRAPE_LABELS, [*checks, quiet(80, REFUSED)])


def test_an_operator_whose_creates_are_all_refused_from_its_start_gets_a_warning_not_a_page(
    tmp_path: Path,
) -> None:
    # An upgrade left the RBAC without pod create: every pass of the new operator is refused. The
    # counter cannot tell that from one job's quota (below), so it is a warning, not the critical page.
    series = {
        f'{PASSES}{{result="success"}}': "0x40",
        f'{PASSES}{{result="error"}}': "0x40",
        f'{PASSES}{{result="refused"}}': "0+4x40",
    }
    checks = [quiet(5, REFUSED), quiet(10, REFUSED), refused(11, 20)]
    promtool_test(
        tmp_path, series, SCRAPE_LABELS, [*checks, quiet(11, NOT_RECONCILING), quiet(40, NOT_RECONCILING)]
    )


def test_the_only_job_refused_by_its_namespaces_quota_is_a_warning_not_a_critical_page(
    tmp_path: Path,
) -> None:
    # A release serving one namespace whose single SFTJob's pods a ResourceQuota refuses from the start:
    # every pass (one each 30 s, the error backoff's cap) is refused and no other job succeeds.
    series = {
        f'{PASSES}{{result="success"}}': "0x60",
        f'{PASSES}{{result="error"}}': "0x60",
        f'{PASSES}{{result="refused"}}': "0+2x60",
    }
    checks = [quiet(minute, NOT_RECONCILING) for minute in (20, 60)] + [refused(20, 10), refused(60, 10)]
    promtool_test(tmp_path, series, SCRAPE_LABELS, checks)


def test_an_operator_failing_some_passes_while_others_succeed_is_not_alerted(tmp_path: Path) -> None:
    # One job's passes keep failing (its status says why) while the others reconcile.
    series = {
        f'{PASSES}{{result="success"}}': "0+10x90",
        f'{PASSES}{{result="error"}}': "0+2x90",
        f'{PASSES}{{result="refused"}}': "0+2x90",
    }
    checks = [quiet(m, alert) for m in (20, 60, 90) for alert in (NOT_RECONCILING, REFUSED)]
    promtool_test(tmp_path, series, SCRAPE_LABELS, checks)


def test_an_idle_operator_without_jobs_is_not_alerted(tmp_path: Path) -> None:
    series = {f'{PASSES}{{result="{result}"}}': "0x90" for result in ("success", "error", "refused")}
    checks = [quiet(m, alert) for m in (20, 90) for alert in (NOT_RECONCILING, REFUSED)]
    promtool_test(tmp_path, series, SCRAPE_LABELS, checks)


def test_another_releases_failing_operator_is_not_alerted_as_this_one(tmp_path: Path) -> None:
    other = 'job="other-sftjob-operator-metrics",namespace="other",pod="other-op-1"'
    series = {
        f'{PASSES}{{result="error"}}': "0+20x60",
        f'{PASSES}{{result="refused"}}': "0+20x60",
        f'{PASSES}{{result="success"}}': "0x60",
    }
    checks = [quiet(m, alert) for m in (30, 60) for alert in (NOT_RECONCILING, REFUSED)]
    promtool_test(tmp_path, series, other, checks)


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
            OPERATOR,
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
            OPERATOR | {"failure_class": "CudaOOM"},
            "3 restarts for CudaOOM in the last hour.",
        ),
        fires(
            100,
            "SFTJobOOMReplans",
            OPERATOR,
            "3 CUDA OOM re-plans in the last hour: the planner's memory estimate was too low for these jobs, "
            "and each re-plan costs a restart.",
        ),
    ]
    promtool_test(tmp_path, series, SCRAPE, checks)


def team_rules(release: str, namespace: str) -> dict[str, Any]:
    """The operator rule group of a release of ``release`` in ``namespace`` as a Prometheus rule file."""
    sets = ("alerts.enabled=true", "metrics.serviceMonitor.enabled=true")
    out = helm(*template_args(sets=sets, namespace=namespace, release=release)).stdout
    groups = one([d for d in yaml.safe_load_all(out) if d], "PrometheusRule")["spec"]["groups"]
    return {"groups": groups}


def test_two_teams_failed_jobs_stay_two_alerts_each_naming_its_teams_operator(tmp_path: Path) -> None:
    # One release per team (docs/install.md), one Prometheus and Alertmanager: a job fails in each team
    # at 5m. Alerts with the same labels would be one alert to Alertmanager, routable to neither team.
    teams = {"team-a": "sftjob-team-a", "team-b": "sftjob-team-b"}
    inputs = []
    for namespace, release in teams.items():
        (tmp_path / f"{namespace}.yaml").write_text(yaml.safe_dump(team_rules(release, namespace)))
        scrape = f'job="{release}-sftjob-operator-metrics",namespace="{namespace}",pod="{release}-op"'
        inputs.append(
            {"series": f'sftjob_jobs_finished_total{{result="Failed",{scrape}}}', "values": "0x5 1x20"}
        )
    description = (
        "1 SFTJob(s) ended Failed in the last 10 minutes. kubectl get sftjobs -A shows which; the Failed "
        "condition says why."
    )
    annotations = rule("SFTJobFailed")["annotations"] | {"description": description}
    expected = [
        {
            "exp_labels": {
                "job": f"{release}-sftjob-operator-metrics",
                "namespace": namespace,
                "severity": "warning",
            },
            "exp_annotations": annotations,
        }
        for namespace, release in teams.items()
    ]
    test = {
        "rule_files": [f"{namespace}.yaml" for namespace in teams],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "alert_rule_test": [{"eval_time": "8m", "alertname": "SFTJobFailed", "exp_alerts": expected}],
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
