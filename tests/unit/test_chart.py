"""The Helm chart, checked with the real tools (its monitoring: test_chart_monitoring.py).

`helm lint` and `helm template` run the chart with its default values and the two value sets in
charts/sftjob-operator/ci/. What they render is validated against the Kubernetes 1.36 schemas
(kubernetes-validate, strict) and linted with kube-score (kube-linter's Go module is not served by the
module proxy; kube-score is the closest linter that is). The e2e tests install the same chart into the
real local cluster (tests/e2e/test_chart_install.py) and scrape its metrics with a real Prometheus
(tests/e2e/test_prometheus.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

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
        ("defaults.trainerImagePullSecrets={Reg_Cred}", "/defaults/trainerImagePullSecrets/0"),
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


def test_chart_kopf_peering_crds_are_a_byte_for_byte_copy_of_the_published_ones() -> None:
    published = ROOT / "crds" / "kopf-peerings.yaml"
    copy = CHART / "crds" / "kopf-peerings.yaml"
    assert published.read_bytes() == copy.read_bytes(), f"run: cp {published} {copy}"


def test_crds_can_be_left_to_kubectl_apply() -> None:
    docs = render(sets=("crds.enabled=false",))
    assert find(docs, "CustomResourceDefinition", "sftjobs.sftjob.io") == []
    # kopf's peering CRDs live in the chart's crds/ folder: installed once, skipped with --skip-crds.
    assert {d["metadata"]["name"] for d in find(docs, "CustomResourceDefinition")} == {
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }


def test_the_published_crds_are_every_crd_the_chart_installs() -> None:
    """`kubectl apply -f crds/` (before `helm install --skip-crds`, or without Helm) leaves none out."""
    published = {
        doc["metadata"]["name"]
        for path in (ROOT / "crds").glob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    }
    assert published == {d["metadata"]["name"] for d in find(render(), "CustomResourceDefinition")}


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


@pytest.mark.parametrize(
    ("host", "bound"), [("0.0.0.0", "0.0.0.0"), ("::", "::"), ("[::]", "::"), ("fd00::1", "fd00::1")]
)
def test_the_liveness_endpoint_binds_the_address_family_liveness_host_names(host: str, bound: str) -> None:
    # kopf binds the host of its --liveness URL exactly, as urlsplit reads it: an IPv6 host needs brackets.
    args = operator_container(render("default", (f"liveness.host={host}",)))["args"]
    (url,) = [urlsplit(a.removeprefix("--liveness=")) for a in args if a.startswith("--liveness=")]
    assert (url.hostname, url.port, url.path) == (bound, 8081, "/healthz")


def operator_env(docs: list[Manifest]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(docs)["env"] if "value" in e}


def test_chart_defaults_are_the_operators_own_defaults() -> None:
    env = operator_env(render())
    policy = RestartPolicy()
    assert env == {
        "SFTJOB_TRAINER_IMAGE": c.DEFAULT_TRAINER_IMAGE,
        "SFTJOB_IMAGE_MIN_DRIVER_MAJOR": str(c.MIN_DRIVER_MAJOR),
        "SFTJOB_TRAINER_IMAGE_PULL_SECRETS": "",
        "SFTJOB_TRAINER_NETWORK_POLICY": "true",
        "SFTJOB_CHECKPOINT_STORAGE_CLASS": "",
        "SFTJOB_CHECKPOINT_SIZE": CheckpointSpec().size,
        "SFTJOB_MAX_RESTARTS": str(policy.max_restarts),
        "SFTJOB_BACKOFF_SECONDS": str(policy.backoff_seconds),
        "SFTJOB_ON_OOM": policy.on_oom,
    }


def test_kopf_takes_the_operators_peering_identity_from_the_pod_name() -> None:
    # kopf reads POD_ID: a container restarted in the same pod then owns its predecessor's keep-alive
    # instead of waiting for it to expire as a live peer's.
    from_fields = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in operator_container(render())["env"]
        if "valueFrom" in e
    }
    assert from_fields == {"POD_ID": "metadata.name"}


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


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_operator_may_patch_only_its_own_kopf_peering(value_set: str) -> None:
    patching = [
        rule
        for rule in all_rules(render(value_set))
        if "patch" in rule["verbs"] and set(rule["resources"]) & {"kopfpeerings", "clusterkopfpeerings"}
    ]
    assert all(rule.get("resourceNames") == [RELEASE] for rule in patching)
    assert bool(patching) == (value_set != "monitoring")  # that set turns peering off


def test_namespaced_install_grants_job_permissions_only_in_the_watched_namespaces() -> None:
    docs = render("namespaced")
    roles = find(docs, "Role")
    assert {r["metadata"]["namespace"] for r in roles} == {"team-a", "team-b"}
    assert {b["metadata"]["namespace"] for b in find(docs, "RoleBinding")} == {"team-a", "team-b"}
    (cluster_role,) = find(docs, "ClusterRole")
    # namespaces: kopf checks that the watched ones exist, and serves nothing for a minute if refused.
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes",
        "customresourcedefinitions",
        "namespaces",
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


@pytest.mark.parametrize("value_set", ["default", "namespaced"])
def test_the_operator_may_set_block_owner_deletion_on_its_jobs_children(value_set: str) -> None:
    # The children's ownerReferences set blockOwnerDeletion: OwnerReferencesPermissionEnforcement
    # (OpenShift's default) allows that only to a creator that may update the owner's finalizers.
    docs = render(value_set)
    roles = find(docs, "Role") or find(docs, "ClusterRole", f"{RELEASE}-sftjob-operator")
    assert roles
    for role in roles:
        rule = {"apiGroups": ["sftjob.io"], "resources": ["sftjobs/finalizers"], "verbs": ["update"]}
        assert rule in role["rules"]


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


@pytest.mark.parametrize(("value", "label"), [("1", "1"), ("true", "true"), ("Training", "Training")])
def test_the_dashboard_label_value_may_be_given_as_set_parses_it_and_is_rendered_as_a_string(
    value: str, label: str
) -> None:
    """`--set dashboards.labelValue=1` hands the chart a number (the default is the string "1")."""
    docs = render("default", (f"dashboards.labelValue={value}",))
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "-dashboard-" in d["metadata"]["name"]]
    assert dashboards and all(d["metadata"]["labels"]["grafana_dashboard"] == label for d in dashboards)


def test_a_dashboard_label_value_that_is_no_label_value_is_refused() -> None:
    result = helm(*template_args(sets=("dashboards.labelValue=a b c",)), check=False)
    assert result.returncode != 0 and "/dashboards/labelValue" in result.stderr
