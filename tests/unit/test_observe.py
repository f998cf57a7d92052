"""What the operator keeps of a pod in its index: what the reconcile reads, nothing else."""

from __future__ import annotations

from datetime import UTC, datetime

from sftjob import constants as c
from sftjob_operator.classify import FailureClass, classify_pod
from sftjob_operator.observe import trim_pod

TERMINATED = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "killed"}}
POD = {
    "metadata": {
        "name": "job-1-0",
        "labels": {c.LABEL_JOB: "job"},
        "annotations": {c.ANNOTATION_PROGRESS: "{}", "kubectl.kubernetes.io/last-applied-configuration": "x"},
        "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
    },
    "spec": {"nodeName": "l40s-0", "containers": [{"name": "trainer", "image": "img"}]},
    "status": {
        "phase": "Failed",
        "conditions": [
            {"type": "Ready", "status": "False", "lastProbeTime": None},
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
        ],
        "containerStatuses": [
            {"name": "trainer", "image": "img", "imageID": "sha", "state": TERMINATED, "lastState": {}}
        ],
        "podIPs": [{"ip": "10.0.0.1"}],
    },
}


def test_a_trimmed_pod_drops_what_the_reconcile_never_reads() -> None:
    trimmed = trim_pod(POD)
    assert set(trimmed["metadata"]["annotations"]) == {c.ANNOTATION_PROGRESS}
    assert "managedFields" not in trimmed["metadata"] and set(trimmed["spec"]) == {"nodeName"}
    assert [x["type"] for x in trimmed["status"]["conditions"]] == ["DisruptionTarget"]
    assert set(trimmed["status"]) == {"phase", "conditions", "containerStatuses"}
    assert trimmed["status"]["containerStatuses"][0] == {
        "name": "trainer",
        "image": "img",
        "state": TERMINATED,
    }


def test_a_trimmed_pod_is_classified_like_the_full_one() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    full = classify_pod(POD, None, now=now)
    assert classify_pod(trim_pod(POD), None, now=now) == full
    assert full.failure_class is FailureClass.HOST_OOM
