"""What a trainer can do to the API server with its own token: annotate its pod with progress, no more.

The chart's trainer pod policy (rendered by the real `helm template --validate`, which asks the cluster
which APIs it serves) is applied to the real control plane, beside a job's trainer ServiceAccount, Role
and RoleBinding as the operator's builders make them and two pods of one attempt. The trainer calls the
API as report.py does: the Kubernetes client with a bearer token, here one bound to its pod as the
kubelet's projected token is (so the API server adds the pod's name to the caller's identity), or one
bound to nothing, as the local runner issues. The job's objects are owned by a ConfigMap standing in for
the SFTJob, so that no operator running in the same session acts on them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helmchart import CHART, helm
from kubernetes import client, config
from operator_harness import wait_for

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob_dev.cluster import Cluster
from sftjob_dev.pki import write_kubeconfig
from sftjob_operator import builders

pytestmark = pytest.mark.e2e

JOB = "perm"
ATTEMPT = 1
SECRET = "hf-token"
ALLOWED = (
    f"may only write the {c.ANNOTATION_PROGRESS} and {c.ANNOTATION_CHECKPOINT} annotations of its own pod"
)
PROGRESS = {"metadata": {"annotations": {c.ANNOTATION_PROGRESS: json.dumps({"step": 3, "totalSteps": 10})}}}


@dataclass
class Attempt:
    namespace: str
    pods: list[str]  # by rank
    bound: client.CoreV1Api  # rank 0's token, bound to its pod
    unbound: client.CoreV1Api  # a token of the same account bound to no pod

    @property
    def account(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{builders.trainer_account_name(JOB)}"


def apply(cluster: Cluster, *manifests: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
    )


def owned_by(manifest: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    manifest["metadata"]["ownerReferences"] = [owner]
    return manifest


def trainer_pod(job: JobRef, rank: int, owner: dict[str, Any]) -> dict[str, Any]:
    """A pod with the operator's name, labels, account and token; it never schedules (no GPU toleration)."""
    meta = builders.metadata(job, builders.pod_name(JOB, ATTEMPT, rank), attempt=ATTEMPT, rank=rank)
    meta["annotations"] = {"example.com/team": "nlp"}
    return owned_by(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "serviceAccountName": builders.trainer_account_name(JOB),
                "automountServiceAccountToken": True,
                "restartPolicy": "Never",
                "containers": [{"name": "trainer", "image": "registry.example.com/ml/trainer:1"}],
            },
        },
        owner,
    )


def api_as(cluster: Cluster, token: str, path: Path) -> client.CoreV1Api:
    assert cluster.api_url is not None
    write_kubeconfig(path, cluster.pki, cluster.api_url, token=token)
    return client.CoreV1Api(config.new_client_from_config(str(path)))


def refusal(call: Any, *args: Any, **kwargs: Any) -> client.ApiException:
    with pytest.raises(client.ApiException) as refused:
        call(*args, **kwargs)
    return refused.value


def message(error: client.ApiException) -> str:
    text: str = json.loads(error.body or "{}").get("message", "")
    return text


