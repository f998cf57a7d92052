"""Pods on their way out: the next attempt waits for an earlier attempt's trainer to stop (it may be
saving its SIGTERM checkpoint), never for a pod on a lost node, which is deleted with force; and a pod
stuck before it runs says why."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

from sftjob import constants as c
from sftjob_operator.reconcile import reconcile
from sftjob_operator.reconcile_io import Actions
from tests.unit.reconcile_cases import (
    CTX,
    NODES,
    NOW,
    SPEC,
    condition,
    observed,
    pod,
    preempted_status,
    started,
    terminated,
    then,
)
from tests.unit.test_create_errors import FakeApi, fake_kube

TWO_NODES = {**SPEC, "gpu": {"type": "A800", "count": 8, "nodes": 2}}
A800: dict[str, Any] = NODES["a800-0"]
SECOND_A800 = {**A800, "metadata": {**A800["metadata"], "name": "a800-1"}}


def not_ready(name: str, since: str) -> dict[str, Any]:
    node: dict[str, Any] = NODES[name]
    ready = {"type": "Ready", "status": "Unknown", "lastTransitionTime": since}
    return {**node, "status": {**node["status"], "conditions": [ready]}}


def deleted(p: dict[str, Any], at: str = "2026-01-01T12:05:30Z") -> dict[str, Any]:
    p["metadata"]["deletionTimestamp"] = at
    return p


def message(actions: Actions, type: str) -> str:
    return next(x.message for x in actions.status.conditions if x.type == type)


def pod_names(actions: Actions) -> list[str]:
    return [m["metadata"]["name"] for m in actions.children if m["kind"] == "Pod"]


def test_a_restart_waits_until_the_failed_attempts_other_rank_has_stopped() -> None:
    obs = replace(observed(spec=TWO_NODES), nodes={**NODES, "a800-1": SECOND_A800})
    first = reconcile(obs, CTX)
    preempted = pod(rank=1, phase="Failed", node="a800-1", status=preempted_status("preempted"))
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), preempted], now=NOW), CTX)
    assert ended.status.attempts[0].reason == "Preempted" and ended.delete_pods == ["job-1-0"]
    assert not ended.children and ended.status.attempt == 1 and ended.requeue_after == 5
    assert message(ended, "Running") == "waiting for attempt 1's pods to stop"
    assert ended.status.phase == "Restarting" and condition(ended, "Scheduled") == ("False", "Restarting")
    saving = [deleted(pod(rank=0, node="a800-0")), preempted]
    still = reconcile(then(obs, ended, pods=saving, now=NOW + timedelta(seconds=5)), CTX)
    assert not still.children and not still.delete_pods and not still.status_changed
    gone = reconcile(then(obs, still, pods=[preempted], now=NOW + timedelta(seconds=10)), CTX)
    assert gone.status.attempt == 2 and pod_names(gone) == ["job-2-0", "job-2-1"]


def test_a_pod_on_a_lost_node_blocks_no_attempt_and_only_an_out_of_service_node_forces_its_delete() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    suspended = reconcile(then(obs, running, pods=[pod()], spec={**SPEC, "suspend": True}), CTX)
    stuck = deleted(pod())  # its kubelet went away mid-delete: Terminating for ever
    lost = replace(then(obs, suspended, pods=[stuck], now=NOW + timedelta(minutes=10)),
                   nodes={**NODES, "l40s-0": not_ready("l40s-0", "2026-01-01T12:01:00Z")})  # fmt: skip
    resumed = reconcile(lost, CTX)
    assert resumed.status.attempt == 2 and pod_names(resumed) == ["job-2-0"]
    # NotReady may be a partition: the containers may still run, so no force (Kubernetes gives none).
    assert resumed.force_delete_pods == [] and resumed.delete_pods == []
    shut_down = not_ready("l40s-0", "2026-01-01T12:01:00Z")
    shut_down["spec"] = {"taints": [{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]}
    marked = reconcile(replace(lost, nodes={**NODES, "l40s-0": shut_down}), CTX)
    assert marked.force_delete_pods == ["job-1-0"]


def test_a_pod_on_a_node_not_ready_only_briefly_is_still_waited_for() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    suspended = reconcile(then(obs, running, pods=[pod()], spec={**SPEC, "suspend": True}), CTX)
    blip = replace(then(obs, suspended, pods=[deleted(pod())], now=NOW + timedelta(minutes=2)),
                   nodes={**NODES, "l40s-0": not_ready("l40s-0", "2026-01-01T12:01:30Z")})  # fmt: skip
    waiting = reconcile(blip, CTX)
    assert waiting.status.attempt == 1 and not waiting.children and not waiting.force_delete_pods


def test_a_pod_long_past_its_deletion_deadline_blocks_no_attempt() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    suspended = reconcile(then(obs, running, pods=[pod()], spec={**SPEC, "suspend": True}), CTX)
    finalized = deleted(pod(), at="2026-01-01T12:00:30Z")  # a finalizer keeps the object
    resumed = reconcile(then(obs, suspended, pods=[finalized], now=NOW + timedelta(minutes=2)), CTX)
    assert resumed.status.attempt == 2 and pod_names(resumed) == ["job-2-0"]


def test_the_pod_of_an_attempt_ended_by_a_lost_node_is_deleted_with_force_once_the_node_is_gone() -> None:
    obs, first = started()
    running = reconcile(then(obs, first, pods=[pod()]), CTX)
    lost = replace(then(obs, running, pods=[pod()], now=NOW + timedelta(minutes=5)),
                   nodes={**NODES, "l40s-0": not_ready("l40s-0", "2026-01-01T12:01:00Z")})  # fmt: skip
    actions = reconcile(lost, CTX)
    assert actions.status.attempts[0].reason == "NodeLost"
    assert actions.quick_delete_pods == ["job-1-0"] and actions.force_delete_pods == []
    assert actions.status.attempt == 2  # restarts at once: nothing of attempt 1 can still run
    gone = replace(lost, nodes={k: v for k, v in NODES.items() if k != "l40s-0"})
    assert reconcile(gone, CTX).force_delete_pods == ["job-1-0"]


def test_a_pod_stuck_creating_its_containers_says_so_in_the_running_condition() -> None:
    obs, first = started()
    waiting = {
        "containerStatuses": [{"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}]
    }
    actions = reconcile(then(obs, first, pods=[pod(phase="Pending", status=waiting)]), CTX)
    assert condition(actions, "Running") == ("False", "ContainersStarting")
    assert message(actions, "Running") == "waiting for the trainer containers: job-1-0: ContainerCreating"


def test_a_force_delete_has_no_grace_period_and_keeps_the_uid_precondition() -> None:
    api = FakeApi()
    fake_kube(api).delete_pod("team", "job-1-0", "pod-uid", 0)
    [(_, _, kwargs)] = api.calls
    assert (kwargs["body"].grace_period_seconds, kwargs["body"].preconditions.uid) == (0, "pod-uid")


def test_a_failed_attempts_surviving_rank_is_deleted_again_until_it_has_gone() -> None:
    obs = replace(observed(spec=TWO_NODES), nodes={**NODES, "a800-1": SECOND_A800})
    first = reconcile(obs, CTX)
    failed = pod(rank=1, phase="Failed", node="a800-1", status=terminated(1, "Error", "boom"))
    ended = reconcile(then(obs, first, pods=[pod(rank=0, node="a800-0"), failed]), CTX)
    assert ended.status.phase == "Restarting" and ended.quick_delete_pods == ["job-1-0"]
    # The delete was lost (the operator stopped after writing the status): the next pass sends it again.
    again = then(obs, ended, pods=[pod(rank=0, node="a800-0"), failed], now=NOW + timedelta(seconds=5))
    assert reconcile(again, CTX).quick_delete_pods == ["job-1-0"]


def test_an_attempt_whose_pod_vanished_with_its_node_counts_the_steps_it_reported_as_lost() -> None:
    obs, first = started()
    reports = {
        c.ANNOTATION_PROGRESS: json.dumps(
            {"step": 500, "totalSteps": 1000, "updated": "2026-01-01T12:04:00Z"}
        ),
        c.ANNOTATION_CHECKPOINT: json.dumps({"step": 400, "path": "/checkpoints/checkpoint-400"}),
    }
    running = reconcile(
        then(obs, first, pods=[pod(annotations=reports)], now=NOW + timedelta(minutes=5)), CTX
    )
    lost = {k: v for k, v in NODES.items() if k != "l40s-0"}
    gone = replace(then(obs, running, pods=[], now=NOW + timedelta(minutes=7)), nodes=lost)
    asked = reconcile(gone, CTX)
    ended = reconcile(replace(gone, gone=frozenset(asked.check_pods)), CTX)
    record = ended.status.attempts[0]
    assert (record.reason, record.lost_steps) == ("NodeLost", 100)
