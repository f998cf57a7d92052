"""The two things measured: the SFTJob operator, and the floor (batch/v1 Jobs and the Job controller).

A subject creates one object per job and names the process doing the controller work: the operator
subprocess this module starts, or the kube-controller-manager the floor relies on (whose figures then
include its other controllers; its CPU is still what the control plane spends on the floor).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from scale import REPO_ROOT
from scale.workload import batch_job, sftjob
from sftjob import constants as c
from sftjob_dev.cluster import Cluster

CRD = REPO_ROOT / "crds" / "sftjob.io_sftjobs.yaml"
START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
# The operator's own counters worth a per-stage difference (summed over their labels).
OPERATOR_COUNTERS = (
    "sftjob_operator_reconcile_total",
    "sftjob_operator_reconcile_duration_seconds_sum",
    "sftjob_operator_reconcile_duration_seconds_count",
    "sftjob_operator_pods_created_total",
    "sftjob_operator_watch_events_total",
)


class Subject(Protocol):
    name: str
    kind: str  # what the harness creates per job: "SFTJob" or "Job"
    controller: str  # the process named in the results: "sftjob-operator" or "kube-controller-manager"

    def start(self) -> None: ...
    def create(self, name: str, gpu_type: str) -> None: ...
    def controller_pid(self) -> int: ...
    def counters(self) -> dict[str, float]: ...
    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def component_pids(cluster: Cluster) -> dict[str, int]:
    pids: dict[str, int] = json.loads(cluster.state_file.read_text())["pids"]
    return pids


class Floor:
    """batch/v1 Jobs created by this script; the controller manager's Job controller makes the pods."""

    name = "floor"
    kind = "Job"
    controller = "kube-controller-manager"

    def __init__(self, cluster: Cluster, api: client.ApiClient, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.batch = client.BatchV1Api(api)

    def start(self) -> None:
        pass

    def create(self, name: str, gpu_type: str) -> None:
        body: Any = batch_job(name, gpu_type)  # a plain dict: the client sends it as it is
        self.batch.create_namespaced_job(self.namespace, body, _preload_content=False)

    def controller_pid(self) -> int:
        return component_pids(self.cluster)[self.controller]

    def counters(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass


class Operator:
    """``python -m sftjob_operator --standalone`` as a subprocess with the admin kubeconfig."""

    name = "operator"
    kind = "SFTJob"
    controller = "sftjob-operator"

    def __init__(
        self, cluster: Cluster, api: client.ApiClient, namespace: str, log: Path, profile: Path | None
    ) -> None:
        self.cluster, self.namespace, self.log, self.profile = cluster, namespace, log, profile
        self.custom = client.CustomObjectsApi(api)
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.cluster.kubectl("apply", "-f", str(CRD))
        self.cluster.wait_established("sftjobs.sftjob.io")
        live = free_port()
        profiler = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        argv = [
            sys.executable, *profiler, "-m", "sftjob_operator", "--standalone",
            "--metrics-port", str(self.metrics_port),
            "--liveness", f"http://127.0.0.1:{live}/healthz",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, **self.cluster.env()},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not _get(f"http://127.0.0.1:{live}/healthz"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}; log: {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the operator was not live after {START_TIMEOUT:.0f} s; log: {self.log}")
            time.sleep(0.2)

    def create(self, name: str, gpu_type: str) -> None:
        self.custom.create_namespaced_custom_object(
            c.API_GROUP,
            c.API_VERSION,
            self.namespace,
            c.PLURAL,
            sftjob(name, gpu_type),
            _preload_content=False,
        )

    def controller_pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def counters(self) -> dict[str, float]:
        text = _get(f"http://127.0.0.1:{self.metrics_port}/metrics").decode()
        totals = dict.fromkeys(OPERATOR_COUNTERS, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return totals

    def stop(self) -> None:
        """SIGTERM (kopf stops its handlers; cProfile, when on, writes its file), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)


def _get(url: str) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(url, timeout=5) as response:
            body: bytes = response.read()
    except OSError:
        return b""
    return body
