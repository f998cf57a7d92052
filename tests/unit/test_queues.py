"""spec.queueName: the trainer pods as one Kueue pod group per attempt, and a job whose pods wait for
Kueue's admission shown as Queued, not as unschedulable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob_operator import observe
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, NOW, SPEC, condition, observed, pod, started, then
from tests.unit.test_builders import JOB, spec
from tests.unit.test_builders import pod as trainer_pod


def test_each_attempts_pods_are_one_kueue_pod_group_in_the_jobs_queue() -> None:
    two_nodes = spec(queueName="team-a", gpu={"type": "A800", "count": 8, "nodes": 2})
    manifests = [trainer_pod(two_nodes, rank) for rank in (0, 1)]
    for manifest in manifests:
        labels, annotations = manifest["metadata"]["labels"], manifest["metadata"]["annotations"]
        assert labels[c.KUEUE_QUEUE_LABEL] == "team-a"
        # A new group per attempt, and never the Workload of an earlier job of the same name.
        assert labels[c.KUEUE_POD_GROUP_LABEL] == f"{JOB.name}-{JOB.uid[:8]}-{JOB.attempt}"
        assert annotations[c.KUEUE_POD_GROUP_COUNT] == "2"
        assert annotations[c.KUEUE_RETRIABLE_IN_GROUP] == "false"
        assert annotations[c.KUEUE_POD_INDEX_LABEL] == c.LABEL_RANK  # Kueue orders the ranks by it
        assert labels[c.LABEL_JOB] == JOB.name  # the operator's own labels stay


def test_without_a_queue_a_single_pod_carries_nothing_of_kueues_and_a_multi_node_attempt_is_a_group() -> None:
    metadata = trainer_pod(spec())["metadata"]
    assert not [
        k for k in {**metadata["labels"], **metadata.get("annotations", {})} if k.startswith("kueue.")
    ]
    two_nodes = trainer_pod(spec(gpu={"type": "A800", "count": 8, "nodes": 2}))["metadata"]
    assert c.KUEUE_POD_GROUP_LABEL in two_nodes["labels"] and c.KUEUE_QUEUE_LABEL not in two_nodes["labels"]
    assert two_nodes["annotations"][c.KUEUE_POD_GROUP_COUNT] == "2"  # in a namespace Kueue queues by default


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"queueName": "Team_A"}, "should match pattern"),
        ({"queueName": "q" * 64}, "at most 63 characters"),
        ({"podAnnotations": {c.KUEUE_POD_GROUP_COUNT: "1"}}, "set spec.queueName"),
        ({"podAnnotations": {c.KUEUE_RETRIABLE_IN_GROUP: "true"}}, "set spec.queueName"),
        ({"podAnnotations": {"kueue.x-k8s.io/pod-suspending-parent": "x"}}, "set spec.queueName"),
        ({"podAnnotations": {c.KUEUE_QUEUE_LABEL: "team-b"}}, "set spec.queueName"),
    ],
)
def test_a_queue_name_kueue_could_not_use_and_kueues_own_annotations_are_refused(
    changes: dict[str, object], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        spec(**changes)


def _gated() -> dict[str, object]:
    gated = pod(phase="Pending", node=None, status={"conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
        "message": "Scheduling is blocked due to non-empty scheduling gates"}]})  # fmt: skip
    gated["metadata"]["labels"][c.KUEUE_QUEUE_LABEL] = "team-a"  # type: ignore[index]
    return gated


def test_pods_waiting_for_kueues_admission_keep_the_job_queued_without_an_unschedulable_warning() -> None:
    obs, first = started()
    actions = reconcile(then(obs, first, pods=[_gated()]), CTX)
    assert actions.status.phase == "Pending"
    assert condition(actions, "Scheduled") == ("False", "Queued")
    assert condition(actions, "Running") == ("False", "Queued")
    message = next(x for x in actions.status.conditions if x.type == "Scheduled").message
    assert "admission by Kueue's queue team-a" in message
    assert "Unschedulable" not in [e.reason for e in actions.events]


def test_kueues_topology_annotations_stay_the_users() -> None:
    topology = {"kueue.x-k8s.io/podset-preferred-topology": "cloud.example.com/rack"}
    assert spec(queueName="team-a", podAnnotations=topology).pod_annotations == topology


def test_a_pod_kueue_stopped_ends_the_attempt_as_preempted_not_as_a_failure_of_the_job() -> None:
    from sftjob.failures import FailureClass
    from sftjob_operator.classify import classify_pod

    evicted = {
        "type": "TerminationTarget",
        "status": "True",
        "reason": "WorkloadEvicted",
        "message": "Preempted to accommodate a workload due to prioritization",
    }
    sigterm = {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
    stopped = pod(phase="Failed", status={"conditions": [evicted], "containerStatuses": [sigterm]})
    trimmed = observe.trim_pod(stopped)
    verdict = classify_pod(trimmed, {"metadata": {"name": "l40s-0"}}, now=NOW)
    assert verdict.failure_class == FailureClass.PREEMPTED
    assert "stopped by Kueue (WorkloadEvicted: Preempted to accommodate a workload" in verdict.message


def test_a_pod_group_kueue_evicted_for_its_pods_ready_timeout_is_a_failure_that_backs_off() -> None:
    from sftjob.failures import FailureClass
    from sftjob_operator.classify import classify_pod

    timed_out = {
        "type": "TerminationTarget",
        "status": "True",
        "reason": "WorkloadEvictedDueToPodsReadyTimeout",
        "message": "Exceeded the PodsReady timeout default/job-1",
    }
    sigterm = {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
    stopped = pod(phase="Failed", status={"conditions": [timed_out], "containerStatuses": [sigterm]})
    stopped["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"  # Kueue deletes what it stops
    verdict = classify_pod(observe.trim_pod(stopped), {"metadata": {"name": "l40s-0"}}, now=NOW)
    assert verdict.failure_class == FailureClass.UNKNOWN
    assert "waitForPodsReady" in verdict.message and "PodsReadyTimeout" in verdict.message


def test_pods_deleted_before_kueue_admitted_them_lose_kueues_finalizer_and_no_other_pod_does() -> None:
    from sftjob_operator.pod_lifecycle import held_by_kueue

    def deleted(name: str, node: str | None, finalizers: list[str]) -> dict[str, object]:
        manifest = pod(phase="Pending", node=node)
        manifest["metadata"] |= {
            "name": name,
            "deletionTimestamp": "2026-01-01T12:00:00Z",
            "finalizers": finalizers,
        }
        return observe.trim_pod(manifest)

    pods = [
        deleted("gated", None, [c.KUEUE_FINALIZER]),
        deleted("ran", "l40s-0", [c.KUEUE_FINALIZER]),  # Kueue takes its finalizer off once the pod stopped
        deleted("unqueued", None, ["example.com/other"]),
    ]
    assert [observe.name(p) for p in held_by_kueue(pods)] == ["gated"]


def test_a_queue_kueue_does_not_manage_the_pods_of_is_said_to_have_no_effect() -> None:
    obs = observed(spec={**SPEC, "queueName": "team-a"})
    first = reconcile(obs, CTX)
    unmanaged = reconcile(then(obs, first, pods=[pod()]), CTX)
    bound = next(x for x in unmanaged.status.conditions if x.type == "Scheduled")
    assert bound.status == "True" and "spec.queueName team-a has no effect" in bound.message
    managed = pod()
    managed["metadata"]["labels"][observe.KUEUE_MANAGED] = "true"  # type: ignore[index]
    admitted = reconcile(then(obs, first, pods=[managed]), CTX)
    assert "no effect" not in next(x for x in admitted.status.conditions if x.type == "Scheduled").message


def test_the_deadline_of_a_job_kueue_queues_without_a_queue_name_counts_from_the_admission_too() -> None:
    from datetime import timedelta

    obs = observed(spec={**SPEC, "activeDeadlineSeconds": 600})  # a namespace with a default LocalQueue
    first = reconcile(obs, CTX)
    waited = reconcile(then(obs, first, pods=[_gated()], now=NOW + timedelta(hours=2)), CTX)
    assert waited.status.phase == "Pending" and waited.status.start_time is None
    running = {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T14:00:00Z"}}}
    admitted = pod(status={"containerStatuses": [running]})
    started = reconcile(then(obs, waited, pods=[admitted], now=NOW + timedelta(hours=2)), CTX)
    assert started.status.start_time == NOW + timedelta(hours=2) and started.status.phase == "Running"


def test_the_deadline_of_a_queued_job_counts_from_kueues_admission_not_from_its_wait() -> None:
    from datetime import timedelta

    obs = observed(spec={**SPEC, "queueName": "team-a", "activeDeadlineSeconds": 600})
    first = reconcile(obs, CTX)
    assert first.status.start_time is None  # pods created, not admitted
    waited = reconcile(then(obs, first, pods=[_gated()], now=NOW + timedelta(hours=2)), CTX)
    assert waited.status.phase == "Pending" and waited.status.start_time is None
    running = {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T14:00:00Z"}}}
    started_late = pod(status={"containerStatuses": [running]})  # admitted two hours in
    admitted = reconcile(then(obs, waited, pods=[started_late], now=NOW + timedelta(hours=2)), CTX)
    assert admitted.status.start_time == NOW + timedelta(hours=2) and admitted.status.phase == "Running"
    later = reconcile(then(obs, admitted, pods=[started_late], now=NOW + timedelta(hours=2, minutes=11)), CTX)
    assert later.status.phase == "Failed" and condition(later, "Failed") == ("True", "DeadlineExceeded")
