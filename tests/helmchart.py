"""Running the real `helm` on charts/sftjob-operator, for the chart's unit and e2e tests.

helm is built from its Go module by hack/build-control-plane.sh beside the control plane's binaries.
"""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from sftjob_dev import binaries

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "sftjob-operator"
RELEASE = "sft"
NAMESPACE = "sftjob-system"
KUBE_VERSION = "1.36.3"
VALUE_SETS: dict[str, tuple[Path, ...]] = {
    "default": (),
    "namespaced": (CHART / "ci" / "namespaced-values.yaml",),
    "monitoring": (CHART / "ci" / "monitoring-values.yaml",),
}
Manifest = dict[str, Any]


def helm_binary() -> Path:
    helm = binaries.bin_dir() / "helm"
    if not helm.is_file():
        pytest.fail(f"{helm} is missing: run hack/build-control-plane.sh (the test command does)")
    return helm


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, check=check)


def template_args(
    values: tuple[Path, ...] = (),
    sets: tuple[str, ...] = (),
    *,
    namespace: str = NAMESPACE,
    release: str = RELEASE,
) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for f in values:
        args += ["--values", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


@cache
def render(value_set: str = "default", sets: tuple[str, ...] = ()) -> list[Manifest]:
    """Every object the chart renders (its crds/ folder included), parsed."""
    out = helm(*template_args(VALUE_SETS[value_set], sets), "--include-crds").stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def alert_groups(sets: tuple[str, ...] = ()) -> list[Manifest]:
    """The rule groups of the chart's PrometheusRule, as a Prometheus rule file holds them."""
    rule = one(
        render(
            "default",
            (
                "alerts.enabled=true",
                "metrics.serviceMonitor.enabled=true",
                "metrics.podMonitor.enabled=true",
                *sets,
            ),
        ),
        "PrometheusRule",
    )
    groups: list[Manifest] = rule["spec"]["groups"]
    return groups
