"""The chart's monitoring: ServiceMonitor, PodMonitor, alert rules with their runbooks, and the Grafana
dashboards, as `helm template` renders them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import CHART, ROOT, helm, one, render, template_args

from sftjob import constants as c


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
        "SFTJobFailed",
        "SFTJobRestartsClimbing",
        "SFTJobOOMReplans",
        "SFTJobTrainingStalled",
        "SFTJobCheckpointTooOld",
        "SFTJobThroughputDropped",
        "SFTJobGPUMemoryNearlyFull",
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
        assert json.loads(body)["uid"] == DASHBOARD_UIDS[key.removeprefix("sftjob-")]


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


# ---------------------------------------------------------------------------------------------------
# The training rules, evaluated by `promtool test rules` over made-up series (one sample a minute).

JOB_LABELS = 'sftjob="j",namespace="n",pod="j-2-0",gpu="a800"'
EXPECTED_LABELS = {"sftjob": "j", "namespace": "n", "pod": "j-2-0", "gpu": "a800", "severity": "warning"}


def promtool_test(tmp_path: Path, series: dict[str, str], checks: list[dict[str, Any]]) -> None:
    """Run ``checks`` (promtool alert_rule_test entries) against the rendered rules fed ``series``."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (hack/test.sh does)")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(*BOTH_MONITORS)}))
    inputs = [  # a name with labels of its own gets the job's too
        {
            "series": f"{name[:-1]},{JOB_LABELS}}}" if name.endswith("}") else f"{name}{{{JOB_LABELS}}}",
            "values": values,
        }
        for name, values in series.items()
    ]
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def fires(minute: int, alert: str, description: str) -> dict[str, Any]:
    """``alert`` fires at ``minute`` for the job's series, saying ``description``."""
    (rule,) = [r for g in rule_groups(*BOTH_MONITORS) for r in g["rules"] if r["alert"] == alert]
    annotations = rule["annotations"] | {"description": description}
    return {
        "eval_time": f"{minute}m",
        "alertname": alert,
        "exp_alerts": [{"exp_labels": EXPECTED_LABELS, "exp_annotations": annotations}],
    }


def quiet(minute: int, alert: str) -> dict[str, Any]:
    return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": []}


CHECKPOINT = "SFTJobCheckpointTooOld"
STALLED = "SFTJobTrainingStalled"


def trained_without_checkpoint(duration: str) -> str:
    return (
        f"n/j has trained for {duration} without completing a checkpoint; a restart now would lose that work."
    )


def test_a_resumed_attempt_is_not_paged_for_the_age_of_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    # Attempt 2's pod comes up at 100m, resumed from a checkpoint saved at 5m (an hour-long outage);
    # its training loop starts at 110m and, at 90-minute threshold, saves nothing until 215m.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "_x100 300x120",
        "sftjob_train_attempt_start_timestamp_seconds": "_x100 0x9 6600x110",
        "sftjob_train_checkpoint_interval_seconds": "_x100 1800x120",
    }
    checks = [
        quiet(105, CHECKPOINT),
        quiet(130, CHECKPOINT),
        quiet(199, CHECKPOINT),
        fires(215, CHECKPOINT, trained_without_checkpoint("1h 45m 0s")),
    ]
    promtool_test(tmp_path, series, checks)


def test_an_attempt_that_never_completes_a_checkpoint_is_alerted(tmp_path: Path) -> None:
    # Step-based checkpoints whose interval is not measured yet (0): the threshold alone applies.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "0x300",
        "sftjob_train_attempt_start_timestamp_seconds": "60x300",
        "sftjob_train_checkpoint_interval_seconds": "0x300",
    }
    promtool_test(
        tmp_path,
        series,
        [quiet(60, CHECKPOINT), fires(300, CHECKPOINT, trained_without_checkpoint("4h 59m 0s"))],
    )


def test_an_attempt_still_setting_up_is_not_alerted_for_its_checkpoint_age(tmp_path: Path) -> None:
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "300x300",
        "sftjob_train_attempt_start_timestamp_seconds": "0x300",
        "sftjob_train_checkpoint_interval_seconds": "1800x300",
    }
    promtool_test(tmp_path, series, [quiet(300, CHECKPOINT)])


