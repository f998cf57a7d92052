"""The chart's monitoring: ServiceMonitor, PodMonitor, alert rules with their runbooks, and the Grafana
dashboards, as `helm template` renders them."""

from __future__ import annotations

import json
import re
from typing import Any

from helmchart import CHART, ROOT, one, render

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


def test_the_operator_down_alert_comes_only_with_the_service_monitor_whose_scrapes_it_watches() -> None:
    def alerts(*sets: str) -> set[str]:
        rule = one(render("default", ("alerts.enabled=true", *sets)), "PrometheusRule")
        return {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}

    assert "SFTJobOperatorDown" not in alerts()  # no scrape would ever make its up{job=...} series
    assert "SFTJobFailed" in alerts()
    assert "SFTJobOperatorDown" in alerts("metrics.serviceMonitor.enabled=true")
