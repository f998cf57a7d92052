"""The Helm chart, its dashboards and alerts, and kind-config.yaml, checked with the real tools.

`helm lint` and `helm template` run the chart with its default values and the two value sets in
charts/sftjob-operator/ci/. What they render is validated against the Kubernetes 1.36 schemas
(kubernetes-validate, strict) and linted with kube-score (kube-linter's Go module is not served by the
module proxy; kube-score is the closest linter that is). The e2e tests install the same chart into the
real local cluster (tests/e2e/test_chart_install.py) and scrape its metrics with a real Prometheus
(tests/e2e/test_prometheus.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helmchart import (
    CHART,
    KUBE_VERSION,
    RELEASE,
    ROOT,
    VALUE_SETS,
    Manifest,
    find,
    helm,
    one,
    render,
    template_args,
)

from sftjob import constants as c
from sftjob.attempts import RestartPolicy
from sftjob.spec import CheckpointSpec
from sftjob_dev import binaries
from sftjob_dev.nodes import NODE_TYPES
from sftjob_operator.scheduling import default_products, parse_products

SCHEMA_VERSION = "1.36.0"
# Kinds the Kubernetes schemas do not describe: kopf's peering objects (server-side dry-run in
# tests/e2e/test_chart_install.py checks them against the chart's own CRDs) and the Prometheus
# Operator's monitors and rules (promtool checks the rules in tests/e2e/test_prometheus.py).
CUSTOM_KINDS = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor", "PodMonitor", "PrometheusRule"}

KUBE_SCORE_VERSION = "v1.20.0"
# kube-score checks turned off, and why. Anything else it reports fails the test.
KUBE_SCORE_IGNORED = {
    "deployment-strategy": "Recreate is deliberate: two kopf operators in one peering pause each other",
    "pod-probes": "an operator serves no traffic; its Service only exposes metrics, so no readiness probe",
    "pod-networkpolicy": "which traffic to allow (the API server's address, the scraper) is cluster-specific",
    "container-image-pull-policy": "images are pinned to a version tag; IfNotPresent is Kubernetes' default",
}


def kube_score_binary() -> Path:
    """kube-score from the Go module proxy, built once into the cache beside the control plane."""
    env = os.environ.get("SFTJOB_KUBE_SCORE")
    if env:
        return Path(env)
    folder = binaries.bin_dir().parent / f"kube-score-{KUBE_SCORE_VERSION}"
    binary = folder / "kube-score"
    if not binary.is_file():
        if shutil.which("go") is None:
            pytest.fail("kube-score is not built and the Go toolchain is not on PATH to build it")
        subprocess.run(
            ["go", "install", f"github.com/zegl/kube-score/cmd/kube-score@{KUBE_SCORE_VERSION}"],
            env={**os.environ, "GOBIN": str(folder), "CGO_ENABLED": "0"},
            check=True,
        )
    return binary


# ---------------------------------------------------------------------------------------------------
# helm lint / template and schema validation


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_chart_lints_without_findings(value_set: str) -> None:
    args = ["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    for f in VALUE_SETS[value_set]:
        args += ["--values", str(f)]
    result = helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_manifests_are_valid_kubernetes_1_36_objects(value_set: str) -> None:
    docs = render(value_set)
    checked = 0
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_manifests_pass_kube_score(value_set: str, tmp_path: Path) -> None:
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(helm(*template_args(VALUE_SETS[value_set]), "--include-crds").stdout)
    result = subprocess.run(
        [
            str(kube_score_binary()),
            "score",
            "--kubernetes-version=v1.36",
            "--output-format=ci",
            "--exit-one-on-warning",
            "--min-replicas-deployment=1",  # one replica: kopf coordinates through peering, not HA
            "--enable-optional-test=container-seccomp-profile",
            f"--ignore-test={','.join(KUBE_SCORE_IGNORED)}",
            str(manifest),
        ],
        capture_output=True,
        text=True,
    )
    findings = [line for line in result.stdout.splitlines() if line.startswith(("[CRITICAL]", "[WARNING]"))]
    assert findings == [] and result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("imag.tag=x", "additional properties 'imag' not allowed"),
        ("metrics.serviceMonitor.enable=true", "additional properties 'enable' not allowed"),
        ("operator.scope=global", "/operator/scope"),
        ("operator.scope=namespaced", "/operator/watchNamespaces"),
        ("replicas=2", "/replicas"),
        ("alerts.thresholds.gpuMemoryRatio=1.5", "/alerts/thresholds/gpuMemoryRatio"),
        ("defaults.restartPolicy.onOOM=Shrink", "/defaults/restartPolicy/onOOM"),
        ("defaults.checkpoints.size=lots", "/defaults/checkpoints/size"),
        ("gpuProducts.H100[0]=NVIDIA-H100-80GB-HBM3", "at '/gpuProducts': additional properties 'H100'"),
    ],
)
def test_values_schema_rejects_invalid_values_naming_the_field(setting: str, complaint: str) -> None:
    result = helm(*template_args(sets=(setting,)), check=False)
    assert result.returncode != 0
    assert complaint in result.stderr


# ---------------------------------------------------------------------------------------------------
# CRDs


def test_chart_crd_is_a_byte_for_byte_copy_of_the_published_crd() -> None:
    published = ROOT / "crds" / "sftjob.io_sftjobs.yaml"
    copy = CHART / "files" / "crds" / "sftjob.io_sftjobs.yaml"
    assert published.read_bytes() == copy.read_bytes(), f"run: cp {published} {copy}"


def test_rendered_crd_is_the_published_crd_plus_labels_and_keep() -> None:
    published = yaml.safe_load((ROOT / "crds" / "sftjob.io_sftjobs.yaml").read_text())
    rendered = one(render(), "CustomResourceDefinition", "sftjobs.sftjob.io")
    meta = rendered["metadata"]
    assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
    assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
    strip = {"labels", "annotations"}
    assert {k: v for k, v in meta.items() if k not in strip} == {
        k: v for k, v in published["metadata"].items() if k not in strip
    }
    assert rendered["spec"] == published["spec"]


def test_crds_can_be_left_to_kubectl_apply() -> None:
    docs = render(sets=("crds.enabled=false",))
    assert find(docs, "CustomResourceDefinition", "sftjobs.sftjob.io") == []
    # kopf's peering CRDs live in the chart's crds/ folder: installed once, skipped with --skip-crds.
    assert {d["metadata"]["name"] for d in find(docs, "CustomResourceDefinition")} == {
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }


# ---------------------------------------------------------------------------------------------------
# The operator's Deployment


def operator_container(docs: list[Manifest]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_operator_pod_meets_the_restricted_pod_security_standard(value_set: str) -> None:
    pod = one(render(value_set), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}


def test_operator_runs_once_with_recreate_peering_named_for_the_release_and_json_logs() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = operator_container(docs)
    assert container["command"] == ["python", "-m", "sftjob_operator"]
    assert container["args"] == [
        f"--peering={RELEASE}",
        "--liveness=http://0.0.0.0:8081/healthz",
        "--metrics-port=8080",
        "--log-format=json",
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "healthz": 8081}
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == RELEASE


def operator_env(docs: list[Manifest]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(docs)["env"] if "value" in e}


def test_chart_defaults_are_the_operators_own_defaults() -> None:
    env = operator_env(render())
    policy = RestartPolicy()
    assert env == {
        "SFTJOB_TRAINER_IMAGE": c.DEFAULT_TRAINER_IMAGE,
        "SFTJOB_CHECKPOINT_STORAGE_CLASS": "",
        "SFTJOB_CHECKPOINT_SIZE": CheckpointSpec().size,
        "SFTJOB_MAX_RESTARTS": str(policy.max_restarts),
        "SFTJOB_BACKOFF_SECONDS": str(policy.backoff_seconds),
        "SFTJOB_ON_OOM": policy.on_oom,
    }


def test_gpu_product_mapping_reaches_the_operator_in_the_form_it_parses() -> None:
    env = operator_env(render("monitoring"))
    mapping = parse_products(env["SFTJOB_GPU_PRODUCTS"])
    assert mapping["A40"] == ["NVIDIA-A40", "NVIDIA-A40-SHARED"]
    assert mapping["A800"] == default_products()["A800"]


def test_standalone_mode_drops_the_peering_object_and_its_permissions() -> None:
    docs = render("monitoring")
    assert "--standalone" in operator_container(docs)["args"]
    assert find(docs, "ClusterKopfPeering") == []
    rules = one(docs, "ClusterRole", f"{RELEASE}-sftjob-operator")["rules"]
    assert not any(g == "kopf.dev" for rule in rules for g in rule["apiGroups"])


# ---------------------------------------------------------------------------------------------------
# RBAC


def all_rules(docs: list[Manifest]) -> list[Manifest]:
    return [rule for d in docs if d["kind"] in ("ClusterRole", "Role") for rule in d["rules"]]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_no_role_uses_wildcards(value_set: str) -> None:
    for rule in all_rules(render(value_set)):
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), rule


def test_operator_may_not_read_secrets_or_touch_other_workloads() -> None:
    rules = one(render(), "ClusterRole", f"{RELEASE}-sftjob-operator")["rules"]
    resources = {r for rule in rules for r in rule["resources"]}
    assert resources.isdisjoint({"secrets", "deployments", "statefulsets", "jobs", "clusterroles"})
    # Only what the operator must create for its jobs is creatable; nothing cluster-scoped is writable.
    cluster_scoped = {"nodes", "customresourcedefinitions", "clusterkopfpeerings"}
    for rule in rules:
        if set(rule["resources"]) & cluster_scoped:
            assert set(rule["verbs"]) <= {"get", "list", "watch", "patch"}, rule
            assert "patch" not in rule["verbs"] or rule["resources"] == ["clusterkopfpeerings"]


def test_namespaced_install_grants_job_permissions_only_in_the_watched_namespaces() -> None:
    docs = render("namespaced")
    roles = find(docs, "Role")
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b"}
    assert {b["metadata"]["namespace"] for b in find(docs, "RoleBinding")} == {"team-a", "team-b"}
    (cluster_role,) = find(docs, "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes",
        "customresourcedefinitions",
    }
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in cluster_role["rules"])
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    assert "--all-namespaces" not in args
    peerings = find(docs, "KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("team-a", RELEASE),
        ("team-b", RELEASE),
    }
    assert f"--peering={RELEASE}" in args


def test_user_roles_aggregate_into_the_built_in_edit_and_view_roles() -> None:
    docs = render()
    editor = one(docs, "ClusterRole", "sftjob-editor")
    viewer = one(docs, "ClusterRole", "sftjob-viewer")
    assert editor["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {v for rule in viewer["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}
    assert find(render("namespaced"), "ClusterRole", "sftjob-editor") == []


# ---------------------------------------------------------------------------------------------------
# Monitoring: monitors, alerts, dashboards


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
# kind-config.yaml


def _kind_schema() -> dict[str, Any]:
    """kind's v1alpha4 Cluster and Node types (sigs.k8s.io/kind pkg/apis/config/v1alpha4), which kind
    decodes strictly: an unknown field is an error there too."""
    strings = {"type": "array", "items": {"type": "string"}}
    node = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "role": {"enum": ["control-plane", "worker"]},
            "image": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "extraMounts": {"type": "array"},
            "extraPortMappings": {"type": "array"},
            "gpus": {"type": "string"},
            "kubeadmConfigPatches": strings,
            "kubeadmConfigPatchesJSON6902": {"type": "array"},
        },
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "apiVersion"],
        "properties": {
            "kind": {"const": "Cluster"},
            "apiVersion": {"const": "kind.x-k8s.io/v1alpha4"},
            "name": {"type": "string"},
            "nodes": {"type": "array", "items": node, "minItems": 1},
            "networking": {"type": "object"},
            "featureGates": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "runtimeConfig": {"type": "object", "additionalProperties": {"type": "string"}},
            "kubeadmConfigPatches": strings,
            "kubeadmConfigPatchesJSON6902": {"type": "array"},
            "containerdConfigPatches": strings,
            "containerdConfigPatchesJSON6902": strings,
        },
    }


def kind_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    return config


def test_kind_config_is_a_valid_kind_v1alpha4_cluster() -> None:
    config = kind_config()
    jsonschema.validate(config, _kind_schema())
    roles = [n["role"] for n in config["nodes"]]
    assert roles.count("control-plane") == 1
    assert any(n["role"] == "worker" and not n.get("labels") for n in config["nodes"]), (
        "a worker for the operator"
    )


def test_kind_gpu_workers_carry_the_same_labels_and_taint_as_the_kwok_nodes() -> None:
    gpu_types = {t.product: t for t in NODE_TYPES.values() if t.gpus}
    gpu_workers = {
        n["labels"][c.GFD_PRODUCT]: n for n in kind_config()["nodes"] if c.GFD_PRODUCT in n.get("labels", {})
    }
    assert gpu_workers.keys() == gpu_types.keys()
    for product, node in gpu_workers.items():
        kwok_labels = gpu_types[product].labels("x")
        assert node["labels"] == {k: v for k, v in kwok_labels.items() if k.startswith("nvidia.com/")}
        (patch,) = node["kubeadmConfigPatches"]
        join = yaml.safe_load(patch)
        assert join["kind"] == "JoinConfiguration"
        assert join["nodeRegistration"]["taints"] == gpu_types[product].taints()
