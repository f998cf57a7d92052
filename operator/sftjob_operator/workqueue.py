"""The queue of jobs waiting for a reconcile pass, with the guarantees client-go's workqueue gives.

Watch events and timers add a job's key; a fixed set of workers take keys off. A key is queued at most
once however many events name it, and is never in two passes at once: a key added while its pass runs
is queued again when that pass is done, so the change that arrived meanwhile is not lost. Delayed adds
(requeue after a backoff, a deadline, the resync) keep one timer per key, the earliest asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)


class WorkQueue(Generic[Key]):
    def __init__(self) -> None:
        self._ready: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    def add(self, key: Key) -> None:
        if key in self._active:
            self._again.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._ready.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        """Add ``key`` in ``delay`` seconds, unless a timer already adds it sooner."""
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= when:
                return
            timer.cancel()
        self._timers[key] = loop.call_at(when, self._fire, key)

    def _fire(self, key: Key) -> None:
        del self._timers[key]
        self.add(key)

    async def get(self) -> Key:
        """The next key; it is in a pass until :meth:`done`."""
        key = await self._ready.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.discard(key)
            self.add(key)

    def forget(self, key: Key) -> None:
        """Drop the key's timer (the object is gone); a queued or running pass still runs."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def __len__(self) -> int:
        return len(self._queued)
