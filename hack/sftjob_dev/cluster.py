"""The local Kubernetes control plane: etcd, kube-apiserver, controller manager, scheduler and KWOK.

`Cluster` is the Python API the test fixtures, the demo and the benchmarks use; `python -m
sftjob_dev.cluster up|down|status|env|nodes` is the same thing from a shell (see `sftjob_dev.cli`).
A run keeps all of its state in one folder: `state.json` (ports, PIDs, binaries), `pki/`, `etcd/`,
`kubeconfig` and `logs/<component>.log`. `down` stops the recorded PIDs and removes the state but keeps
the logs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from sftjob_dev import binaries, components, processes
from sftjob_dev.components import COMMANDS, COMPONENTS, Layout
from sftjob_dev.errors import ClusterError
from sftjob_dev.nodes import DEFAULT_POOLS, FAKE_NODE_LABEL, FAKE_NODE_LABEL_VALUE, nodes_list, validate_pools
from sftjob_dev.pki import Pki, create_pki, write_kubeconfig
from sftjob_dev.ports import choose_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKDIR_ENV = "SFTJOB_CLUSTER_DIR"
DEFAULT_WORKDIR = REPO_ROOT / ".run" / "cluster"
START_TIMEOUT = 120.0
KUBECTL_TIMEOUT = 120.0
HOSTPATH_PV_ROOT = "/tmp/hostpath_pv/"  # hard-coded in the in-tree host-path provisioner
NOT_READY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
# For processes that keep running with the cluster (the demo's operator, the runner's trainers): the API
# server sets no --service-account-max-token-expiration, so a token lasts the full year asked for.
LONG_LIVED_TOKEN = "8760h"
# What a pod gets to find its own cluster's API server (the `kubernetes` Service).
IN_CLUSTER_ENV_PREFIXES = ("KUBERNETES_SERVICE_", "KUBERNETES_PORT")
DEFAULT_STORAGE_CLASS = {
    "apiVersion": "storage.k8s.io/v1",
    "kind": "StorageClass",
    "metadata": {"name": "standard", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
    "provisioner": "kubernetes.io/host-path",
    "reclaimPolicy": "Delete",
    "volumeBindingMode": "Immediate",
}


def outside_pod_env() -> dict[str, str]:
    """This process's environment without the in-cluster variables: run inside a pod (a devcontainer,
    a CI runner pod), the Kubernetes client and kopf would otherwise prefer the pod's service account
    and act on that cluster instead of the local one their KUBECONFIG names."""
    return {k: v for k, v in os.environ.items() if not k.startswith(IN_CLUSTER_ENV_PREFIXES)}


class Cluster:
    """One local control plane, identified by its run folder."""

    def __init__(self, workdir: Path | str | None = None) -> None:
        chosen = workdir or os.environ.get(WORKDIR_ENV) or DEFAULT_WORKDIR
        self.workdir = Path(chosen).resolve()

    # --- where things are -------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def logs_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def state_file(self) -> Path:
        return self.workdir / "state.json"

    def log(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"

    def _state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return state

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @property
    def pki(self) -> Pki:
        """The cluster's certificates; `pki.ca_crt` verifies the API server."""
        return Pki(self.workdir / "pki")

    @property
    def bin_dir(self) -> Path:
        recorded = self._state().get("bin_dir")
        return Path(recorded) if recorded else binaries.bin_dir()

    @property
    def api_url(self) -> str | None:
        url: str | None = self._state().get("api_url")
        return url

    def env(self) -> dict[str, str]:
        """KUBECONFIG and a PATH that finds kubectl, helm and friends first."""
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    # --- state of the processes -------------------------------------------------------------------
    def status(self) -> dict[str, bool]:
        """Each component and whether its recorded process still runs."""
        state = self._state()
        pids: dict[str, int] = state.get("pids", {})
        bin_dir = Path(state.get("bin_dir", "."))
        return {
            name: name in pids and processes.is_running(pids[name], bin_dir / name) for name in COMPONENTS
        }

    def is_up(self) -> bool:
        return all(self.status().values())

    # --- kubectl ----------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = KUBECTL_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster as the admin; raises ClusterError on failure when `check`."""
        argv = [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args]
        try:
            result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"kubectl {' '.join(args)} timed out after {timeout:.0f}s") from e
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def wait_established(self, crd: str, timeout: float = 60.0) -> None:
        """Wait until CustomResourceDefinition `crd` serves its kind. (`kubectl wait --for=condition=...`
        fails at once, instead of waiting, while a just-created CRD has no conditions yet.)"""
        query = '{.status.conditions[?(@.type=="Established")].status}'
        deadline = time.monotonic() + timeout
        while self.kubectl("get", "crd", crd, "-o", f"jsonpath={query}", check=False).stdout != "True":
            if time.monotonic() > deadline:
                raise ClusterError(f"CustomResourceDefinition {crd} not Established after {timeout:.0f}s")
            time.sleep(0.2)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, duration: str = "2h") -> Path:
        """Write a kubeconfig that acts as ServiceAccount `namespace/name` (a real token, so RBAC applies)."""
        if self.api_url is None:
            raise ClusterError(f"no running cluster in {self.workdir}")
        token = self.kubectl(
            "-n", namespace, "create", "token", name, f"--duration={duration}"
        ).stdout.strip()
        write_kubeconfig(path, self.pki, self.api_url, token=token)
        return path

    # --- lifecycle --------------------------------------------------------------------------------
    def up(
        self,
        pools: Mapping[str, int] | None = None,
        *,
        ports: Mapping[str, int] | None = None,
        build: bool = True,
        timeout: float = START_TIMEOUT,
    ) -> None:
        """Start every component, wait until each is healthy, then add the fake GPU node pools."""
        pools = validate_pools(DEFAULT_POOLS if pools is None else pools)
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self._up(pools, dict(ports or {}), build, timeout)

    def _up(self, pools: dict[str, int], ports: dict[str, int], build: bool, timeout: float) -> None:
        running = self.status()
        if all(running.values()):
            print(f"cluster already up at {self.api_url} (workdir {self.workdir})", flush=True)
            return
        if any(running.values()):
            up = ", ".join(name for name, ok in running.items() if ok)
            raise ClusterError(f"a partly running cluster is in {self.workdir} ({up}); run `down` first")
        if ports:
            choose_ports(ports)  # a busy or bad explicit port fails now, not after a first build of minutes
        bin_dir = binaries.ensure_built() if build else binaries.bin_dir()
        if not build and binaries.missing(bin_dir):
            raise ClusterError(f"binaries missing from {bin_dir}: {', '.join(binaries.missing(bin_dir))}")
        chosen = choose_ports(ports)  # after the build, so nothing else has taken them meanwhile
        started = time.monotonic()
        try:
            self._start(bin_dir, chosen, timeout)
            self.kubectl("apply", "-f", "-", input=json.dumps(DEFAULT_STORAGE_CLASS))
            processes.wait_until(
                lambda: (
                    self.kubectl("-n", "default", "get", "serviceaccount", "default", check=False).returncode
                    == 0
                ),
                component="kube-controller-manager (serviceaccount controller)",
                log=self.log("kube-controller-manager"),
                timeout=timeout,
            )
            self.add_nodes(pools, timeout=timeout)
        except BaseException:
            self._down(quiet=True)
            raise
        print(
            f"cluster up at {self.api_url} in {time.monotonic() - started:.1f}s (workdir {self.workdir})",
            flush=True,
        )

    def _start(self, bin_dir: Path, ports: dict[str, int], timeout: float) -> None:
        for stale in ("etcd", "pki", "kwok", "logs"):
            shutil.rmtree(self.workdir / stale, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = create_pki(self.workdir / "pki", components.SERVICE_IP)
        layout = Layout(bin_dir, self.workdir, pki, self.kubeconfig, ports)
        api_url = layout.url("apiserver")
        write_kubeconfig(self.kubeconfig, pki, api_url)
        state: dict[str, Any] = {"bin_dir": str(bin_dir), "api_url": api_url, "ports": ports, "pids": {}}
        self._save(state)
        checks = {
            "etcd": lambda: b'"health":"true"' in _get(f"{layout.url('etcd', 'http')}/health"),
            "kube-apiserver": lambda: _get(f"{api_url}/readyz", pki, client_cert=True) == b"ok",
            "kube-controller-manager": lambda: (
                _get(f"{layout.url('controller-manager')}/healthz", pki) == b"ok"
            ),
            "kube-scheduler": lambda: _get(f"{layout.url('scheduler')}/healthz", pki) == b"ok",
            "kwok": lambda: _get(f"{layout.url('kwok', 'http')}/healthz") == b"ok",
        }
        # kwok would otherwise also load ~/.kwok/kwok.yaml, a developer's own kwokctl settings
        env = {**os.environ, "KWOK_WORKDIR": str(self.workdir / "kwok")}
        for name in COMPONENTS:
            print(f"starting {name}", flush=True)
            pid = processes.start(COMMANDS[name](layout), self.log(name), env)
            state["pids"][name] = pid
            self._save(state)
            processes.wait_until(checks[name], component=name, log=self.log(name), timeout=timeout, pid=pid)

    def down(self, *, quiet: bool = False) -> list[str]:
        """Stop every recorded process (TERM, then KILL) and remove the run state; keep the logs."""
        if not self.workdir.is_dir():
            return self._down(quiet=quiet)
        with self._locked():
            return self._down(quiet=quiet)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the run folder's lock so two `up`/`down` calls never interleave on one cluster."""
        with (self.workdir / ".lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ClusterError(f"another up/down is already running on {self.workdir}") from None
            yield

    def _down(self, *, quiet: bool) -> list[str]:
        state = self._state()
        pids: dict[str, int] = state.get("pids", {})
        bin_dir = Path(state.get("bin_dir", "."))
        volumes = self._hostpath_volumes() if self.status().get("kube-apiserver") else []
        stopped = [
            name
            for name in reversed(COMPONENTS)
            if name in pids and processes.stop(pids[name], bin_dir / name)
        ]
        for path in volumes:
            shutil.rmtree(path, ignore_errors=True)
        for leftover in ("etcd", "pki", "kwok"):
            shutil.rmtree(self.workdir / leftover, ignore_errors=True)
        for leftover_file in (self.state_file, self.kubeconfig):
            leftover_file.unlink(missing_ok=True)
        if not quiet:
            print(f"stopped: {', '.join(stopped) or 'nothing was running'}; logs kept in {self.logs_dir}")
        return stopped

    def _hostpath_volumes(self) -> list[str]:
        """Folders the host-path provisioner made for this cluster's PVs (removed by `down`)."""
        try:
            pvs = self.kubectl_json("get", "persistentvolumes")["items"]
        except (ClusterError, ValueError, KeyError):
            return []
        paths = (pv.get("spec", {}).get("hostPath", {}).get("path", "") for pv in pvs)
        return [p for p in paths if p.startswith(HOSTPATH_PV_ROOT) and ".." not in p]

    # --- nodes ------------------------------------------------------------------------------------
    def node_names(self) -> list[str]:
        items = self.kubectl_json("get", "nodes", "-l", f"{FAKE_NODE_LABEL}={FAKE_NODE_LABEL_VALUE}")["items"]
        return [item["metadata"]["name"] for item in items]

    def add_nodes(self, pools: Mapping[str, int], *, timeout: float = START_TIMEOUT) -> list[str]:
        """Create fake GPU nodes in one batch and wait until they are Ready and schedulable."""
        manifest = nodes_list(pools, self.node_names())
        names = [item["metadata"]["name"] for item in manifest["items"]]
        if not names:
            return []
        self.kubectl(
            "create", "-f", "-", input=json.dumps(manifest), timeout=max(KUBECTL_TIMEOUT, len(names))
        )
        processes.wait_until(
            lambda: self._schedulable(names),
            component=f"kwok ({len(names)} new nodes Ready and untainted)",
            log=self.log("kwok"),
            timeout=timeout,
        )
        return names

    def _schedulable(self, names: list[str]) -> bool:
        ok = set()
        selector = f"{FAKE_NODE_LABEL}={FAKE_NODE_LABEL_VALUE}"
        for node in self.kubectl_json("get", "nodes", "-l", selector)["items"]:
            conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            taints = {t["key"] for t in node.get("spec", {}).get("taints", [])}
            if conditions.get("Ready") == "True" and not taints.intersection(NOT_READY_TAINTS):
                ok.add(node["metadata"]["name"])
        return ok.issuperset(names)


def _get(url: str, pki: Pki | None = None, *, client_cert: bool = False, timeout: float = 2.0) -> bytes:
    """GET a health endpoint; TLS is verified against the cluster's CA."""
    context = None
    if url.startswith("https"):
        assert pki is not None
        context = ssl.create_default_context(cafile=str(pki.ca_crt))
        if client_cert:
            context.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
    # No proxy handler: a loopback health check must never go through $http_proxy.
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(url, timeout=timeout) as response:
            body: bytes = response.read()
    except OSError:  # urllib's URLError and HTTPError are OSErrors: not ready yet
        return b""
    return body


if __name__ == "__main__":
    from sftjob_dev.cli import main

    sys.exit(main())
