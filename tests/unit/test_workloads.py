"""Kueue's reason for holding a queued attempt, read from its Workload (sftjob_operator.workloads)."""

from __future__ import annotations

from typing import Any

from sftjob_operator import workloads

GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"


def pod(*, gated: bool, group: str | None = "job-1a2b3c4d-1") -> dict[str, Any]:
    reason = "SchedulingGated" if gated else "Unschedulable"
    return {
        "metadata": {"name": "job-1-0", "labels": {GROUP_LABEL: group} if group else {}},
        "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": reason}]},
    }


def workload(status: str, message: str) -> dict[str, Any]:
    condition = {"type": "QuotaReserved", "status": status, "reason": "Pending", "message": message}
    return {"status": {"conditions": [condition]}}


def test_the_workload_read_is_the_pod_group_of_a_pod_held_at_its_gate() -> None:
    assert workloads.queued_group([pod(gated=False), pod(gated=True)]) == "job-1a2b3c4d-1"


def test_no_workload_is_read_for_pods_not_gated_or_outside_a_pod_group() -> None:
    assert workloads.queued_group([pod(gated=False)]) is None
    assert workloads.queued_group([pod(gated=True, group=None)]) is None
    assert workloads.queued_group([]) is None


def test_kueues_pending_message_is_the_reason_the_attempt_waits() -> None:
    message = (
        "couldn't assign flavors to pod set main: "
        "insufficient unused quota for nvidia.com/gpu in flavor a800, 4 more needed"
    )
    assert workloads.pending_reason(workload("False", message)) == message
    assert workloads.pending_reason(workload("False", "LocalQueue team-x doesn't exist")) == (
        "LocalQueue team-x doesn't exist"
    )


def test_a_workload_with_quota_reserved_or_no_condition_gives_no_reason() -> None:
    assert workloads.pending_reason(workload("True", "Quota reserved in ClusterQueue gpus")) is None
    assert workloads.pending_reason({"status": {}}) is None
    assert workloads.pending_reason(None) is None


def test_a_long_message_listing_every_flavor_is_cut_short_on_one_line() -> None:
    long = "couldn't assign flavors to pod set main:\n" + "; ".join(
        f"flavor f{i} lacks quota" for i in range(40)
    )
    reason = workloads.pending_reason(workload("False", long))
    assert reason is not None and len(reason) == workloads.MAX_MESSAGE and reason.endswith("...")
    assert "\n" not in reason
