"""The reconcile work queue: each key queued once, never in two passes at once, earliest timer wins."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from sftjob_operator.workqueue import WorkQueue

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_key_added_many_times_is_queued_once() -> None:
    async def scenario() -> list[str]:
        queue: WorkQueue[str] = WorkQueue()
        for key in ("a", "b", "a", "a"):
            queue.add(key)
        return [await queue.get(), await queue.get()] + ([] if len(queue) == 0 else ["extra"])

    assert run(scenario()) == ["a", "b"]


def test_a_key_added_during_its_pass_runs_again_after_it_not_beside_it() -> None:
    async def scenario() -> tuple[int, str]:
        queue: WorkQueue[str] = WorkQueue()
        queue.add("a")
        key = await queue.get()
        queue.add("a")  # an event while the pass runs
        waiting = len(queue)
        queue.done(key)
        return waiting, await asyncio.wait_for(queue.get(), 1)

    assert run(scenario()) == (0, "a")


def test_the_earliest_requested_time_wins_and_a_forgotten_key_is_not_added() -> None:
    async def scenario() -> list[str]:
        queue: WorkQueue[str] = WorkQueue()
        queue.add_after("slow", 60)
        queue.add_after("slow", 0.05)  # sooner: replaces the 60 s timer
        queue.add_after("slow", 30)  # later: the 0.05 s timer stays
        queue.add_after("gone", 0.05)
        queue.forget("gone")
        got = [await asyncio.wait_for(queue.get(), 1)]
        await asyncio.sleep(0.1)
        return got + (["gone"] if len(queue) else [])

    assert run(scenario()) == ["slow"]


def test_a_zero_delay_adds_at_once() -> None:
    async def scenario() -> int:
        queue: WorkQueue[str] = WorkQueue()
        queue.add_after("a", 0)
        return len(queue)

    assert run(scenario()) == 1
