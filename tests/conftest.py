"""Fixtures shared by every test folder: the real local control plane for tests marked `e2e`.

`cluster` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK once per test
session (in a temporary run folder, on free ports) with the default fake GPU pools, and stops them at
the end. `namespace` gives each test a fresh namespace; `kubectl` runs kubectl as the cluster admin.
When an e2e test fails, the tail of every component's log is attached to its report.

Set SFTJOB_E2E_CLUSTER_DIR to the run folder of a cluster you started yourself
(`python -m sftjob_dev.cluster up --workdir DIR`) to reuse it instead; it is then left running.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Generator, Iterator

import pytest

from sftjob_dev import binaries, processes
from sftjob_dev.cluster import Cluster
from sftjob_dev.components import COMPONENTS
from sftjob_dev.errors import ClusterError

REUSE_ENV = "SFTJOB_E2E_CLUSTER_DIR"
Kubectl = Callable[..., str]

_session_cluster: Cluster | None = None


def _log_tails(cluster: Cluster) -> str:
    return "\n".join(
        f"----- {cluster.log(name)} -----\n{processes.log_tail(cluster.log(name))}" for name in COMPONENTS
    )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running local cluster with 2 fake nodes each of A800, A40 and L40S."""
    global _session_cluster
    reuse = os.environ.get(REUSE_ENV)
    if reuse:
        existing = Cluster(reuse)
        if not existing.is_up():
            pytest.fail(f"{REUSE_ENV}={reuse} but no running cluster is there; start it with `up --workdir`")
        _session_cluster = existing
        yield existing
        return
    folder = binaries.bin_dir()
    if binaries.missing(folder):
        pytest.fail(
            f"control-plane binaries missing from {folder} ({', '.join(binaries.missing(folder))}): "
            "run hack/test.sh (it builds them once) or hack/build-control-plane.sh",
            pytrace=False,
        )
    started = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        try:
            started.up(build=False)
        except ClusterError as e:
            pytest.fail(f"the local cluster did not start: {e}\n{_log_tails(started)}", pytrace=False)
        _session_cluster = started
        yield started
    finally:
        _session_cluster = None
        started.down(quiet=True)


@pytest.fixture
def kubectl(cluster: Cluster) -> Kubectl:
    """`kubectl(*args, input=None, check=True)` -> stdout, as the cluster admin."""

    def run(*args: str, input: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, input=input, check=check).stdout

    return run


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its `default` ServiceAccount ready), deleted after the test."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    processes.wait_until(
        lambda: cluster.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        component="kube-controller-manager (serviceaccount controller)",
        log=cluster.log("kube-controller-manager"),
        timeout=30,
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and _session_cluster is not None and "cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("local cluster logs (tails)", _log_tails(_session_cluster)))
    return report
