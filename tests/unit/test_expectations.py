"""The operator's in-memory record of children it created, which saves re-sending them."""

from __future__ import annotations

from sftjob_operator.expectations import Expectations

POD = {"kind": "Pod", "metadata": {"name": "job-1-0"}}
ROLE = {"kind": "Role", "metadata": {"name": "job-trainer"}}
JOB = ("ns", "job")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_pod_created_moments_ago_is_expected_and_lapses_after_the_timeout() -> None:
    clock = Clock()
    expected = Expectations(timeout_seconds=30, clock=clock)
    assert not expected.pending(JOB, "uid", 1, POD)
    expected.created(JOB, "uid", 1, POD)
    clock.now += 29
    assert expected.pending(JOB, "uid", 1, POD) and not expected.pending(JOB, "uid", 1, ROLE)
    clock.now += 2
    assert not expected.pending(JOB, "uid", 1, POD)


def test_a_new_attempt_expects_its_own_children_and_drops_the_old_ones() -> None:
    expected = Expectations(clock=Clock())
    expected.created(JOB, "uid", 1, ROLE)
    assert not expected.pending(JOB, "uid", 2, ROLE) and not expected.pending(("ns", "other"), "uid", 1, ROLE)
    expected.created(JOB, "uid", 2, ROLE)
    assert expected.pending(JOB, "uid", 2, ROLE) and not expected.pending(JOB, "uid", 1, ROLE)


def test_a_forgotten_job_expects_nothing() -> None:
    expected = Expectations(clock=Clock())
    expected.created(JOB, "uid", 1, POD)
    expected.forget(JOB)
    assert not expected.pending(JOB, "uid", 1, POD)


def test_a_new_job_of_the_same_name_expects_none_of_the_old_ones_children() -> None:
    expected = Expectations(clock=Clock())
    expected.created(JOB, "old-uid", 1, POD)
    assert not expected.pending(JOB, "new-uid", 1, POD)
    expected.created(JOB, "new-uid", 1, ROLE)
    assert expected.pending(JOB, "new-uid", 1, ROLE) and not expected.pending(JOB, "new-uid", 1, POD)


def test_a_child_no_watch_shows_stays_expected_for_the_attempt_up_to_the_long_lapse() -> None:
    clock = Clock()
    expected = Expectations(timeout_seconds=30, clock=clock, children_timeout_seconds=600)
    expected.created(JOB, "uid", 1, ROLE)
    expected.created(JOB, "uid", 1, POD)
    clock.now += 300  # a pod refused by a quota all that time: only the pod is sent again
    assert expected.pending(JOB, "uid", 1, ROLE) and not expected.pending(JOB, "uid", 1, POD)
    clock.now += 301  # one deleted by hand meanwhile is sent again at last
    assert not expected.pending(JOB, "uid", 1, ROLE)
