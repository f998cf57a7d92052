"""Loopback ports for the control plane: free ones chosen at start, or explicit ones checked first.

Every component listens on 127.0.0.1 only. Asking the kernel for port 0 gives a port nobody holds, so
two clusters started side by side (a developer's and the test suite's) never collide.
"""

from __future__ import annotations

import socket
from contextlib import closing

from sftjob_dev.errors import ClusterError

HOST = "127.0.0.1"
PORT_NAMES = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")


def is_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on (host, port) and we may bind it."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_ports(explicit: dict[str, int] | None = None) -> dict[str, int]:
    """One distinct port per component: explicit ones must be free (else ClusterError), others are picked."""
    explicit = dict(explicit or {})
    for name, port in explicit.items():
        if name not in PORT_NAMES:
            raise ClusterError(f"unknown port name {name!r}; known: {', '.join(PORT_NAMES)}")
        if not 1 <= port <= 65535:
            raise ClusterError(f"port for {name} must be between 1 and 65535, got {port}")
        if not is_free(port):
            raise ClusterError(f"port {port} on {HOST} ({name}) is busy; pick another or omit it")
    if len(set(explicit.values())) != len(explicit):
        raise ClusterError(f"explicit ports must differ: {explicit}")
    ports = dict(explicit)
    held: list[socket.socket] = []
    try:
        for name in PORT_NAMES:
            if name in ports:
                continue
            while True:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)  # stays bound until all are chosen, so the kernel hands out distinct ports
                s.bind((HOST, 0))
                port = s.getsockname()[1]
                if port not in explicit.values():
                    break
            ports[name] = port
    finally:
        for s in held:
            s.close()
    return {name: ports[name] for name in PORT_NAMES}


def free_ports(count: int) -> list[int]:
    """Distinct free ports on loopback (all held until all are picked)."""
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()
