"""The local control plane behaves like a real cluster where sftjob depends on it.

RBAC is enforced, the scheduler honours GPU capacity and node labels, KWOK plays pods as steered by the
`sim.sftjob.dev/*` annotations, the garbage collector follows ownerReferences, PVCs bind, the clients
are stamped with the real version, and `down` leaves no process behind.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sftjob import constants as c
from sftjob_dev import processes
from sftjob_dev.cluster import Cluster
from sftjob_dev.components import COMPONENTS

pytestmark = pytest.mark.e2e

Kubectl = Callable[..., str]
GPU_TOLERATION = {"key": c.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
K8S_VERSION = "v1.36.3"


def gpu_pod(name: str, product: str, gpus: int, annotations: dict[str, str] | None = None) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {c.GFD_PRODUCT: product},
                "tolerations": [GPU_TOLERATION],
                "containers": [
                    {
                        "name": "trainer",
                        "image": "example.invalid/trainer:1",
                        "resources": {"limits": {c.GPU_RESOURCE: str(gpus)}},
                    }
                ],
            },
        }
    )


def get(kubectl: Kubectl, namespace: str, *what: str) -> Any:
    return json.loads(kubectl("-n", namespace, "get", *what, "-o", "json"))


def wait_jsonpath(
    kubectl: Kubectl, namespace: str, obj: str, path: str, value: str, timeout: int = 30
) -> None:
    kubectl("-n", namespace, "wait", obj, f"--for=jsonpath={{{path}}}={value}", f"--timeout={timeout}s")


def eventually(check: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.3)


def test_a_service_account_without_a_role_is_forbidden_and_allowed_once_bound(
    cluster: Cluster, kubectl: Kubectl, namespace: str, tmp_path: Path
) -> None:
    kubectl("-n", namespace, "create", "serviceaccount", "reader")
    token = kubectl("-n", namespace, "create", "token", "reader", "--duration=10m").strip()
    assert cluster.api_url is not None
    context = ssl.create_default_context(cafile=str(cluster.pki.ca_crt))

    def list_pods() -> int:
        request = urllib.request.Request(
            f"{cluster.api_url}/api/v1/namespaces/{namespace}/pods",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as e:
            return e.code

    assert list_pods() == 403
    kubectl("-n", namespace, "create", "role", "pod-reader", "--verb=get,list", "--resource=pods")
    kubectl(
        "-n",
        namespace,
        "create",
        "rolebinding",
        "reader",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
    )
    eventually(lambda: list_pods() == 200, timeout=10, what="the RoleBinding to take effect")
    as_reader = [
        "--kubeconfig",
        str(cluster.service_account_kubeconfig(namespace, "reader", tmp_path / "kc")),
    ]
    assert kubectl(*as_reader, "-n", namespace, "auth", "can-i", "list", "pods").strip() == "yes"
    assert (
        kubectl(*as_reader, "-n", namespace, "auth", "can-i", "delete", "pods", check=False).strip() == "no"
    )


def test_a_one_gpu_pod_for_l40s_lands_only_on_l40s_nodes(kubectl: Kubectl, namespace: str) -> None:
    names = [f"l40s-{i}" for i in range(3)]
    for name in names:
        kubectl("-n", namespace, "create", "-f", "-", input=gpu_pod(name, "NVIDIA-L40S", 1))
    for name in names:
        wait_jsonpath(kubectl, namespace, f"pod/{name}", ".status.phase", "Running")
    nodes = {get(kubectl, namespace, "pod", name)["spec"]["nodeName"] for name in names}
    products = {
        json.loads(kubectl("get", "node", n, "-o", "json"))["metadata"]["labels"][c.GFD_PRODUCT]
        for n in nodes
    }
    assert products == {"NVIDIA-L40S"}


def test_a_pod_asking_for_more_gpus_than_any_node_has_stays_unschedulable(
    kubectl: Kubectl, namespace: str
) -> None:
    kubectl("-n", namespace, "create", "-f", "-", input=gpu_pod("too-big", "NVIDIA-A800-SXM4-80GB", 9))
    wait_jsonpath(
        kubectl,
        namespace,
        "pod/too-big",
        '.status.conditions[?(@.type=="PodScheduled")].reason',
        "Unschedulable",
    )
    pod = get(kubectl, namespace, "pod", "too-big")
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]


@pytest.mark.parametrize(
    ("annotations", "phase", "terminated"),
    [
        ({c.SIM_OUTCOME: "succeed"}, "Succeeded", {"exitCode": 0, "reason": "Completed"}),
        (
            {c.SIM_OUTCOME: "fail", c.SIM_EXIT_CODE: "15", c.SIM_MESSAGE: "CUDA out of memory"},
            "Failed",
            {"exitCode": 15, "reason": "Error", "message": "CUDA out of memory"},
        ),
        ({c.SIM_OUTCOME: "oomkill"}, "Failed", {"exitCode": 137, "reason": "OOMKilled"}),
    ],
    ids=["succeed", "fail", "oomkill"],
)
def test_a_running_pod_ends_as_its_annotations_steer_it(
    kubectl: Kubectl, namespace: str, annotations: dict[str, str], phase: str, terminated: dict[str, Any]
) -> None:
    kubectl("-n", namespace, "create", "-f", "-", input=gpu_pod("trainer", "NVIDIA-A40", 4))
    wait_jsonpath(kubectl, namespace, "pod/trainer", ".status.phase", "Running")
    kubectl("-n", namespace, "annotate", "pod", "trainer", *(f"{k}={v}" for k, v in annotations.items()))
    wait_jsonpath(kubectl, namespace, "pod/trainer", ".status.phase", phase)
    state = get(kubectl, namespace, "pod", "trainer")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert {key: state.get(key) for key in terminated} == terminated


def test_an_unsteered_pod_keeps_running_and_run_for_delays_the_outcome(
    kubectl: Kubectl, namespace: str
) -> None:
    kubectl("-n", namespace, "create", "-f", "-", input=gpu_pod("trainer", "NVIDIA-A800-SXM4-80GB", 8))
    wait_jsonpath(kubectl, namespace, "pod/trainer", ".status.phase", "Running")
    kubectl("-n", namespace, "annotate", "pod", "trainer", f"{c.SIM_OUTCOME}=succeed", f"{c.SIM_RUN_FOR}=3s")
    annotated = time.monotonic()
    time.sleep(1.5)
    assert get(kubectl, namespace, "pod", "trainer")["status"]["phase"] == "Running"
    wait_jsonpath(kubectl, namespace, "pod/trainer", ".status.phase", "Succeeded")
    assert time.monotonic() - annotated >= 3


def test_deleting_an_owner_deletes_its_dependents(kubectl: Kubectl, namespace: str) -> None:
    kubectl("-n", namespace, "create", "configmap", "owner")
    uid = get(kubectl, namespace, "configmap", "owner")["metadata"]["uid"]
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
        },
    }
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(dependent))
    pod = json.loads(gpu_pod("web", "NVIDIA-A40", 1))
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {**pod["spec"], "restartPolicy": "Always"},
            },
        },
    }
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(deployment))
    wait_jsonpath(kubectl, namespace, "deployment/web", ".status.readyReplicas", "2")
    kubectl("-n", namespace, "delete", "configmap", "owner", "--cascade=background")
    kubectl("-n", namespace, "delete", "deployment", "web", "--cascade=foreground", "--timeout=60s")
    eventually(
        lambda: kubectl("-n", namespace, "get", "configmap", "dependent", "--ignore-not-found") == "",
        what="GC of the ConfigMap",
    )
    eventually(
        lambda: get(kubectl, namespace, "replicasets,pods")["items"] == [],
        what="GC of the ReplicaSet and its pods",
    )


def test_a_job_whose_pod_succeeds_completes_and_deleting_it_removes_the_pod(
    kubectl: Kubectl, namespace: str
) -> None:
    pod = json.loads(gpu_pod("unused", "NVIDIA-L40S", 1, {c.SIM_OUTCOME: "succeed", c.SIM_RUN_FOR: "1s"}))
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once"},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"annotations": pod["metadata"]["annotations"]}, "spec": pod["spec"]},
        },
    }
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(job))
    wait_jsonpath(kubectl, namespace, "job/once", ".status.succeeded", "1")
    kubectl("-n", namespace, "delete", "job", "once", "--cascade=background")
    eventually(lambda: get(kubectl, namespace, "pods")["items"] == [], what="the Job's pod to be deleted")


def test_a_claim_on_the_default_storage_class_binds_and_its_pod_runs(
    kubectl: Kubectl, namespace: str
) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "checkpoints"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(claim))
    wait_jsonpath(kubectl, namespace, "pvc/checkpoints", ".status.phase", "Bound")
    pod = json.loads(gpu_pod("trainer", "NVIDIA-L40S", 1))
    pod["spec"]["volumes"] = [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "checkpoints"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "ckpt", "mountPath": c.CHECKPOINT_MOUNT}]
    kubectl("-n", namespace, "create", "-f", "-", input=json.dumps(pod))
    wait_jsonpath(kubectl, namespace, "pod/trainer", ".status.phase", "Running")


def test_helm_and_kubectl_report_their_versions(cluster: Cluster) -> None:
    helm = subprocess.run(
        ["helm", "version", "--short"],
        env=cluster.env(),
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert helm.startswith("v3.")
    versions = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == K8S_VERSION
    assert versions["serverVersion"]["gitVersion"] == K8S_VERSION


def test_a_second_cluster_started_from_the_cli_runs_beside_the_first_and_down_leaves_no_process(
    cluster: Cluster, tmp_path: Path
) -> None:
    workdir = tmp_path / "second"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "sftjob_dev.cluster", *args, "--workdir", str(workdir)]
        return subprocess.run(argv, capture_output=True, text=True, timeout=180)

    try:
        up = cli("up", "--a800", "0", "--a40", "0", "--l40s", "1", "--no-build")
        assert up.returncode == 0, up.stderr
        second = Cluster(workdir)
        state = json.loads(second.state_file.read_text())
        assert state["api_url"] != cluster.api_url
        assert second.node_names() == ["l40s-0"]
        assert cli("status").returncode == 0
        pids = dict(state["pids"])
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert sorted(pids) == sorted(COMPONENTS)
    assert [name for name, pid in pids.items() if processes.is_running(pid)] == []
    assert not second.state_file.exists()
    assert cli("status").returncode == 1
    assert cluster.is_up()
