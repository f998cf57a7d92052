"""spec.queueName: the trainer pods as one Kueue pod group per attempt, and a job whose pods wait for
Kueue's admission shown as Queued, not as unschedulable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, condition, pod, started, then
from tests.unit.test_builders import JOB, spec
from tests.unit.test_builders import pod as trainer_pod


def test_each_attempts_pods_are_one_kueue_pod_group_in_the_jobs_queue() -> None:
    two_nodes = spec(queueName="team-a", gpu={"type": "A800", "count": 8, "nodes": 2})
    manifests = [trainer_pod(two_nodes, rank) for rank in (0, 1)]
    for manifest in manifests:
        labels, annotations = manifest["metadata"]["labels"], manifest["metadata"]["annotations"]
        assert labels[c.KUEUE_QUEUE_LABEL] == "team-a"
        assert labels[c.KUEUE_POD_GROUP_LABEL] == f"{JOB.name}-{JOB.attempt}"  # a new group per attempt
        assert (
            annotations[c.KUEUE_POD_GROUP_COUNT] == "2" and annotations[c.KUEUE_RETRIABLE_IN_GROUP] == "false"
        )
        assert labels[c.LABEL_JOB] == JOB.name  # the operator's own labels stay


def test_without_a_queue_the_pods_carry_nothing_of_kueues() -> None:
    metadata = trainer_pod(spec())["metadata"]
    assert not [
        k for k in {**metadata["labels"], **metadata.get("annotations", {})} if k.startswith("kueue.")
    ]


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"queueName": "Team_A"}, "should match pattern"),
        ({"queueName": "q" * 64}, "at most 63 characters"),
        ({"podAnnotations": {c.KUEUE_POD_GROUP_COUNT: "1"}}, "set spec.queueName"),
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
