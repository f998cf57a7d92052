"""Helpers for the operator e2e tests: the operator as a subprocess, SFTJobs through kubectl, polling.

The fixtures in ``conftest.py`` hand these to the tests; test modules import the helpers directly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sftjob_dev.cluster import Cluster, outside_pod_env
from sftjob_dev.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "sftjob.io_sftjobs.yaml"
START_TIMEOUT = 60.0
READY_TIMEOUT = 180.0
READY_NAMESPACE = "test-operator-ready"  # matches the operator's --namespace test-*
Completed = subprocess.CompletedProcess[str]


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 30.0,
    every: float = 0.25,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll until ``check()`` returns something truthy and return it; fail with ``what`` on timeout,
    followed by what ``explain()`` says about the state that was waited on."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{detail}", pytrace=False)
        time.sleep(every)


class Operator:
    """The operator as a subprocess of the test session."""

    def __init__(self, cluster: Cluster, log: Path) -> None:
        self.cluster, self.log = cluster, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = 0

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def start(self) -> None:
        live, self.metrics_port = free_ports(2)
        argv = [
            sys.executable, "-m", "sftjob_operator", "--standalone",
            # Only the tests' own namespaces (the root conftest names them test-*): tests that run an
            # operator of their own (the chart's, Prometheus') use other namespaces and are left alone.
            "--namespace", "test-*",
            "--metrics-port", str(self.metrics_port),
            "--liveness", f"http://127.0.0.1:{live}/healthz",
            "--log-format", "plain",
            "--resync-seconds", "5",
        ]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**outside_pod_env(), **self.cluster.env()},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        wait_for("the operator's liveness endpoint", lambda: self._alive(live), timeout=START_TIMEOUT)
        self._wait_reconciling()

    def _wait_reconciling(self) -> None:
        """Until the operator has written a job's status. Alive is not ready: after a (re)start kopf first
        lists every namespace it watches, some still terminating after earlier tests, and a test's job
        created meanwhile waits; a suspended probe job (no pods) in a namespace of its own tells."""
        self.cluster.kubectl("create", "namespace", READY_NAMESPACE, check=False)  # kept for the session
        name = f"ready-{uuid.uuid4().hex[:6]}"
        probe = sftjob(name, suspend=True)
        self.cluster.kubectl("-n", READY_NAMESPACE, "apply", "-f", "-", input=yaml.safe_dump(probe))

        def reconciled() -> bool:
            got = self.cluster.kubectl(
                "-n", READY_NAMESPACE, "get", "sftjob", name, "-o", "json", check=False
            )
            return got.returncode == 0 and bool(
                (json.loads(got.stdout).get("status") or {}).get("conditions")
            )

        wait_for(f"the operator to reconcile {READY_NAMESPACE}/{name}", reconciled, timeout=READY_TIMEOUT)
        self.cluster.kubectl("-n", READY_NAMESPACE, "delete", "sftjob", name, "--wait=false", check=False)

    def _alive(self, port: int) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}:\n{self.tail()}", pytrace=False)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, no goodbye; whatever the operator was doing stops mid-way."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Jobs:
    """SFTJobs and their pods in one test namespace, through kubectl as the cluster admin."""

    cluster: Cluster
    namespace: str

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl("-n", self.namespace, *args, input=input, check=check)

    def apply(self, *manifests: dict[str, Any] | str) -> None:
        docs = [m if isinstance(m, str) else yaml.safe_dump(m) for m in manifests]
        self.kubectl("apply", "-f", "-", input="\n---\n".join(docs))

    def get(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.kubectl("get", "sftjob", name, "-o", "json").stdout))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.get(name).get("status") or {})

    def condition(self, name: str, type: str) -> dict[str, Any]:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type), {})

    def wait_phase(self, name: str, phase: str, timeout: float = 30.0) -> dict[str, Any]:
        # Each poll starts kubectl (a fraction of a core for a moment): a long wait, for a trainer that
        # needs the machine's CPUs, polls once a second.
        return dict(
            wait_for(
                f"{name} to be {phase}",
                lambda: (s := self.status(name)).get("phase") == phase and s,
                timeout,
                every=0.25 if timeout <= 30 else 1.0,
            )
        )

    def pods(self, job: str | None = None) -> list[dict[str, Any]]:
        selector = f"sftjob.io/job={job}" if job else "sftjob.io/job"
        items = json.loads(self.kubectl("get", "pods", "-l", selector, "-o", "json").stdout)["items"]
        return list(items)

    def node_product(self, node: str) -> str:
        labels = json.loads(self.cluster.kubectl("get", "node", node, "-o", "json").stdout)["metadata"][
            "labels"
        ]
        return str(labels["nvidia.com/gpu.product"])

    def steer(self, pod: str, **annotations: str) -> None:
        pairs = [f"sim.sftjob.dev/{k.replace('_', '-')}={v}" for k, v in annotations.items()]
        self.kubectl("annotate", "--overwrite", "pod", pod, *pairs)

    def running_pods(self, job: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        def ready() -> list[dict[str, Any]] | None:
            pods = [p for p in self.pods(job) if p["status"].get("phase") == "Running"]
            return pods if len(pods) == count else None

        return list(
            wait_for(f"{count} running pod(s) of {job}", ready, timeout, explain=lambda: self.explain(job))
        )

    def explain(self, job: str) -> str:
        """The job's phase and conditions, its pods' phases and scheduling messages, the namespace's claims:
        what a timed-out wait shows, so a slow or stuck step is named in the failure itself."""
        lines = [f"{job}: phase {self.status(job).get('phase')}"]
        for c in self.status(job).get("conditions", []):
            lines.append(f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}")
        for pod in self.pods(job):
            scheduled = next(
                (c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), {}
            )
            where = f"{pod['status'].get('phase')} on {pod['spec'].get('nodeName')}"
            why = f"{scheduled.get('reason', '')} {scheduled.get('message', '')}"
            lines.append(f"  pod {pod['metadata']['name']}: {where} {why}")
        claims = json.loads(self.kubectl("get", "pvc", "-o", "json").stdout)["items"]
        lines += [f"  claim {c['metadata']['name']}: {c['status'].get('phase')}" for c in claims]
        return "\n".join(lines)

    def delete_all(self, timeout: float = 180.0) -> None:
        self.kubectl("delete", "sftjobs", "--all", "--wait=true", f"--timeout={timeout:.0f}s", check=False)
        wait_for("the namespace's trainer pods to go", lambda: not self.pods(), timeout=timeout)


def sftjob(name: str, **spec: Any) -> dict[str, Any]:
    """An SFTJob manifest with a small default model and dataset; ``spec`` entries override."""
    body: dict[str, Any] = {
        "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"},
        "dataset": {"name": "HuggingFaceH4/ultrachat_200k"},
        "gpu": {"type": "L40S", "count": 1},
    }
    body.update(spec)
    return {"apiVersion": "sftjob.io/v1alpha1", "kind": "SFTJob", "metadata": {"name": name}, "spec": body}
