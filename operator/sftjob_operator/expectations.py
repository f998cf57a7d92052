"""The children this operator process created recently, so a pass does not send them again while
the watch that would show them is behind (the "expectations" of Kubernetes' own controllers).

A pass that runs before the index shows the pods it just created renders them (and the attempt's
other children) again; without this record every child would be POSTed twice, the second time to be
answered 409 and followed by PATCHes. It is an optimisation only and never a source of truth: it
lives in memory, so after an operator restart it is empty and creating a child that exists (409) is
the correct, slower path. A pod's entry lapses after ``EXPECTATION_TIMEOUT_SECONDS``: pods are
watched, and one the index still lacks by then is sent again. The attempt's other children are not
watched, so nothing would ever confirm them: their entries last for the attempt, up to
``CHILD_EXPECTATION_SECONDS``. Otherwise a pod refused for long (a namespace's GPU ResourceQuota,
retried every 30 s) would send all of them again every other retry, and rewrite the ConfigMap and
Role each time. One deleted by hand meanwhile is sent again once its entry lapses, at once when a
pod's create says something it refers to is missing (``forget``, by the handlers: a ServiceAccount),
and with the next attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

# How long a pod created by this process is taken as present without the index showing it...
EXPECTATION_TIMEOUT_SECONDS = 30.0
# ... and any other child of its attempt (no watch shows them): a lapse this long costs a queued job one
# round of creates (answered 409, then read) every 10 minutes.
CHILD_EXPECTATION_SECONDS = 600.0

# (attempt, kind, name) of a job's child
_Key = tuple[int, str, str]


class Expectations:
    """Per job (its key, e.g. namespace and name): its uid, and which children of which attempt this
    process created, and when. A new job of the same name (a new uid) starts afresh."""

    def __init__(
        self,
        timeout_seconds: float = EXPECTATION_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        children_timeout_seconds: float = CHILD_EXPECTATION_SECONDS,
    ) -> None:
        self.timeout_seconds, self.clock = timeout_seconds, clock
        self.children_timeout_seconds = children_timeout_seconds
        self._jobs: dict[Hashable, tuple[str, dict[_Key, float]]] = {}

    def pending(self, job: Hashable, uid: str, attempt: int, manifest: Mapping[str, Any]) -> bool:
        """True while a child this process created for ``attempt`` is still expected to appear."""
        known_uid, children = self._jobs.get(job, ("", {}))
        created = children.get(_key(attempt, manifest)) if known_uid == uid else None
        lapse = self.timeout_seconds if manifest["kind"] == "Pod" else self.children_timeout_seconds
        return created is not None and self.clock() - created <= lapse

    def created(self, job: Hashable, uid: str, attempt: int, manifest: Mapping[str, Any]) -> None:
        """Record a child as created (or found existing) now; older attempts' entries are dropped."""
        known_uid, children = self._jobs.get(job, (uid, {}))
        if known_uid != uid:
            children = {}
        children = {k: t for k, t in children.items() if k[0] >= attempt}
        children[_key(attempt, manifest)] = self.clock()
        self._jobs[job] = (uid, children)

    def forget(self, job: Hashable) -> None:
        """The job is gone, or a child it expects may be (its children are all sent again)."""
        self._jobs.pop(job, None)


def _key(attempt: int, manifest: Mapping[str, Any]) -> _Key:
    return attempt, str(manifest["kind"]), str(manifest["metadata"]["name"])
