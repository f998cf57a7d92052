"""Certificates and the admin kubeconfig for the local control plane, made with the `openssl` CLI.

One CA signs the API server's serving certificate (also reused by the controller manager and scheduler)
and an admin client certificate in `system:masters`; a separate key pair signs service-account tokens.
ECDSA P-256 keys keep generation fast on a 2-core machine.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from sftjob_dev.errors import ClusterError

CA_SUBJECT = "/CN=sftjob-dev-ca"
ADMIN_SUBJECT = "/O=system:masters/CN=sftjob-dev-admin"
SERVER_SUBJECT = "/CN=kube-apiserver"
SERVER_NAMES = (
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
    "IP:127.0.0.1",
)
DAYS = 365


@dataclass(frozen=True)
class Pki:
    """Paths of every file the components read."""

    folder: Path

    @property
    def ca_crt(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def server_crt(self) -> Path:
        return self.folder / "apiserver.crt"

    @property
    def server_key(self) -> Path:
        return self.folder / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.folder / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.folder / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.folder / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.folder / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise ClusterError(f"openssl {args[0]} failed: {e.stderr.strip()}") from e
    except FileNotFoundError as e:
        if e.filename != "openssl":  # the folder, not the tool
            raise
        raise ClusterError("openssl is not installed: apt-get install openssl") from e


def _new_key(path: Path) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        str(path),
        cwd=path.parent,
    )
    path.chmod(0o600)


def _sign(pki: Pki, key: Path, crt: Path, subject: str, extensions: list[str]) -> None:
    csr = crt.with_suffix(".csr")
    ext = crt.with_suffix(".ext")
    ext.write_text("\n".join(extensions) + "\n")
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr), cwd=pki.folder)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki.ca_crt), "-CAkey", str(pki.ca_key),
        "-CAcreateserial", "-days", str(DAYS), "-extfile", str(ext), "-out", str(crt),
        cwd=pki.folder,
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def create_pki(folder: Path, service_ip: str) -> Pki:
    """Write a fresh CA, serving, admin and service-account key material into `folder`."""
    if shutil.which("openssl") is None:
        raise ClusterError("the openssl command is not on PATH; install it (Debian: apt-get install openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    pki = Pki(folder)
    _new_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", str(pki.ca_key), "-subj", CA_SUBJECT, "-days", str(DAYS * 10),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-out", str(pki.ca_crt),
        cwd=folder,
    )  # fmt: skip
    leaf = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
    _new_key(pki.server_key)
    names = ",".join((*SERVER_NAMES, f"IP:{service_ip}"))
    _sign(
        pki,
        pki.server_key,
        pki.server_crt,
        SERVER_SUBJECT,
        [*leaf, "extendedKeyUsage=serverAuth", f"subjectAltName={names}"],
    )
    _new_key(pki.admin_key)
    _sign(pki, pki.admin_key, pki.admin_crt, ADMIN_SUBJECT, [*leaf, "extendedKeyUsage=clientAuth"])
    _new_key(pki.sa_key)
    _openssl("pkey", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub), cwd=folder)
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, pki: Pki, server: str, token: str | None = None) -> None:
    """A kubeconfig with everything embedded: the admin certificate, or a bearer token when given one."""
    if token:
        user: dict[str, str] = {"token": token}
    else:
        user = {"client-certificate-data": _b64(pki.admin_crt), "client-key-data": _b64(pki.admin_key)}
    name = "sftjob-dev"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority-data": _b64(pki.ca_crt)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "user"}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
