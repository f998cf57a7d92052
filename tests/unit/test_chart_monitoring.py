"""The chart's monitoring: ServiceMonitor, PodMonitor, alert rules with their runbooks, and the Grafana
dashboards, as `helm template` renders them. What the alerts do over time is in test_operator_alerts.py
and test_training_alerts.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import CHART, ROOT, helm, one, render, template_args
from promrules import promtool

from sftjob import constants as c
from sftjob_operator.metrics import STARTUP_BUCKETS, STEP_BUCKETS


def test_monitors_and_rules_carry_the_labels_kube_prometheus_stack_selects_on() -> None:
    docs = render("monitoring")
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert one(docs, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not [d for d in render() if d["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")]


def test_pod_monitor_scrapes_the_rank_zero_trainer_pod_on_its_metrics_port() -> None:
    monitor = one(render("monitoring"), "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"] == {c.LABEL_ROLE: "trainer", c.LABEL_RANK: "0"}
    assert monitor["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["namespaceSelector"] == {"any": True}
    assert monitor["podTargetLabels"] == [c.LABEL_ATTEMPT]  # the trainer labels its metrics with the GPU


def test_service_monitor_scrapes_the_operator_metrics_service() -> None:
    docs = render("monitoring")
    monitor = one(docs, "ServiceMonitor")["spec"]
    service = one(docs, "Service")
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"


def runbook_anchors() -> set[str]:
    text = (ROOT / "docs" / "runbooks.md").read_text()
    return {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }


def test_every_alert_has_severity_summary_description_and_a_runbook_section() -> None:
    rule = one(render("monitoring"), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {a["alert"] for a in alerts} >= {
        "SFTJobOperatorNotReconciling",
        "SFTJobCreatesRefused",
        "SFTJobFailed",
        "SFTJobRestartsClimbing",
        "SFTJobOOMReplans",
        "SFTJobTrainingStalled",
        "SFTJobCheckpointTooOld",
        "SFTJobThroughputDropped",
        "SFTJobSlowerThanPlanned",
        "SFTJobGPUMemoryNearlyFull",
        "SFTJobTrackerFailing",
    }
    anchors = runbook_anchors()
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
        url = alert["annotations"]["runbook_url"]
        assert url.startswith("https://") and url.split("#")[1] in anchors, url
    stalled = next(a for a in alerts if a["alert"] == "SFTJobTrainingStalled")
    assert "[30m]" in stalled["expr"], "alerts.thresholds must reach the rules"


DASHBOARD_UIDS = {"fleet-overview.json": "sftjob-fleet", "training-job.json": "sftjob-training"}


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted((CHART / "dashboards").glob("*.json"))}


def test_dashboards_have_fixed_uids_and_query_through_the_datasource_variable() -> None:
    dashboards = load_dashboards()
    assert {name: d["uid"] for name, d in dashboards.items()} == DASHBOARD_UIDS
    for dashboard in dashboards.values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
                assert target["expr"].strip()


def test_panel_ids_and_positions_do_not_collide() -> None:
    for name, dashboard in load_dashboards().items():
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), name
        cells: set[tuple[int, int]] = set()
        for p in dashboard["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, p["title"])
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert cells.isdisjoint(area), (name, p["title"])
            cells |= area


def test_dashboards_ship_as_configmaps_the_grafana_sidecar_loads() -> None:
    maps = [
        d for d in render("monitoring") if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]
    ]
    assert len(maps) == len(DASHBOARD_UIDS)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Training"}
        ((key, body),) = cm["data"].items()
        assert key == f"{cm['metadata']['name']}.json"
        assert json.loads(body)["uid"] == DASHBOARD_UIDS[key.removeprefix("sft-sftjob-operator-dashboard-")]


def test_uninstalling_one_release_leaves_the_dashboard_files_of_another_in_grafanas_folder() -> None:
    """The Grafana sidecar writes each data key as a file into one folder, and deletes the files named by
    the keys of a ConfigMap that is deleted: two releases' keys must differ, or one release's uninstall
    deletes the other's dashboards."""
    keys = []
    for release in ("sftjob-team-a", "sftjob-team-b"):
        out = helm(*template_args(sets=("dashboards.namespace=monitoring",), release=release)).stdout
        maps = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]
        keys.append({key for cm in maps if "-dashboard-" in cm["metadata"]["name"] for key in cm["data"]})
    assert len(keys[0]) == len(DASHBOARD_UIDS) and keys[0].isdisjoint(keys[1])


