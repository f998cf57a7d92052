"""The stall clock: a multi-node attempt's starts when its last rank runs (until then the others wait
in torchrun's rendezvous, which is not a stall), and it reads the pods' own progress reports, never
the operator's possibly stale status."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from sftjob import constants as c
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, NOW, SPEC, observed, pod, then

TWO_NODES = {**SPEC, "gpu": {"type": "L40S", "nodes": 2}, "restartPolicy": {"stallTimeoutSeconds": 60}}


def _running_since(at: str) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "trainer", "state": {"running": {"startedAt": at}}}]}


def test_ranks_waiting_for_a_pending_peer_are_not_stalled_and_the_clock_starts_with_the_last_rank() -> None:
    first = observed(spec=TWO_NODES)
    start = reconcile(first, CTX)
    waiting = [pod(rank=0), pod(rank=1, phase="Pending", node=None)]  # rank 0 running since 11:59
    hour_later = then(first, start, pods=waiting, now=NOW + timedelta(hours=1))
    actions = reconcile(hour_later, CTX)
    assert not actions.status.attempts[-1].ended, actions.status.attempts[-1]

    both = [pod(rank=0), pod(rank=1, status=_running_since("2026-01-01T12:59:30Z"))]
    just_joined = then(hour_later, actions, pods=both, now=NOW + timedelta(hours=1))
    actions = reconcile(just_joined, CTX)
    assert not actions.status.attempts[-1].ended  # 30 s since the last rank started

    silent = then(just_joined, actions, now=NOW + timedelta(hours=1, minutes=2))
    ended = reconcile(silent, CTX).status.attempts[-1]
    assert ended.ended and ended.reason == "Stalled"


def _reported(step: int, at: str) -> dict[str, str]:
    return {c.ANNOTATION_PROGRESS: json.dumps({"step": step, "totalSteps": 5000, "updated": at})}


def test_a_job_that_kept_reporting_while_the_operator_was_down_longer_than_the_stall_timeout_runs_on() -> (
    None
):
    spec = {**SPEC, "restartPolicy": {"stallTimeoutSeconds": 600}}
    obs = observed(spec=spec)
    start = reconcile(obs, CTX)
    seen = reconcile(then(obs, start, pods=[pod(annotations=_reported(100, "2026-01-01T12:01:00Z"))]), CTX)
    # the operator was down 15 minutes; the trainer reported at 12:15:50, ten seconds ago
    fresh = pod(annotations=_reported(900, "2026-01-01T12:15:50Z"))
    actions = reconcile(then(obs, seen, pods=[fresh], now=NOW + timedelta(minutes=16)), CTX)
    assert not actions.status.attempts[-1].ended and not actions.delete_pods
    assert actions.status.progress is not None and actions.status.progress.step == 900


def test_a_report_without_a_time_zone_is_read_as_utc_and_the_job_is_still_judged() -> None:
    # A trainer of the user's own image reporting datetime.utcnow().isoformat(): no "Z".
    spec = {**SPEC, "restartPolicy": {"stallTimeoutSeconds": 60}}
    first = observed(spec=spec)
    start = reconcile(first, CTX)
    reporting = [pod(annotations=_reported(40, "2026-01-01T11:59:30"))]
    fresh = reconcile(then(first, start, pods=reporting, now=NOW), CTX)
    assert fresh.status.progress is not None and fresh.status.progress.step == 40
    assert not fresh.status.attempts[-1].ended
    later = reconcile(then(first, fresh, pods=reporting, now=NOW + timedelta(minutes=2)), CTX)
    assert later.status.attempts[-1].reason == "Stalled"


def test_a_report_a_pass_cannot_read_is_no_report() -> None:
    first = observed()
    start = reconcile(first, CTX)
    broken = {c.ANNOTATION_PROGRESS: '{"step": Infinity, "totalSteps": 5000}'}
    actions = reconcile(then(first, start, pods=[pod(annotations=broken)], now=NOW), CTX)
    assert actions.status.progress is None and not actions.status.attempts[-1].ended
