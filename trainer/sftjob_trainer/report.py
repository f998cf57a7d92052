"""Progress reporting to the operator: annotations on the trainer's own Pod, through the API server.

Rank 0 keeps the newest progress and checkpoint records and a background thread PATCHes them onto
its Pod at most every ``report.interval_seconds`` (contract-notes.md). Reporting is best effort:
it is disabled, with a log line saying why, when there is no POD_NAME or no cluster to talk to,
and a failed PATCH is logged and retried at the next interval, never raised into training.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from datetime import UTC, datetime
from typing import Any

from sftjob.config import ReportSettings
from sftjob.constants import ANNOTATION_CHECKPOINT, ANNOTATION_PROGRESS
from sftjob_trainer import strict_json

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
REQUEST_TIMEOUT_SECONDS = 10


def rfc3339_now(at: float | None = None) -> str:
    """``at`` (seconds since the epoch; now when None) as the API server writes times."""
    moment = datetime.now(UTC) if at is None else datetime.fromtimestamp(at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class ProgressReporter:
    def __init__(self, settings: ReportSettings) -> None:
        self._interval = settings.interval_seconds
        self._pending: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failures = 0
        self._pod = os.environ.get("POD_NAME")
        self._namespace = _namespace()
        self._api = self._connect(settings.enabled)
        self._thread: threading.Thread | None = None
        if self._api is not None:
            self._thread = threading.Thread(target=self._run, name="progress-reporter", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._api is not None

    def _connect(self, enabled: bool) -> Any:
        if not enabled:
            log.info("progress reporting disabled: report.enabled is false")
            return None
        if not self._pod:
            log.info("progress reporting disabled: POD_NAME is not set (not running in a pod)")
            return None
        try:
            from kubernetes import client, config

            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            elif os.environ.get("KUBECONFIG"):
                config.load_kube_config()
            else:
                log.info("progress reporting disabled: no in-cluster service account and no KUBECONFIG")
                return None
            log.info("progress reporting to pod %s/%s every %gs", self._namespace, self._pod, self._interval)
            return client.CoreV1Api()
        except Exception as exc:
            log.warning("progress reporting disabled: cannot configure the Kubernetes client: %s", exc)
            return None

    def progress(self, record: dict[str, Any]) -> None:
        self._set(ANNOTATION_PROGRESS, record | {"updated": rfc3339_now()})

    def checkpoint(
        self,
        step: int,
        path: str,
        saved_at: float | None = None,
        eval_loss: float | None = None,
        best: dict[str, Any] | None = None,
    ) -> None:
        """The newest checkpoint; ``best`` the one with the lowest evaluation loss (step, path, evalLoss)."""
        record: dict[str, Any] = {"step": step, "path": path, "time": rfc3339_now(saved_at)}
        if eval_loss is not None and math.isfinite(eval_loss):
            record["evalLoss"] = eval_loss
        if best is not None:
            record["best"] = best
        self._set(ANNOTATION_CHECKPOINT, record)

    def _set(self, key: str, value: dict[str, Any]) -> None:
        if self._api is None:
            return
        with self._lock:
            self._pending[key] = strict_json.dumps(value, separators=(",", ":"))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            annotations, self._pending = self._pending, {}
        if not annotations or self._api is None:
            return
        try:
            self._api.patch_namespaced_pod(
                self._pod,
                self._namespace,
                {"metadata": {"annotations": annotations}},
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            self._failures = 0
        except Exception as exc:
            self._failures += 1
            if self._failures == 1 or self._failures % 20 == 0:
                log.warning(
                    "progress report to pod %s failed (%d in a row): %s", self._pod, self._failures, exc
                )
            with self._lock:  # keep what failed unless something newer arrived meanwhile
                self._pending = annotations | self._pending

    def close(self) -> None:
        """Stop the thread and push the final state once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_SECONDS)
        self.flush()


def _namespace() -> str:
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return "default"
