"""What the operator does with a pod Kueue's webhook gated, on the real API server: the pod is Queued, and
once deleted before admission it is let go (Kueue's finalizer taken off), as Kueue itself never does."""

from __future__ import annotations

import pytest
from kubernetes import config
from operator_harness import wait_for

from sftjob import constants as c
from sftjob_dev.cluster import Cluster
from sftjob_operator import observe
from sftjob_operator.kube import Kube
from sftjob_operator.pod_lifecycle import held_by_kueue

pytestmark = pytest.mark.e2e


def test_a_pod_deleted_while_kueue_held_it_is_released_and_goes(cluster: Cluster, namespace: str) -> None:
    kube = Kube(config.new_client_from_config(str(cluster.kubeconfig)))
    pod = {  # as Kueue's webhook leaves a pod of a group its queue has not admitted
        "metadata": {
            "name": "job-1-0",
            "labels": {c.KUEUE_QUEUE_LABEL: "team-a"},
            "finalizers": [c.KUEUE_FINALIZER],
        },
        "spec": {
            "schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
            "containers": [{"name": "trainer", "image": "trainer:e2e"}],
        },
    }
    uid = kube.core.create_namespaced_pod(namespace, pod).metadata.uid
    gated = wait_for("the gated pod's status", lambda: observe.gated_message([_trimmed(kube, namespace)]))
    assert "admission by Kueue's queue team-a" in gated

    kube.core.delete_namespaced_pod("job-1-0", namespace)
    terminating = _trimmed(kube, namespace)
    assert terminating["metadata"]["deletionTimestamp"] and held_by_kueue([terminating]) == [terminating]
    kube.release_pod(namespace, "job-1-0", "some-other-uid")  # a pod of that name, but not this one
    assert kube.read_pod(namespace, "job-1-0") is not None
    kube.release_pod(namespace, "job-1-0", uid)
    wait_for("the released pod to be gone", lambda: kube.read_pod(namespace, "job-1-0") is None)


def _trimmed(kube: Kube, namespace: str) -> dict[str, object]:
    found = kube.read_pod(namespace, "job-1-0")
    assert found is not None
    return observe.trim_pod(found)
