"""`helm install` into the real local cluster, and the operator running with the chart's permissions only.

The chart is installed with the real helm binary (a second release is upgraded and uninstalled beside
it); every rendered object of three value sets passes a server-side dry run; the operator then runs (as
a local process, with the chart's own arguments) under a token of the chart's ServiceAccount and takes a
job from creation to its deletion after success. The API server's audit log of that run proves the
reverse too: every permission the chart grants was used, either by a request of the operator or because
the operator grants it onward to a trainer Role (or, for one, because admission checks it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import CHART, RELEASE, VALUE_SETS, Manifest, helm, one, template_args
from operator_harness import wait_for

from sftjob import constants as c
from sftjob.failures import ExitCode
from sftjob_dev.cluster import Cluster, outside_pod_env
from sftjob_dev.ports import free_ports

pytestmark = pytest.mark.e2e

ROOT = CHART.parents[1]
CRD = f"{c.PLURAL}.{c.API_GROUP}"
TRAINER_IMAGE = "registry.example.com/ml/sftjob-trainer:e2e"
PULL_SECRET = "regcred"  # only named: kwok's nodes pull nothing
CHECKPOINT_SIZE = "70Gi"  # room for the 8B model download and LoRA checkpoints (CheckpointVolumeTooSmall)
# Kinds whose CRDs (the Prometheus Operator's) this cluster does not have; promtool and the unit tests
# check them instead.
NOT_INSTALLABLE = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
AUDIT_LOG = "audit.log"
# Granted for admission, never requested: OwnerReferencesPermissionEnforcement (OpenShift's default)
# checks it when the children's ownerReferences set blockOwnerDeletion, and an admission check leaves no
# audit event of its own.
# And a pod read: only when the watch still lacks a pod long after its attempt started (handlers._look_up),
# which a healthy run never needs.
# Kueue's Workloads are read only for a queued job (tests/e2e/test_kueue_admission.py runs that).
NOT_REQUESTED = {
    ("sftjob.io", "sftjobs/finalizers", "update"),
    ("", "pods", "get"),
    ("kueue.x-k8s.io", "workloads", "get"),
}
DEADLINE = 180.0


@dataclass
class Release:
    namespace: str
    service_account: str
    kubeconfig: Path

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


def helm_in(cluster: Cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return helm(*args, f"--kubeconfig={cluster.kubeconfig}", check=check)


def adopt_existing_crd(cluster: Cluster, namespace: str) -> None:
    """Other tests `kubectl apply` the CRD; Helm takes over an object labelled and annotated as its own
    (the same step lets users move from `kubectl apply -f crds/` to the chart)."""
    if cluster.kubectl("get", "crd", CRD, check=False).returncode != 0:
        return
    cluster.kubectl("label", "--overwrite", "crd", CRD, "app.kubernetes.io/managed-by=Helm")
    cluster.kubectl(
        "annotate",
        "--overwrite",
        "crd",
        CRD,
        f"meta.helm.sh/release-name={RELEASE}",
        f"meta.helm.sh/release-namespace={namespace}",
    )


def service_account_kubeconfig(cluster: Cluster, release: str, namespace: str, path: Path) -> Path:
    """A kubeconfig that authenticates with a token of the chart's ServiceAccount, nothing else."""
    token = cluster.kubectl("-n", namespace, "create", "token", release, "--duration=2h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (entry,) = admin["clusters"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": entry["cluster"]}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def release(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    namespace = f"sftjob-system-{uuid.uuid4().hex[:6]}"
    adopt_existing_crd(cluster, namespace)
    helm_in(
        cluster,
        "install",
        RELEASE,
        str(CHART),
        f"--namespace={namespace}",
        "--create-namespace",
        f"--set=defaults.trainerImage={TRAINER_IMAGE}",
        f"--set=defaults.trainerImagePullSecrets={{{PULL_SECRET}}}",
        f"--set=defaults.checkpoints.size={CHECKPOINT_SIZE}",
        "--set=defaults.restartPolicy.backoffSeconds=0",
    )
    account = f"{RELEASE}-sftjob-operator"
    folder = tmp_path_factory.mktemp("operator")
    yield Release(
        namespace, account, service_account_kubeconfig(cluster, account, namespace, folder / "kubeconfig")
    )
    helm_in(cluster, "uninstall", RELEASE, f"--namespace={namespace}", "--wait", check=False)
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def installed_objects(cluster: Cluster, release: Release) -> list[Manifest]:
    manifest = helm_in(cluster, "get", "manifest", RELEASE, f"--namespace={release.namespace}").stdout
    return [d for d in yaml.safe_load_all(manifest) if d]


def test_the_release_installs_its_objects_and_keeps_the_crd_for_users_jobs(
    cluster: Cluster, release: Release
) -> None:
    status = json.loads(
        helm_in(cluster, "status", RELEASE, f"--namespace={release.namespace}", "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"
    crd = cluster.kubectl_json("get", "crd", CRD)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert cluster.kubectl_json("get", "clusterkopfpeering", RELEASE)["metadata"]["name"] == RELEASE
    role = cluster.kubectl_json("get", "clusterrole", release.service_account)
    assert (
        role["rules"]
        == one(installed_objects(cluster, release), "ClusterRole", release.service_account)["rules"]
    )


def test_a_release_upgrades_in_place_and_uninstalls_leaving_the_crd(
    cluster: Cluster, release: Release
) -> None:
    """A second release beside the first (the CRD and the user roles stay the first's): `helm upgrade`
    changes a default in place, `helm uninstall` removes the release's cluster-wide objects."""
    name, namespace = "sft-second", f"sftjob-second-{uuid.uuid4().hex[:6]}"
    common = (f"--namespace={namespace}", "--set=crds.enabled=false", "--set=rbac.userRoles=false")
    helm_in(cluster, "install", name, str(CHART), "--create-namespace", *common)
    try:
        helm_in(cluster, "upgrade", name, str(CHART), *common, "--set=defaults.restartPolicy.maxRestarts=7")
        status = json.loads(helm_in(cluster, "status", name, f"--namespace={namespace}", "-o", "json").stdout)
        assert (status["version"], status["info"]["status"]) == (2, "deployed")
        deployment = cluster.kubectl_json("-n", namespace, "get", "deployment", f"{name}-sftjob-operator")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert {"name": "SFTJOB_MAX_RESTARTS", "value": "7"} in container["env"]
    finally:
        helm_in(cluster, "uninstall", name, f"--namespace={namespace}", "--wait", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    account = f"{name}-sftjob-operator"
    for kind, obj in [
        ("clusterrole", account),
        ("clusterrolebinding", account),
        ("clusterkopfpeering", name),
    ]:
        assert cluster.kubectl("get", kind, obj, check=False).returncode != 0, f"{kind} {obj} left behind"
    crd = cluster.kubectl_json("get", "crd", CRD)
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_rendered_object_passes_a_server_side_dry_run(
    cluster: Cluster, value_set: str, tmp_path: Path
) -> None:
    # The namespaces the ci/ values name: watched ones, and where Grafana runs.
    for namespace in ("team-a", "team-b", "monitoring"):
        cluster.kubectl("create", "namespace", namespace, check=False)
    cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))  # kopf's peering CRDs
    out = helm(*template_args(VALUE_SETS[value_set], namespace="default")).stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] not in NOT_INSTALLABLE]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    result = cluster.kubectl(
        "apply", "--dry-run=server", "--server-side", "--force-conflicts", "-f", str(manifest), check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == len(docs)


def can_i(cluster: Cluster, user: str, verb: str, resource: str, namespace: str) -> bool:
    """`kubectl auth can-i`; `resource/status` asks for the subresource, `resource/NAME` for one object."""
    args = ["auth", "can-i", verb, resource, f"--as={user}", "-n", namespace]
    if resource.endswith("/status"):
        args[3] = resource.removesuffix("/status")
        args.append("--subresource=status")
    return cluster.kubectl(*args, check=False).stdout.strip() == "yes"


def test_the_operator_account_may_do_its_job_and_nothing_else(cluster: Cluster, release: Release) -> None:
    ns = "default"
    for verb, resource in [
        ("create", "pods"),
        ("delete", "pods"),
        ("patch", "sftjobs.sftjob.io/status"),
        ("create", "roles.rbac.authorization.k8s.io"),
        ("create", "events"),
        ("watch", "nodes"),
        ("patch", f"clusterkopfpeerings.kopf.dev/{RELEASE}"),
    ]:
        assert can_i(cluster, release.user, verb, resource, ns), (verb, resource)
    for verb, resource in [
        ("get", "secrets"),
        ("list", "secrets"),
        ("create", "deployments.apps"),
        ("update", "sftjobs.sftjob.io"),
        ("get", "sftjobs.sftjob.io/status"),
        ("patch", "nodes"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("escalate", "roles.rbac.authorization.k8s.io"),
        ("bind", "roles.rbac.authorization.k8s.io"),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
        ("patch", "clusterkopfpeerings.kopf.dev/another-operator"),
    ]:
        assert not can_i(cluster, release.user, verb, resource, ns), (verb, resource)


def test_namespace_editors_and_viewers_get_sftjob_rights_through_aggregation(
    cluster: Cluster, release: Release, namespace: str
) -> None:
    cluster.kubectl(
        "-n", namespace, "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice"
    )
    cluster.kubectl("-n", namespace, "create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob")

    def aggregated() -> bool:
        return can_i(cluster, "alice", "create", "sftjobs.sftjob.io", namespace)

    wait_for("the clusterrole aggregation controller", aggregated, timeout=30)
    assert can_i(cluster, "alice", "delete", "sftjobs.sftjob.io", namespace)
    assert can_i(cluster, "bob", "list", "sftjobs.sftjob.io", namespace)
    assert not can_i(cluster, "bob", "create", "sftjobs.sftjob.io", namespace)
    assert not can_i(cluster, "alice", "patch", "sftjobs.sftjob.io/status", namespace)


# ---------------------------------------------------------------------------------------------------
# The operator under the chart's ServiceAccount


def operator_command(
    cluster: Cluster, release: Release, metrics_port: int, liveness_port: int
) -> tuple[list[str], dict[str, str]]:
    """The installed Deployment's command, arguments and environment, with loopback ports."""
    (container,) = one(installed_objects(cluster, release), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    args = []
    for arg in container["args"]:
        if arg.startswith("--metrics-port="):
            arg = f"--metrics-port={metrics_port}"
        elif arg.startswith("--liveness="):
            arg = f"--liveness=http://127.0.0.1:{liveness_port}/healthz"
        args.append(arg)
    assert container["command"][:2] == ["python", "-m"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["POD_ID"] = "operator-e2e"  # the Deployment sets kopf's peering identity from its pod's name
    return [sys.executable, *container["command"][1:], *args], env


def sftjob(namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
        "kind": c.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "dataset": {"name": "tatsu-lab/alpaca"},
            # Two nodes: the rendezvous Service, and a surviving pod to delete when one fails.
            "gpu": {"type": "A800", "count": 8, "nodes": 2},
            "ttlSecondsAfterFinished": 5,
        },
    }


def pods(cluster: Cluster, namespace: str, job: str, attempt: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "-n", namespace, "get", "pods", "-l", f"{c.LABEL_JOB}={job},{c.LABEL_ATTEMPT}={attempt}", "-o", "json"
    )["items"]
    return items


def all_running(cluster: Cluster, namespace: str, job: str, attempt: int, count: int) -> bool:
    found = pods(cluster, namespace, job, attempt)
    return len(found) == count and all(p["status"].get("phase") == "Running" for p in found)


def steer(cluster: Cluster, namespace: str, pod: str, *annotations: str) -> None:
    cluster.kubectl("-n", namespace, "annotate", "--overwrite", "pod", pod, *annotations)


def finished(cluster: Cluster, namespace: str, job: str) -> str | None:
    """The job's phase once it is Succeeded or Failed; "deleted ..." when it is gone before either was
    seen (the TTL is 5 s: the poll is much more frequent)."""
    got = cluster.kubectl("-n", namespace, "get", c.PLURAL, job, "-o", "json", check=False)
    if got.returncode != 0:
        return "deleted (before it was seen finishing)"
    phase = (json.loads(got.stdout).get("status") or {}).get("phase")
    return str(phase) if phase in ("Succeeded", "Failed") else None


@dataclass
class OperatorRun:
    namespace: str
    job: str
    log: str
    roles: list[Manifest]


def start_operator(cluster: Cluster, release: Release, log_path: Path) -> subprocess.Popen[bytes]:
    """The operator as the chart runs it, as the chart's ServiceAccount, its output in ``log_path``."""
    argv, env = operator_command(cluster, release, *free_ports(2))
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv,
            env=outside_pod_env() | env | {"KUBECONFIG": str(release.kubeconfig)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def operator_run(cluster: Cluster, release: Release, tmp_path_factory: pytest.TempPathFactory) -> OperatorRun:
    """The operator, as the chart's ServiceAccount, takes one job through a preemption, a second
    attempt, success and deletion after its TTL, and frees a job an older version left its finalizer on
    (versions before the work queue ran a kopf daemon per job, which needs one)."""
    namespace = f"chart-job-{uuid.uuid4().hex[:6]}"
    job = "rbac-sft"
    cluster.kubectl("create", "namespace", namespace)
    log_path = tmp_path_factory.mktemp("operator-run") / "operator.log"
    process = start_operator(cluster, release, log_path)
    roles: list[Manifest] = []
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(sftjob(namespace, job)))
        legacy = sftjob(namespace, "legacy")
        legacy["spec"]["suspend"] = True  # holds no GPUs: the running job needs the A800 pool
        legacy["metadata"]["finalizers"] = [f"{c.API_GROUP}/finalizer"]
        cluster.kubectl("apply", "-f", "-", input=json.dumps(legacy))
        wait_for(
            "the operator to remove the older version's finalizer",
            lambda: (
                not cluster.kubectl_json("-n", namespace, "get", c.PLURAL, "legacy")["metadata"].get(
                    "finalizers"
                )
            ),
            timeout=DEADLINE,
        )
        wait_for(
            "both pods of attempt 1 to run",
            lambda: all_running(cluster, namespace, job, 1, 2),
            timeout=DEADLINE,
        )
        rank0 = next(
            p for p in pods(cluster, namespace, job, 1) if p["metadata"]["labels"][c.LABEL_RANK] == "0"
        )
        steer(
            cluster,
            namespace,
            rank0["metadata"]["name"],
            "sim.sftjob.dev/outcome=fail",
            f"sim.sftjob.dev/exit-code={int(ExitCode.PREEMPTED)}",
            "sim.sftjob.dev/message=preempted (SIGTERM): checkpoint saved at step 0",
        )
        wait_for(
            "both pods of attempt 2 to run",
            lambda: all_running(cluster, namespace, job, 2, 2),
            timeout=DEADLINE,
        )
        roles = cluster.kubectl_json("-n", namespace, "get", "roles", "-o", "json")["items"]
        for pod in pods(cluster, namespace, job, 2):
            steer(cluster, namespace, pod["metadata"]["name"], "sim.sftjob.dev/outcome=succeed")
        # The TTL deletes a failed job too: first the phase (seen within the TTL's 5 s), then the deletion.
        ended = wait_for(
            "the job to finish", lambda: finished(cluster, namespace, job), timeout=DEADLINE, every=0.1
        )
        assert ended == "Succeeded", f"the job ended {ended}, not Succeeded"
        wait_for(
            "the job to be deleted after its TTL",
            lambda: cluster.kubectl("-n", namespace, "get", c.PLURAL, job, check=False).returncode != 0,
            timeout=DEADLINE,
        )
    except BaseException:
        sys.stderr.write(
            cluster.kubectl("-n", namespace, "get", "sftjobs,pods", "-o", "yaml", check=False).stdout[-6000:]
        )
        sys.stderr.write(f"----- operator log -----\n{log_path.read_text(errors='replace')[-6000:]}\n")
        raise
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return OperatorRun(namespace, job, log_path.read_text(errors="replace"), roles)


def test_the_operator_runs_jobs_with_only_the_charts_permissions(
    release: Release, operator_run: OperatorRun
) -> None:
    assert not rbac_denials(operator_run.log, release.user)
    assert operator_run.roles, "the operator created the trainer's Role"


def rbac_denials(log: str, user: str) -> list[str]:
    """The lines of an operator log in which the API server denied ``user`` by RBAC, in its own words
    (other 403s, such as a terminating namespace, differ). The chart's operator logs JSON, its quotes
    escaped, and an API error's raw body in a traceback escapes them once more: each line is decoded (one
    that is not JSON is read as it is) and its escaped quotes undone before the words are looked for."""
    denial = f'User "{user}" cannot'
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            text = f"{record.get('message', '')}\n{record.get('exc_info', '')}"
        else:
            text = line
        if denial in text.replace('\\"', '"'):
            found.append(line)
    return found


def test_an_rbac_denial_is_found_in_the_operators_json_log_whether_said_or_in_a_traceback() -> None:
    user = "system:serviceaccount:sftjob-system-ab12cd:sft-sftjob-operator"
    said = (
        '{"message": "could not post event PodsCreated: events is forbidden: User \\"' + user + '\\"'
        ' cannot create resource \\"events\\" in API group \\"\\" in the namespace \\"chart-job-1\\"'
        ' (HTTP 403)", "timestamp": "2026-01-02T13:39:19.897362+00:00", "severity": "warn"}'
    )
    raised = (
        '{"message": "reconciling chart-job-1/rbac-sft failed", "exc_info": "Traceback (most recent call'
        " last):\\nkubernetes.client.exceptions.ApiException: (403)\\nReason: Forbidden\\nHTTP response"
        ' body: {\\"kind\\":\\"Status\\",\\"message\\":\\"roles.rbac.authorization.k8s.io is forbidden:'
        ' User \\\\\\"' + user + '\\\\\\" cannot create resource \\\\\\"roles\\\\\\"\\",'
        '\\"code\\":403}\\n", "timestamp": "2026-01-02T13:39:19.896356+00:00", "severity": "error"}'
    )
    plain = f'[2026-01-02 13:39:19,896] kopf: events is forbidden: User "{user}" cannot create'
    unrelated = '{"message": "namespace chart-job-1 is being terminated (HTTP 403)", "severity": "warn"}'
    log = "\n".join([said, raised, plain, unrelated])
    assert rbac_denials(log, user) == [said, raised, plain]
    assert rbac_denials(log, "system:serviceaccount:other:account") == []


def test_the_charts_defaults_reach_the_jobs(cluster: Cluster, release: Release, tmp_path: Path) -> None:
    # Not the `namespace` fixture's test-* namespace: the session's operator (tests/e2e/conftest.py), when
    # an earlier test started it, watches those and would race this one for the job.
    namespace = f"chart-defaults-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    log_path = tmp_path / "operator.log"
    process = start_operator(cluster, release, log_path)
    try:
        job = sftjob(namespace, "defaults")
        job["spec"]["gpu"] = {"type": "L40S", "count": 1}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
        wait_for("the trainer pod", lambda: bool(pods(cluster, namespace, "defaults", 1)), timeout=DEADLINE)
        (pod,) = pods(cluster, namespace, "defaults", 1)
        assert pod["spec"]["containers"][0]["image"] == TRAINER_IMAGE
        # The ServiceAccount admission plugin copied the trainer account's pull secrets into the pod.
        assert pod["spec"]["imagePullSecrets"] == [{"name": PULL_SECRET}]
        claims = cluster.kubectl_json("-n", namespace, "get", "pvc", "-o", "json")["items"]
        assert [pvc["spec"]["resources"]["requests"]["storage"] for pvc in claims] == [CHECKPOINT_SIZE]
        # trainerNetworkPolicy.enabled (on by default): only the job's own pods reach its trainers.
        policy = cluster.kubectl_json("-n", namespace, "get", "networkpolicy", "defaults-trainers")
        selected = policy["spec"]["podSelector"]["matchLabels"]
        assert selected.items() <= pod["metadata"]["labels"].items()
    except BaseException:
        sys.stderr.write(f"----- operator log -----\n{log_path.read_text(errors='replace')[-6000:]}\n")
        raise
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# ---------------------------------------------------------------------------------------------------
# No unused permissions


def audit_requests(cluster: Cluster, user: str) -> list[dict[str, Any]]:
    log = cluster.logs_dir / AUDIT_LOG
    if not log.exists():  # the local cluster always writes one (sftjob_dev.components)
        pytest.fail(
            f"the local cluster kept no API audit log at {log}: is kube-apiserver still started with"
            " --audit-log-path?",
            pytrace=False,
        )
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e for e in events if e.get("user", {}).get("username") == user and "objectRef" in e]


def rule_grants(rules: list[Manifest]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_every_permission_the_chart_grants_the_operator_is_used(
    cluster: Cluster, release: Release, operator_run: OperatorRun
) -> None:
    requests = audit_requests(cluster, release.user)
    forbidden = [
        e for e in requests if e.get("annotations", {}).get("authorization.k8s.io/decision") == "forbid"
    ]
    assert forbidden == []
    used = set()
    for event in requests:
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, event["verb"]))
    # Kubernetes lets the operator create a Role only with permissions it holds itself.
    granted_onward = rule_grants([rule for role in operator_run.roles for rule in role["rules"]])
    cluster_role = cluster.kubectl_json("get", "clusterrole", release.service_account)
    unused = sorted(rule_grants(cluster_role["rules"]) - used - granted_onward - NOT_REQUESTED)
    assert unused == [], f"permissions the operator never used: {unused}"