@pytest.fixture(scope="module")
def trainer_policy(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    release = f"perm-{uuid.uuid4().hex[:6]}"
    rendered = helm(
        "template",
        release,
        str(CHART),
        "--namespace=default",
        "--validate",  # the cluster's API kinds: the chart's check that it serves the policy API
        f"--kubeconfig={cluster.kubeconfig}",
        # The release's other cluster-scoped objects may exist already (another test's release).
        "--set=operator.peering.enabled=false",
        "--set=rbac.userRoles=false",
        "--set=crds.enabled=false",
        "--show-only=templates/trainer-pod-policy.yaml",
    ).stdout
    manifest = tmp_path_factory.mktemp("policy") / "trainer-pod-policy.yaml"
    manifest.write_text(rendered)
    cluster.kubectl("apply", "-f", str(manifest))
    yield manifest
    cluster.kubectl("delete", "-f", str(manifest), "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def attempt(
    cluster: Cluster, trainer_policy: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Attempt]:
    namespace = f"trainer-perm-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("-n", namespace, "create", "secret", "generic", SECRET, "--from-literal=token=hf_x")
    cluster.kubectl("-n", namespace, "create", "configmap", builders.config_map_name(JOB))
    stand_in = cluster.kubectl_json("-n", namespace, "get", "configmap", builders.config_map_name(JOB))
    job = JobRef(namespace=namespace, name=JOB, uid=stand_in["metadata"]["uid"], attempt=ATTEMPT)
    owner = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": builders.config_map_name(JOB),
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    pods = [builders.pod_name(JOB, ATTEMPT, rank) for rank in (0, 1)]
    apply(
        cluster,
        owned_by(builders.service_account(job), owner),
        owned_by(builders.role(job, pods), owner),
        owned_by(builders.role_binding(job), owner),
        *(trainer_pod(job, rank, owner) for rank in (0, 1)),
    )
    account = builders.trainer_account_name(JOB)
    rank0 = cluster.kubectl_json("-n", namespace, "get", "pod", pods[0])
    bound = cluster.kubectl(
        "-n",
        namespace,
        "create",
        "token",
        account,
        "--bound-object-kind=Pod",
        f"--bound-object-name={pods[0]}",
        f"--bound-object-uid={rank0['metadata']['uid']}",
    ).stdout.strip()
    unbound = cluster.kubectl("-n", namespace, "create", "token", account).stdout.strip()
    folder = tmp_path_factory.mktemp("tokens")
    result = Attempt(
        namespace,
        pods,
        api_as(cluster, bound, folder / "bound"),
        api_as(cluster, unbound, folder / "unbound"),
    )

    def policy_active() -> bool:
        """The API server loads a new policy within a second or so; a dry run changes nothing meanwhile."""
        relabel = {"metadata": {"labels": {c.LABEL_JOB: "other"}}}
        try:
            result.unbound.patch_namespaced_pod(pods[0], namespace, relabel, dry_run="All")
        except client.ApiException as e:
            return e.status == 422
        return False

    wait_for("the trainer pod policy to take effect", policy_active, timeout=30)
    yield result
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def pod(cluster: Cluster, attempt: Attempt, rank: int) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("-n", attempt.namespace, "get", "pod", attempt.pods[rank])
    return found


def test_the_trainer_reports_progress_and_checkpoints_on_its_own_pod(
    cluster: Cluster, attempt: Attempt
) -> None:
    checkpoint = json.dumps({"step": 3, "path": "/checkpoints/checkpoint-3", "time": "2030-01-01T00:00:00Z"})
    attempt.bound.patch_namespaced_pod(attempt.pods[0], attempt.namespace, PROGRESS)
    attempt.bound.patch_namespaced_pod(
        attempt.pods[0],
        attempt.namespace,
        {"metadata": {"annotations": {c.ANNOTATION_CHECKPOINT: checkpoint}}},
    )
    annotations = pod(cluster, attempt, 0)["metadata"]["annotations"]
    assert annotations[c.ANNOTATION_PROGRESS] == PROGRESS["metadata"]["annotations"][c.ANNOTATION_PROGRESS]
    assert annotations[c.ANNOTATION_CHECKPOINT] == checkpoint
    assert annotations["example.com/team"] == "nlp"


def test_a_token_bound_to_one_pod_cannot_annotate_the_peer_pod(cluster: Cluster, attempt: Attempt) -> None:
    refused = refusal(attempt.bound.patch_namespaced_pod, attempt.pods[1], attempt.namespace, PROGRESS)
    assert refused.status == 422
    assert f"its token belongs to pod {attempt.pods[0]}, not {attempt.pods[1]}" in message(refused)
    assert c.ANNOTATION_PROGRESS not in (pod(cluster, attempt, 1)["metadata"].get("annotations") or {})


# What the review found a trainer could do with PATCH alone, each on its own pod and on its peer's.
CHANGES: dict[str, tuple[list[dict[str, Any]] | dict[str, Any], str]] = {
    "relabel out of the job": ({"metadata": {"labels": {c.LABEL_JOB: "elsewhere"}}}, "pod's labels"),
    "relabel the attempt": ({"metadata": {"labels": {c.LABEL_ATTEMPT: "7"}}}, "pod's labels"),
    "drop the controller uid label": (
        {"metadata": {"labels": {c.LABEL_CONTROLLER_UID: None}}},
        "pod's labels",
    ),
    "escape garbage collection": (
        [{"op": "remove", "path": "/metadata/ownerReferences"}],
        "pod's ownerReferences",
    ),
    "add a finalizer": ({"metadata": {"finalizers": ["example.com/keep"]}}, "pod's finalizers"),
    "change the image": (
        {"spec": {"containers": [{"name": "trainer", "image": "registry.example.com/evil:1"}]}},
        "pod's spec",
    ),
    "set a deadline": ({"spec": {"activeDeadlineSeconds": 1}}, "pod's spec"),
    "write another annotation": (
        {"metadata": {"annotations": {"example.com/team": None}}},
        "pod's annotation example.com/team",
    ),
}


@pytest.mark.parametrize("rank", [0, 1], ids=["own pod", "peer pod"])
@pytest.mark.parametrize("change", CHANGES)
def test_the_policy_refuses_any_other_change_with_its_reason(
    cluster: Cluster, attempt: Attempt, change: str, rank: int
) -> None:
    body, what = CHANGES[change]
    before = pod(cluster, attempt, rank)
    # Rank 0's own token on its pod; on the peer pod a token bound to no pod, whose refusal names the
    # field (a bound token is refused there for being another pod's, whatever the change).
    api = attempt.bound if rank == 0 else attempt.unbound
    refused = refusal(api.patch_namespaced_pod, attempt.pods[rank], attempt.namespace, body)
    assert refused.status == 422
    assert f"the trainer may not change a {what}: it {ALLOWED}" in message(refused)
    after = pod(cluster, attempt, rank)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_the_trainer_may_neither_read_pods_nor_secrets(cluster: Cluster, attempt: Attempt) -> None:
    for call, args in [
        (attempt.bound.read_namespaced_pod, (attempt.pods[0], attempt.namespace)),
        (attempt.bound.list_namespaced_pod, (attempt.namespace,)),
        (attempt.bound.read_namespaced_secret, (SECRET, attempt.namespace)),
        (attempt.bound.delete_namespaced_pod, (attempt.pods[1], attempt.namespace)),
    ]:
        refused = refusal(call, *args)
        assert refused.status == 403 and f'User "{attempt.account}" cannot' in message(refused), call
    # The same account impersonated, for what the calls above do not try; the first is the one it has.
    own, peer = (f"pods/{name}" for name in attempt.pods)
    for question, answer in [
        (("patch", own), "yes"),
        (("get", own), "no"),
        (("update", own), "no"),
        (("patch", own, "--subresource=status"), "no"),
        (("create", peer, "--subresource=eviction"), "no"),
        (("list", "secrets"), "no"),
    ]:
        asked = ["auth", "can-i", *question, f"--as={attempt.account}", "-n", attempt.namespace]
        assert cluster.kubectl(*asked, check=False).stdout.strip() == answer, question


def test_other_accounts_and_other_pods_are_left_alone(
    cluster: Cluster, attempt: Attempt, tmp_path: Path
) -> None:
    """The operator and people still relabel trainer pods; a `*-trainer` account of another product keeps
    its rights on pods that are not an SFTJob's."""
    ns = attempt.namespace
    cluster.kubectl("-n", ns, "label", "--overwrite", "pod", attempt.pods[1], "example.com/checked=yes")
    assert pod(cluster, attempt, 1)["metadata"]["labels"]["example.com/checked"] == "yes"
    account = "vision-trainer"
    cluster.kubectl("-n", ns, "create", "serviceaccount", account)
    cluster.kubectl("-n", ns, "run", "vision", "--image=registry.example.com/vision:1", "--restart=Never")
    cluster.kubectl(
        "-n", ns, "create", "role", account, "--verb=patch", "--resource=pods", "--resource-name=vision"
    )
    cluster.kubectl(
        "-n", ns, "create", "rolebinding", account, f"--role={account}", f"--serviceaccount={ns}:{account}"
    )
    other = api_as(
        cluster, cluster.kubectl("-n", ns, "create", "token", account).stdout.strip(), tmp_path / "kc"
    )
    other.patch_namespaced_pod("vision", ns, {"metadata": {"labels": {"stage": "done"}}})
    labels = cluster.kubectl_json("-n", ns, "get", "pod", "vision")["metadata"]["labels"]
    assert labels["stage"] == "done"


def test_a_pod_created_by_someone_else_under_a_name_the_trainer_role_holds_is_refused(
    cluster: Cluster, attempt: Attempt, tmp_path: Path
) -> None:
    """The Role names an attempt's pods before they exist: a bare pod that took such a name first
    (without the sftjob.io/job label) is not the trainer's to change, not even its annotations."""
    ns, squatted = attempt.namespace, "squat-1-1"
    job = JobRef(namespace=ns, name="squat", uid=str(uuid.uuid4()), attempt=1)
    unowned = [
        builders.service_account(job),
        builders.role(job, ["squat-1-0", squatted]),
        builders.role_binding(job),
    ]
    for manifest in unowned:  # their owner does not exist: the garbage collector would remove them
        del manifest["metadata"]["ownerReferences"]
    apply(cluster, *unowned)
    cluster.kubectl("-n", ns, "run", squatted, "--image=registry.example.com/db:1", "--restart=Never")
    token = cluster.kubectl("-n", ns, "create", "token", builders.trainer_account_name(job.name)).stdout
    api = api_as(cluster, token.strip(), tmp_path / "squat")
    evil = {"spec": {"containers": [{"name": squatted, "image": "registry.example.com/evil:1"}]}}
    for body in (evil, PROGRESS):
        refused = refusal(api.patch_namespaced_pod, squatted, ns, body)
        assert refused.status == 422
        assert f"the trainer may only annotate its own pod: pod {squatted} is no SFTJob's" in message(refused)
    found = cluster.kubectl_json("-n", ns, "get", "pod", squatted)
    assert found["spec"]["containers"][0]["image"] == "registry.example.com/db:1"
