"""Values the chart refuses at `helm install` instead of installing an operator that cannot work, and
names that fit whatever the release is called. Each case runs the real `helm template`."""

from __future__ import annotations

import re

import pytest
import yaml
from helmchart import Manifest, helm, template_args

# Helm's own limit on release names.
LONGEST_RELEASE = "r" * 53
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def refusal(*sets: str) -> str:
    result = helm(*template_args(sets=sets), check=False)
    assert result.returncode != 0, "the chart rendered"
    return result.stderr


def test_watched_namespaces_without_namespaced_scope_fail_instead_of_serving_every_namespace() -> None:
    stderr = refusal("operator.watchNamespaces={team-a}")
    assert "operator.watchNamespaces (team-a) is only used with operator.scope=namespaced" in stderr


@pytest.mark.parametrize("port", ["liveness.port=8080", "metrics.port=8081"])
def test_one_port_for_liveness_and_metrics_fails_instead_of_crash_looping(port: str) -> None:
    assert "liveness.port and metrics.port are both" in refusal(port)


@pytest.mark.parametrize(
    ("release", "sets"),
    [
        (LONGEST_RELEASE, ()),
        ("sftjob", ("fullnameOverride=" + "f" * 63,)),
    ],
)
def test_every_service_name_is_a_dns_label_whatever_the_release_is_called(
    release: str, sets: tuple[str, ...]
) -> None:
    values = ("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true", *sets)
    out = helm(*template_args(sets=values, release=release)).stdout
    docs: list[Manifest] = [d for d in yaml.safe_load_all(out) if d]
    services = [d["metadata"]["name"] for d in docs if d["kind"] == "Service"]
    assert services and all(DNS_LABEL.match(name) for name in services), services
    # Everything else takes a DNS subdomain (253 characters), which the release's 53 always leave room for.
    assert all(len(d["metadata"]["name"]) <= 253 for d in docs)


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_a_scrape_timeout_longer_than_the_interval_fails_instead_of_a_monitor_prometheus_drops(
    monitor: str,
) -> None:
    stderr = refusal(f"metrics.{monitor}.enabled=true", f"metrics.{monitor}.interval=5s")
    assert f"metrics.{monitor}.scrapeTimeout (10s) is longer than metrics.{monitor}.interval (5s)" in stderr


@pytest.mark.parametrize(("interval", "timeout"), [("5s", "5000ms"), ("1m", "59s"), ("1h", "59m59s")])
def test_a_scrape_timeout_up_to_the_interval_renders(interval: str, timeout: str) -> None:
    sets = ("metrics.podMonitor.enabled=true", f"metrics.podMonitor.interval={interval}")
    out = helm(*template_args(sets=(*sets, f"metrics.podMonitor.scrapeTimeout={timeout}"))).stdout
    monitor = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["scrapeTimeout"] == timeout
