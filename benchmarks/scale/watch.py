"""Watch the benchmark namespace and note when each job first reached each milestone.

Milestones come from pods (created, scheduled, Running) and from the job object itself (``ready``: an
SFTJob's ``status.phase`` is Running, a batch Job counts a ready pod), which says when the controller
has caught up, as a user running ``kubectl get`` would see it. Times are when the watch event reached
the harness (``time.monotonic``), the clock the creates use; the objects' own timestamps have
whole-second resolution. Events are parsed as plain JSON, never into client models, so the watcher
keeps up with thousands of objects on a shared CPU.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from sftjob import constants as c

WATCH_SECONDS = 60
Obj = dict[str, Any]
Milestones = Callable[[Obj], tuple[str | None, list[str]]]  # object -> (job name, milestones reached)
# A list call of the client (list_namespaced_pod, ...) with its leading arguments bound.
Lister = Callable[..., Any]


def pod_milestones(pod: Obj) -> tuple[str | None, list[str]]:
    job = (pod.get("metadata", {}).get("labels") or {}).get(c.LABEL_JOB)
    reached = ["podCreated"]
    if pod.get("spec", {}).get("nodeName"):
        reached.append("podScheduled")
    if pod.get("status", {}).get("phase") == "Running":
        reached.append("podRunning")
    return job, reached


def sftjob_milestones(job: Obj) -> tuple[str | None, list[str]]:
    running = (job.get("status") or {}).get("phase") == "Running"
    return job.get("metadata", {}).get("name"), ["ready"] if running else []


def batch_job_milestones(job: Obj) -> tuple[str | None, list[str]]:
    ready = int((job.get("status") or {}).get("ready") or 0) >= 1
    return job.get("metadata", {}).get("name"), ["ready"] if ready else []


class Watcher:
    """One watch (list, then watch from its resourceVersion; relist on 410) on a background thread."""

    def __init__(
        self,
        name: str,
        lister: Lister,
        milestones: Milestones,
        seen: dict[str, dict[str, float]],
        lock: threading.Lock,
    ) -> None:
        self.name, self.lister, self.milestones, self.seen, self.lock = name, lister, milestones, seen, lock
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(timeout=60):
            raise RuntimeError(f"the {self.name} watch did not start within 60 s")

    def stop(self) -> None:
        """End the watch now: shutting its socket down wakes the thread blocked on reading it."""
        self._stop.set()
        if self._response is not None:
            self._response.shutdown()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        version = self._list()
        self._ready.set()
        while not self._stop.is_set():
            try:
                version = self._watch(version)
            except ApiException as err:
                if err.status != 410:
                    raise
                version = self._list()
            except Exception:
                if not self._stop.is_set():
                    raise

    def _list(self) -> str:
        body = json.loads(self.lister(_preload_content=False).data)
        for obj in body["items"]:
            self._note(obj)
        return str(body["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        response = self.lister(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _preload_content=False,
        )
        self._response = response
        try:
            for line in iter_resp_lines(response):
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise ApiException(status=int(obj.get("code") or 500), reason=str(obj.get("message")))
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self._note(obj)
                version = str(obj.get("metadata", {}).get("resourceVersion") or version)
                if self._stop.is_set():
                    break
        finally:
            response.release_conn()
        return version

    def _note(self, obj: Obj) -> None:
        now = time.monotonic()
        job, reached = self.milestones(obj)
        if not job:
            return
        with self.lock:
            for milestone in reached:
                self.seen[milestone].setdefault(job, now)


class Tracker:
    """The pods' milestones and the job objects' ``ready`` for one namespace and subject kind."""

    MILESTONES = ("podCreated", "podScheduled", "podRunning", "ready")

    def __init__(self, api: client.ApiClient, namespace: str, kind: str) -> None:
        self.seen: dict[str, dict[str, float]] = {m: {} for m in self.MILESTONES}
        self.lock = threading.Lock()
        core, batch, custom = client.CoreV1Api(api), client.BatchV1Api(api), client.CustomObjectsApi(api)

        def pods(**kw: Any) -> Any:
            return core.list_namespaced_pod(namespace, label_selector=c.LABEL_JOB, **kw)

        def jobs(**kw: Any) -> Any:
            if kind == "SFTJob":
                return custom.list_namespaced_custom_object(
                    c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, **kw
                )
            return batch.list_namespaced_job(namespace, **kw)

        job_milestones = sftjob_milestones if kind == "SFTJob" else batch_job_milestones
        self.watchers = [
            Watcher("pods", pods, pod_milestones, self.seen, self.lock),
            Watcher("jobs", jobs, job_milestones, self.seen, self.lock),
        ]

    def start(self) -> None:
        for watcher in self.watchers:
            watcher.start()

    def stop(self) -> None:
        for watcher in self.watchers:
            watcher.stop()

    def count(self, milestone: str, names: set[str]) -> int:
        """How many of ``names`` reached ``milestone``."""
        with self.lock:
            return len(names.intersection(self.seen[milestone]))

    def times(self, milestone: str) -> dict[str, float]:
        with self.lock:
            return dict(self.seen[milestone])
