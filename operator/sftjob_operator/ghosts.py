"""Ghosts: index entries of SFTJobs and trainer pods that no longer exist, and how a pass tells them
from live objects.

kopf drops an object from its indexes only when it sees the object's DELETED event; after a watch gap
(a 410 and a fresh listing) an object deleted meanwhile stays indexed for good. Such a ghost job stays
under its (namespace, name) key beside a job recreated under the same name (kopf keys the objects of
an index entry by uid). A pass takes the newest entry of its key, and a ghost the API server answers
404 for is tombstoned by uid, so that no pass runs on it again; so is one missing from the list of
uids the handlers ask for now and then, since a quiet ghost (finished without a TTL, suspended) writes
nothing that could be answered 404. A ghost pod would keep its job waiting for it to stop: one whose
delete finds no pod of its uid is tombstoned by uid under its job's key, and left out of the job's
pods. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable

from kubernetes.client.exceptions import ApiException

from sftjob import constants as c
from sftjob_operator.observe import JobView


class Tombstones:
    """Per key, the uids of index entries known to be gone; kept while the index still holds them."""

    def __init__(self) -> None:
        self._uids: dict[Hashable, set[str]] = {}

    def bury(self, key: Hashable, uid: str) -> None:
        self._uids.setdefault(key, set()).add(uid)

    def buried(self, key: Hashable, indexed: Iterable[str]) -> set[str]:
        """The uids of ``indexed`` (the index's entries under ``key``) that are buried. Tombstones of
        entries the index no longer holds are dropped."""
        gone = self._uids.pop(key, set()) & set(indexed)
        if gone:
            self._uids[key] = gone
        return gone

    def forget(self, key: Hashable) -> None:
        self._uids.pop(key, None)

    def select(self, key: Hashable, entries: Iterable[JobView]) -> JobView | None:
        """The job a pass runs on among the index entries under ``key``: not buried, the newest.

        Two entries under one name mean all but one are ghosts (a name holds one object at a time),
        and the live job is the one created last; a tie (both created in the same second) goes to the
        later resourceVersion. Tombstones of entries the index no longer holds are dropped."""
        entries = list(entries)
        gone = self.buried(key, (e.uid for e in entries))
        live = [e for e in entries if e.uid not in gone]
        return max(live, key=lambda e: (e.created or "", _version(e)), default=None)

    def __len__(self) -> int:
        return sum(len(uids) for uids in self._uids.values())


def is_gone(err: BaseException, job: JobView) -> bool:
    """Whether ``err`` is the API server's 404 for ``job`` itself (not for a child, nor for an API)."""
    if not isinstance(err, ApiException) or err.status != 404:
        return False
    try:
        details = json.loads(err.body or "{}")["details"]
        return bool(
            details["group"] == c.API_GROUP and details["kind"] == c.PLURAL and details["name"] == job.name
        )
    except (ValueError, TypeError, KeyError):  # not a Status naming an object
        return False


def _version(job: JobView) -> int:
    """The resourceVersion as a number to order by (etcd's revision; 0 when it is not a number: the API
    calls it opaque)."""
    return int(job.resource_version) if job.resource_version.isdigit() else 0
