"""The children this operator process created recently, so a pass does not send them again while
the watch that would show them is behind (the "expectations" of Kubernetes' own controllers).

A pass that runs before the index shows the pods it just created renders them (and the attempt's
other children) again; without this record every child would be POSTed twice, the second time to be
answered 409 and followed by PATCHes. It is an optimisation only and never a source of truth: it
lives in memory, so after an operator restart it is empty and creating a child that exists (409) is
the correct, slower path; an entry also lapses after ``EXPECTATION_TIMEOUT_SECONDS``, after which
the child is sent again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

# How long a child created by this process is taken as present without the index showing it.
EXPECTATION_TIMEOUT_SECONDS = 30.0

# (attempt, kind, name) of a job's child
_Key = tuple[int, str, str]


class Expectations:
    """Per job (its key, e.g. namespace and name): its uid, and which children of which attempt this
    process created, and when. A new job of the same name (a new uid) starts afresh."""

    def __init__(
        self,
        timeout_seconds: float = EXPECTATION_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_seconds, self.clock = timeout_seconds, clock
        self._jobs: dict[Hashable, tuple[str, dict[_Key, float]]] = {}

    def pending(self, job: Hashable, uid: str, attempt: int, manifest: Mapping[str, Any]) -> bool:
        """True while a child this process created for ``attempt`` is still expected to appear."""
        known_uid, children = self._jobs.get(job, ("", {}))
        created = children.get(_key(attempt, manifest)) if known_uid == uid else None
        return created is not None and self.clock() - created <= self.timeout_seconds

    def created(self, job: Hashable, uid: str, attempt: int, manifest: Mapping[str, Any]) -> None:
        """Record a child as created (or found existing) now; older attempts' entries are dropped."""
        known_uid, children = self._jobs.get(job, (uid, {}))
        if known_uid != uid:
            children = {}
        children = {k: t for k, t in children.items() if k[0] >= attempt}
        children[_key(attempt, manifest)] = self.clock()
        self._jobs[job] = (uid, children)

    def forget(self, job: Hashable) -> None:
        """The job is gone."""
        self._jobs.pop(job, None)


def _key(attempt: int, manifest: Mapping[str, Any]) -> _Key:
    return attempt, str(manifest["kind"]), str(manifest["metadata"]["name"])