def test_the_releases_beside_the_one_that_ships_the_dashboards_are_told_to_turn_them_off() -> None:
    # One copy serves every release (the fleet dashboard's operator variable); more are duplicate UIDs.
    maps = [
        d for d in render("namespaced") if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]
    ]
    assert maps == []
    words = " ".join((ROOT / "docs" / "install.md").read_text().split())
    assert "`rbac.userRoles=false`, `crds.enabled=false` and `dashboards.enabled=false`" in words


# ---------------------------------------------------------------------------------------------------
# Which rules render: each group only beside the monitor that scrapes its metrics.

BOTH_MONITORS = ("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true")


def rule_groups(*sets: str) -> list[dict[str, Any]]:
    """The PrometheusRule's groups, as a Prometheus rule file holds them (default thresholds)."""
    groups: list[dict[str, Any]] = one(render("default", ("alerts.enabled=true", *sets)), "PrometheusRule")[
        "spec"
    ]["groups"]
    return groups


def alert_names(*sets: str) -> set[str]:
    return {r["alert"] for g in rule_groups(*sets) for r in g["rules"]}


def test_each_rule_group_comes_only_with_the_monitor_that_scrapes_its_metrics() -> None:
    def names(*sets: str) -> list[str]:
        return [g["name"] for g in rule_groups(*sets)]

    assert names("metrics.podMonitor.enabled=true") == ["sftjob-training"]
    assert names("metrics.serviceMonitor.enabled=true") == ["sftjob-operator"]
    assert names(*BOTH_MONITORS) == ["sftjob-operator", "sftjob-training"]


def test_alerts_without_any_monitor_fail_instead_of_rendering_rules_that_never_fire() -> None:
    result = helm(*template_args(sets=("alerts.enabled=true",)), check=False)
    assert result.returncode != 0, "the chart rendered"
    assert "metrics.serviceMonitor.enabled" in result.stderr and "metrics.podMonitor.enabled" in result.stderr


def test_the_operator_down_alert_comes_only_with_the_service_monitor_whose_scrapes_it_watches() -> None:
    assert "SFTJobOperatorDown" not in alert_names("metrics.podMonitor.enabled=true")
    assert "SFTJobOperatorDown" in alert_names("metrics.serviceMonitor.enabled=true")


def test_an_operator_scaled_to_zero_on_purpose_is_not_paged_as_down() -> None:
    alerts = alert_names(*BOTH_MONITORS, "replicas=0")
    assert "SFTJobOperatorDown" not in alerts
    assert "SFTJobFailed" in alerts


