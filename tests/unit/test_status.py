"""Reading a status another operator version (or a person) wrote: never dropped whole for one bad part."""

from __future__ import annotations

from typing import Any

from sftjob.failures import FailureClass
from sftjob.job_status import GpuStatus
from sftjob.spec import SFTJobSpec
from sftjob_operator.status import node_of_rank, read_status

RUNNING: dict[str, Any] = {
    "phase": "Running",
    "attempt": 3,
    "restarts": 2,
    "lastCheckpoint": {"step": 40, "path": "/checkpoints/checkpoint-40"},
    "attempts": [
        {"attempt": 1, "endTime": "2026-01-01T11:00:00Z", "reason": "SomeNewClass", "message": "x"},
        {"attempt": 2, "endTime": "2026-01-01T11:30:00Z", "reason": "Preempted"},
        {"attempt": 3, "startTime": "2026-01-01T11:31:00Z"},
    ],
}


def test_a_readable_status_reads_with_nothing_repaired() -> None:
    status, repairs = read_status({**RUNNING, "attempts": RUNNING["attempts"][1:]})
    assert repairs == [] and status.attempt == 3


def test_a_failure_class_this_operator_does_not_know_reads_as_unknown_and_keeps_the_history() -> None:
    status, repairs = read_status(RUNNING)
    assert (status.phase, status.attempt, status.restarts) == ("Running", 3, 2)
    assert status.last_checkpoint is not None and status.last_checkpoint.step == 40
    assert [(r.attempt, r.reason) for r in status.attempts] == [
        (1, FailureClass.UNKNOWN), (2, FailureClass.PREEMPTED), (3, None),
    ]  # fmt: skip
    assert status.attempts[0].message == "x"
    assert repairs == ["status.attempts[0].reason 'SomeNewClass' is unknown here: read as Unknown"]


def test_an_unreadable_record_or_field_is_left_out_alone_naming_where_it_was() -> None:
    broken = {
        **RUNNING,
        "attempts": [{"attempt": 0}, *RUNNING["attempts"][1:]],
        "conditions": [{"type": "Running"}],
        "gpu": {"nodes": "a800-0"},
    }
    status, repairs = read_status(broken)
    assert [r.attempt for r in status.attempts] == [2, 3] and status.conditions == []
    assert status.gpu == GpuStatus() and (status.attempt, status.restarts) == (3, 2)
    assert [r.split(" (")[0] for r in repairs] == [
        "status.attempts[0] left out", "status.conditions[0] left out", "status.gpu reset",
    ]  # fmt: skip
    assert "attempts.0.attempt: Input should be greater than or equal to 1" in repairs[0]


def test_a_vanished_pods_node_is_its_ranks_only_once_every_rank_was_bound() -> None:
    spec = SFTJobSpec.model_validate(
        {"model": {"name": "m/m"}, "dataset": {"name": "d/d"}, "gpu": {"type": "A800", "nodes": 2}}
    )
    both = GpuStatus(nodes=["a800-0", "a800-1"])
    assert [node_of_rank(both, spec, r) for r in (0, 1)] == ["a800-0", "a800-1"]
    assert node_of_rank(GpuStatus(nodes=["a800-1"]), spec, 0) is None
