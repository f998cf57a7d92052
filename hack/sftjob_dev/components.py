"""Command lines of the five control-plane processes, in start order. Pure: no I/O.

Flags follow what kwokctl and envtest pass upstream, with three local choices: everything binds to
127.0.0.1, pod IPs (kwok) and service IPs (apiserver) come from the 198.18.0.0/15 benchmark range so no
fake address is ever in a private range, and the in-tree host-path provisioner makes PVCs bind.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sftjob_dev.nodes import KWOK_NODE_ANNOTATION, KWOK_NODE_VALUE
from sftjob_dev.pki import Pki
from sftjob_dev.ports import HOST

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
POD_CIDR = "198.18.0.0/16"
SERVICE_CIDR = "198.19.0.0/16"
SERVICE_IP = "198.19.0.1"  # the `kubernetes` Service; in the serving certificate, never dialled
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
NODE_LEASE_SECONDS = 40
CLOUD_CONTROLLERS = ("service-lb-controller", "node-route-controller", "cloud-node-lifecycle-controller")
CLIENT_QPS = ("--kube-api-qps=200", "--kube-api-burst=400")


def stage_files() -> list[Path]:
    """The KWOK stage files shipped as package data (node and pod lifecycles)."""
    folder = resources.files("sftjob_dev") / "stages"
    return [Path(str(folder / name)) for name in ("node.yaml", "pod.yaml")]


@dataclass(frozen=True)
class Layout:
    """Where a run keeps its state, and which ports it uses."""

    bin_dir: Path
    workdir: Path
    pki: Pki
    kubeconfig: Path
    ports: dict[str, int]

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def url(self, name: str, scheme: str = "https") -> str:
        return f"{scheme}://{HOST}:{self.ports[name]}"


def etcd(lay: Layout) -> list[str]:
    client, peer = lay.url("etcd", "http"), lay.url("etcd-peer", "http")
    return [
        str(lay.binary("etcd")),
        "--name=sftjob-dev",
        f"--data-dir={lay.workdir / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=sftjob-dev={peer}",
        "--unsafe-no-fsync=true",
        "--auto-compaction-retention=1",
        "--quota-backend-bytes=2147483648",
        "--log-level=warn",
    ]


def apiserver(lay: Layout) -> list[str]:
    p = lay.pki
    return [
        str(lay.binary("kube-apiserver")),
        f"--etcd-servers={lay.url('etcd', 'http')}",
        f"--bind-address={HOST}",
        f"--secure-port={lay.ports['apiserver']}",
        f"--tls-cert-file={p.server_crt}",
        f"--tls-private-key-file={p.server_key}",
        f"--client-ca-file={p.ca_crt}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={p.sa_pub}",
        f"--service-account-signing-key-file={p.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        "--profiling=false",
        # Advertise loopback and keep no endpoints for the `kubernetes` Service: nothing runs inside this
        # cluster to dial it, and the host's own address (or its lack of a default route) never matters.
        f"--advertise-address={HOST}",
        "--endpoint-reconciler-type=none",
        # Service accounts' requests (the operator's, the trainers') are audited, so tests can prove that
        # every permission the chart grants is used.
        f"--audit-policy-file={resources.files('sftjob_dev') / 'audit-policy.yaml'}",
        f"--audit-log-path={lay.workdir / 'logs' / 'audit.log'}",
        "--audit-log-format=json",
        "--v=1",
    ]


def controller_manager(lay: Layout) -> list[str]:
    p, kc = lay.pki, str(lay.kubeconfig)
    disabled = ",".join(f"-{name}" for name in CLOUD_CONTROLLERS)
    return [
        str(lay.binary("kube-controller-manager")),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        f"--bind-address={HOST}",
        f"--secure-port={lay.ports['controller-manager']}",
        f"--tls-cert-file={p.server_crt}",
        f"--tls-private-key-file={p.server_key}",
        "--leader-elect=false",
        f"--controllers=*,{disabled}",
        f"--root-ca-file={p.ca_crt}",
        f"--service-account-private-key-file={p.sa_key}",
        f"--cluster-signing-cert-file={p.ca_crt}",
        f"--cluster-signing-key-file={p.ca_key}",
        "--enable-hostpath-provisioner=true",
        *CLIENT_QPS,
        "--v=1",
    ]


def scheduler(lay: Layout) -> list[str]:
    p, kc = lay.pki, str(lay.kubeconfig)
    return [
        str(lay.binary("kube-scheduler")),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        f"--bind-address={HOST}",
        f"--secure-port={lay.ports['scheduler']}",
        f"--tls-cert-file={p.server_crt}",
        f"--tls-private-key-file={p.server_key}",
        "--leader-elect=false",
        *CLIENT_QPS,
        "--v=1",
    ]


def kwok(lay: Layout) -> list[str]:
    return [
        str(lay.binary("kwok")),
        f"--kubeconfig={lay.kubeconfig}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}={KWOK_NODE_VALUE}",
        *(f"--config={path}" for path in stage_files()),
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
        f"--cidr={POD_CIDR}",
        f"--server-address={HOST}:{lay.ports['kwok']}",
        "--v=WARN",
    ]


COMMANDS = {
    "etcd": etcd,
    "kube-apiserver": apiserver,
    "kube-controller-manager": controller_manager,
    "kube-scheduler": scheduler,
    "kwok": kwok,
}