def test_the_training_dashboard_shows_the_phase_of_a_job_still_setting_up() -> None:
    dashboard = load_dashboards()["training-job.json"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any("sftjob_train_phase" in e for e in exprs)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "sftjob_train_step" in variables["sftjob"]["definition"]  # served from the start of a run


def queries(dashboard: str) -> dict[str, list[str]]:
    """Each panel's title and its PromQL expressions."""
    panels = load_dashboards()[dashboard]["panels"]
    return {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in panels if p.get("targets")}


def test_every_training_dashboard_panel_shows_only_the_chosen_job() -> None:
    for title, exprs in queries("training-job.json").items():
        for expr in exprs:
            assert 'namespace="$namespace"' in expr and "$sftjob" in expr, title


def test_the_progress_gauge_reads_zero_not_nan_while_the_total_is_unknown() -> None:
    (expr,) = queries("training-job.json")["Progress"]
    assert "/ clamp_min(max(sftjob_train_total_steps" in expr and expr.endswith(", 1)")


def test_restarts_are_drawn_as_a_rate_per_hour_not_as_increases_over_overlapping_windows() -> None:
    for dashboard in DASHBOARD_UIDS:
        for title, exprs in queries(dashboard).items():
            assert not any("increase(" in e and "[$__rate_interval]" in e for e in exprs), title
    (expr,) = queries("fleet-overview.json")["Restarts by failure class"]
    assert expr == (
        'sum by (failure_class) (rate(sftjob_restarts_total{job=~"$operator"}[$__rate_interval])) * 3600'
    )


def test_every_fleet_panel_sums_only_the_chosen_operators_all_of_them_at_first() -> None:
    for title, exprs in queries("fleet-overview.json").items():
        for expr in exprs:
            named = re.findall(r"\bsftjob_[a-zA-Z0-9_:]+", expr)
            assert named and expr.count('job=~"$operator"') == len(named), title
    variables = {v["name"]: v for v in load_dashboards()["fleet-overview.json"]["templating"]["list"]}
    chosen = variables["operator"]
    assert chosen["definition"] == "label_values(sftjob_operator_build_info, job)"  # one per release
    assert chosen["multi"] and chosen["includeAll"] and chosen["current"]["value"] == ["$__all"]


def test_the_start_latency_panel_says_it_measures_pods_running_not_the_first_step() -> None:
    titles = [
        title
        for title, exprs in queries("fleet-overview.json").items()
        if any("sftjob_job_time_to_training_started_seconds" in e for e in exprs)
    ]
    assert titles == ["Time from creation to pods Running (first attempt; jobs in the time range)"]


def test_ratio_thresholds_given_with_helm_set_reach_the_rules_as_valid_promql(tmp_path: Path) -> None:
    # helm --set gives a decimal as a string; the schema takes it like the number a values file gives.
    sets = (
        "alerts.thresholds.throughputDropRatio=0.3",
        "alerts.thresholds.gpuMemoryRatio=.9",
        "alerts.thresholds.plannedThroughputRatio=0.25",
    )
    rules = {r["alert"]: r["expr"] for g in rule_groups(*BOTH_MONITORS, *sets) for r in g["rules"]}
    assert "< 0.3 * avg_over_time" in rules["SFTJobThroughputDropped"]
    assert "> .9 and" in rules["SFTJobGPUMemoryNearlyFull"]
    assert "< 0.25 * sftjob_train_planned_tokens_per_second" in rules["SFTJobSlowerThanPlanned"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(*BOTH_MONITORS, *sets)}))
    result = subprocess.run(
        [promtool(), "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "setting",
    [
        "throughputDropRatio=1",
        "throughputDropRatio=1.5",
        "throughputDropRatio=0.0",
        "throughputDropRatio=half",
        "gpuMemoryRatio=1.01",
        "gpuMemoryRatio=0",
        "plannedThroughputRatio=1",
        "plannedThroughputRatio=0",
    ],
)
def test_a_ratio_threshold_outside_its_range_is_refused_naming_it(setting: str) -> None:
    sets = ("alerts.enabled=true", *BOTH_MONITORS, f"alerts.thresholds.{setting}")
    result = helm(*template_args(sets=sets), check=False)
    assert result.returncode != 0 and f"/alerts/thresholds/{setting.split('=')[0]}" in result.stderr


# The trainer's buckets (sftjob_trainer.metrics.SAVE_BUCKETS), and +Inf.
SAVE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, float("inf"))


def saves_histogram(
    saves: dict[int, float], minutes: int, buckets: tuple[float, ...] = SAVE_BUCKETS
) -> dict[str, list[float]]:
    """A save-time histogram's series (``_bucket`` per bound, ``_sum``, ``_count``) sampled once a minute,
    each save of ``saves`` (minute: seconds it took) observed at its minute. ``buckets``: another
    histogram's bounds (+Inf included), for the same of its observations."""
    series: dict[str, list[float]] = {}
    for minute in range(minutes + 1):
        done = [seconds for at, seconds in saves.items() if at <= minute]
        for bound in buckets:
            le = "+Inf" if bound == float("inf") else str(bound)
            series.setdefault(f'_bucket{{le="{le}"}}', []).append(sum(1 for s in done if s <= bound))
        series.setdefault("_sum", []).append(sum(done))
        series.setdefault("_count", []).append(len(done))
    return series


def test_the_save_time_panel_counts_the_saves_of_the_time_range_not_a_rate_over_a_few_scrapes(
    tmp_path: Path,
) -> None:
    # Saves are minutes apart (30 by default): a rate over $__rate_interval (a few scrapes) holds none of
    # them almost always. The panel counts those of the dashboard's range, evaluated here by promtool.
    exprs = queries("training-job.json")["Checkpoint save time (saves in the time range)"]
    assert all("[$__range]" in e and "$__rate_interval" not in e and "rate(" not in e for e in exprs)
    panel = next(p for p in load_dashboards()["training-job.json"]["panels"] if p.get("id") == 25)
    assert panel["type"] == "stat" and all(t["instant"] for t in panel["targets"])
    # This job's saves at 10m (before the 100-minute range), 30m, 60m and 90m; another job's in the same
    # namespace much slower. At 120m the range holds 100 s, 200 s and 1500 s: mean 600 s; p95 interpolated
    # in the 600-1800 s bucket at rank 2.85 of 3: 600 + 1200 * 0.85 = 1620 s.
    name = "sftjob_train_checkpoint_save_duration_seconds"
    inputs = []
    for job, saves in (("j", {10: 5000, 30: 100, 60: 200, 90: 1500}), ("other", {20: 9000, 50: 9000})):
        for suffix, values in saves_histogram(saves, 120).items():
            labels = f'namespace="n",sftjob="{job}",pod="{job}-1-0"'
            series = (
                f"{name}{suffix[:-1]},{labels}}}" if suffix.endswith("}") else f"{name}{suffix}{{{labels}}}"
            )
            inputs.append({"series": series, "values": " ".join(str(v) for v in values)})

    def resolved(expr: str, window: str) -> str:
        grafana = expr.replace("$__range", window).replace("$namespace", "n").replace("$sftjob", "j")
        return f"round(({grafana}))"  # to the second: promtool compares exactly, interpolation is not exact

    def expect(window: str, values: tuple[float | None, ...]) -> list[dict[str, Any]]:
        return [
            {
                "expr": resolved(expr, window),
                "eval_time": "120m",
                "exp_samples": [] if value is None else [{"labels": "{}", "value": value}],
            }
            for expr, value in zip(exprs, values, strict=True)
        ]

    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                # mean, p95, saves: three saves in the last 100 minutes, none in the last 20.
                "promql_expr_test": expect("100m", (600, 1620, 3)) + expect("20m", (None, None, 0)),
            }
        ],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# The fleet dashboard's histograms of rare events: restarts (a few an hour at most) and job starts. Their
