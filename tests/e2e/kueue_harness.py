"""Kueue itself beside the local control plane, for the tests that hold our pod groups against the real
thing rather than against our reading of its docs.

`hack/build-control-plane.sh kueue` builds the manager from its Go module and copies its CRDs and webhook
manifests next to it. Kueue serves its webhooks on loopback with the cluster's own serving certificate
(valid for 127.0.0.1, signed by the cluster CA), so the webhook configurations name a URL instead of a
Service (the fake cluster's Service IPs lead nowhere). The manager insists on reading a metrics
certificate from `/etc/kueue/metrics/certs` when it does not manage its own certificates: it runs in a
private mount namespace (`unshare -rm`) where an overlay puts that folder on top of `/etc` without
touching the machine's. The pod webhook only sees namespaces labelled `NAMESPACE_LABEL`, so the rest of
the session's tests never wait on it.
"""

from __future__ import annotations

import base64
import shlex
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import REPO, wait_for

from sftjob_dev.cluster import Cluster, outside_pod_env
from sftjob_dev.ports import free_ports

BUILD = REPO / "hack" / "build-control-plane.sh"
NAMESPACE_LABEL = "sftjob.dev/kueue-e2e"
SYSTEM_NAMESPACE = "kueue-system"
WEBHOOK_NAME = "sftjob-e2e-kueue"
START_TIMEOUT = 90.0
VISIBILITY_OFF = "--feature-gates=VisibilityOnDemand=false"  # its API server would want an APIService


def kueue_dir() -> Path:
    """Kueue's cache folder, building it first when missing (a few minutes the first time)."""
    out = subprocess.run(["bash", str(BUILD), "kueue"], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def webhook_configurations(manifests: str, port: int, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's own webhook configurations, kept to its API group and pods (the only integration it runs
    here), pointed at the loopback server, the pod webhook limited to the labelled namespaces."""
    configs = []
    for doc in yaml.safe_load_all(manifests):
        if not doc or not doc.get("kind", "").endswith("WebhookConfiguration"):
            continue
        hooks = []
        for hook in doc["webhooks"]:
            groups = {g for rule in hook["rules"] for g in rule["apiGroups"]}
            pods = groups == {""} and {r for rule in hook["rules"] for r in rule["resources"]} == {"pods"}
            if groups != {"kueue.x-k8s.io"} and not pods:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            if pods:
                hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
            hooks.append(hook)
        kind = doc["kind"].removesuffix("WebhookConfiguration").lower()
        configs.append({**doc, "metadata": {"name": f"{WEBHOOK_NAME}-{kind}"}, "webhooks": hooks})
    return configs


class Kueue:
    """The Kueue manager as a subprocess, its CRDs and webhooks installed in the cluster."""

    def __init__(self, cluster: Cluster, folder: Path) -> None:
        self.cluster, self.folder = cluster, folder
        self.log = folder / "kueue.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if shutil.which("unshare") is None:
            pytest.fail("the unshare command (util-linux) is needed to run Kueue", pytrace=False)
        home = kueue_dir()
        certs = self.folder / "certs"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.cluster.pki.server_crt, certs / "tls.crt")
        shutil.copy(self.cluster.pki.server_key, certs / "tls.key")
        webhook, health, metrics = free_ports(3)
        config = self.folder / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.kueue.x-k8s.io/v1beta2",
                    "kind": "Configuration",
                    "namespace": SYSTEM_NAMESPACE,
                    "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
                    "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
                    "webhook": {"host": "127.0.0.1", "port": webhook, "certDir": str(certs)},
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
                    "integrations": {"frameworks": ["pod"]},
                }
            )
        )
        self.cluster.kubectl("apply", "--server-side", "-f", str(home / "crds"))
        for crd in sorted(
            p.name.split("_", 1)[1].removesuffix(".yaml") for p in (home / "crds").glob("*.yaml")
        ):
            self.cluster.wait_established(f"{crd}.kueue.x-k8s.io")
        self.cluster.kubectl("create", "namespace", SYSTEM_NAMESPACE, check=False)
        upper, work = self.folder / "etc-upper", self.folder / "etc-work"
        upper.mkdir(exist_ok=True)
        work.mkdir(exist_ok=True)
        script = " && ".join(
            [
                f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc",
                "mkdir -p /etc/kueue/metrics/certs",
                f"cp {certs}/tls.crt {certs}/tls.key /etc/kueue/metrics/certs/",
                "exec " + shlex.join([str(home / "kueue"), f"--config={config}", VISIBILITY_OFF]),
            ]
        )
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                ["unshare", "-rm", "sh", "-c", script],
                env={**outside_pod_env(), **self.cluster.env()},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for("Kueue's readiness endpoint", lambda: self._ready(health), timeout=START_TIMEOUT)
        ca = base64.b64encode(self.cluster.pki.ca_crt.read_bytes()).decode()
        configs = webhook_configurations((home / "webhooks.yaml").read_text(), webhook, ca)
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(configs))

    def _ready(self, port: int) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"Kueue exited with {self.proc.returncode}:\n{self.tail()}", pytrace=False)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        """Webhooks first (a pod created after the manager is gone would fail against them), then it."""
        for kind in ("mutating", "validating"):
            self.cluster.kubectl(
                "delete",
                f"{kind}webhookconfiguration",
                f"{WEBHOOK_NAME}-{kind}",
                "--ignore-not-found",
                check=False,
            )
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