def test_a_sparse_checkpoint_interval_is_alerted_after_twice_the_interval_not_the_threshold(
    tmp_path: Path,
) -> None:
    # everyMinutes: 180, checkpoint and training start at 1m: overdue past 361m, fired 5 minutes on.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "60x400",
        "sftjob_train_attempt_start_timestamp_seconds": "60x400",
        "sftjob_train_checkpoint_interval_seconds": "10800x400",
    }
    promtool_test(
        tmp_path,
        series,
        [
            quiet(180, CHECKPOINT),
            quiet(360, CHECKPOINT),
            fires(370, CHECKPOINT, trained_without_checkpoint("6h 9m 0s")),
        ],
    )


def test_a_stalled_job_is_alerted_once_it_has_made_no_step_for_stalled_minutes(tmp_path: Path) -> None:
    # Training since 1m, the last step (40) at 40m: 15 minutes without a step at 55m.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
    }
    checks = [quiet(54, STALLED), fires(56, STALLED, "n/j has been at step 40 for 15 minutes.")]
    promtool_test(tmp_path, series, checks)


def test_a_long_evaluation_is_not_alerted_as_stalled_but_a_hang_after_it_is(tmp_path: Path) -> None:
    # The last step (40) at 40m, then an evaluation from 41m to 71m (spec.evaluation), then nothing.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
        'sftjob_train_phase{phase="evaluating"}': "0x40 1x30 0x30",
    }
    checks = [
        quiet(56, STALLED),
        quiet(71, STALLED),
        fires(72, STALLED, "n/j has been at step 40 for 15 minutes."),
    ]
    promtool_test(tmp_path, series, checks)


def test_a_resumed_attempt_loading_its_model_is_not_alerted_as_stalled(tmp_path: Path) -> None:
    # Resumed at step 500: the step is known from the start, the loop starts at 61m, its first step
    # (slow: compiling, warming up) ends at 70m.
    series = {
        "sftjob_train_step": "500x69 501+1x30",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "0x60 3660x39",
    }
    checks = [quiet(minute, STALLED) for minute in (20, 40, 60, 68, 90)]
    promtool_test(tmp_path, series, checks)


def test_a_job_hung_before_its_first_step_is_alerted_as_stalled(tmp_path: Path) -> None:
    series = {
        "sftjob_train_step": "0x60",
        "sftjob_train_total_steps": "1000x60",
        "sftjob_train_attempt_start_timestamp_seconds": "60x60",
    }
    promtool_test(
        tmp_path, series, [quiet(15, STALLED), fires(17, STALLED, "n/j has been at step 0 for 15 minutes.")]
    )


def test_ratio_thresholds_given_with_helm_set_reach_the_rules_as_valid_promql(tmp_path: Path) -> None:
    # helm --set gives a decimal as a string; the schema takes it like the number a values file gives.
    sets = ("alerts.thresholds.throughputDropRatio=0.3", "alerts.thresholds.gpuMemoryRatio=.9")
    rules = {r["alert"]: r["expr"] for g in rule_groups(*BOTH_MONITORS, *sets) for r in g["rules"]}
    assert "< 0.3 * avg_over_time" in rules["SFTJobThroughputDropped"]
    assert "> .9 and" in rules["SFTJobGPUMemoryNearlyFull"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: apt-get install prometheus (hack/test.sh does)")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups(*BOTH_MONITORS, *sets)}))
    result = subprocess.run(
        [promtool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True
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
    ],
)
def test_a_ratio_threshold_outside_its_range_is_refused_naming_it(setting: str) -> None:
    sets = ("alerts.enabled=true", *BOTH_MONITORS, f"alerts.thresholds.{setting}")
    result = helm(*template_args(sets=sets), check=False)
    assert result.returncode != 0 and f"/alerts/thresholds/{setting.split('=')[0]}" in result.stderr