# bounds, +Inf included, and each panel's expected (mean, p50, p95, count) for two observations, 100 and
# 500, at 10m and 40m: p50 interpolated at rank 1 of 2, p95 at rank 1.9, in the buckets that hold them.
INF = (float("inf"),)
RARE_EVENT_PANELS = {
    "Recovery time": ("sftjob_recovery_duration_seconds", STARTUP_BUCKETS + INF, (None, 120, 570, 2)),
    "Steps lost per restart": ("sftjob_restart_lost_steps", STEP_BUCKETS + INF, (None, 100, 475, 2)),
    "Time from creation to pods scheduled": (
        "sftjob_job_time_to_scheduled_seconds",
        STARTUP_BUCKETS + INF,
        (300, 120, 570, 2),
    ),
    "Time from creation to pods Running": (
        "sftjob_job_time_to_training_started_seconds",
        STARTUP_BUCKETS + INF,
        (300, 120, 570, 2),
    ),
}


@pytest.mark.parametrize("panel", RARE_EVENT_PANELS)
def test_a_fleet_panel_of_rare_events_shows_those_of_the_time_range_not_a_rate_over_a_few_scrapes(
    panel: str, tmp_path: Path
) -> None:
    # A rate over $__rate_interval (a minute or so) holds an event only in the minute after it: the panel
    # would be empty almost all the time. The panel shows the events of the dashboard's range instead.
    metric, buckets, expected = RARE_EVENT_PANELS[panel]
    ((title, exprs),) = [(t, e) for t, e in queries("fleet-overview.json").items() if t.startswith(panel)]
    assert "in the time range" in title
    assert all("[$__range]" in e and "$__rate_interval" not in e and "rate(" not in e for e in exprs), title
    found = next(p for p in load_dashboards()["fleet-overview.json"]["panels"] if p["title"] == title)
    assert found["type"] == "stat" and all(t["instant"] for t in found["targets"])
    statistics = [t["legendFormat"] for t in found["targets"]]
    wanted = [value for value in expected if value is not None]
    assert statistics[:-1] == (["mean"] if expected[0] is not None else []) + ["p50", "p95"]
    labels = 'job="sft-sftjob-operator-metrics",namespace="sftjob-system"'
    inputs = [
        {
            "series": f"{metric}{suffix[:-1]},{labels}}}"
            if suffix.endswith("}")
            else f"{metric}{suffix}{{{labels}}}",
            "values": " ".join(str(v) for v in values),
        }
        for suffix, values in saves_histogram({10: 100.0, 40: 500.0}, 60, buckets).items()
    ]

    def resolved(expr: str, window: str) -> str:
        return f"round(({expr.replace('$__range', window).replace('$operator', '.+')}))"

    # At 55m the last hour holds both events; the last 10 minutes none: no number, and a count of 0.
    both = [
        {"expr": resolved(e, "1h"), "eval_time": "55m", "exp_samples": [{"labels": "{}", "value": v}]}
        for e, v in zip(exprs, wanted, strict=True)
    ]
    none = [
        {"expr": f"{resolved(e, '10m')} >= 0", "eval_time": "55m", "exp_samples": []} for e in exprs[:-1]
    ] + [
        {
            "expr": resolved(exprs[-1], "10m"),
            "eval_time": "55m",
            "exp_samples": [{"labels": "{}", "value": 0}],
        }
    ]
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": both + none}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
