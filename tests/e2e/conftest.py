"""Operator fixtures for the e2e tests: the SFTJob CRD installed, the operator running as a subprocess.

The operator runs once per session (`python -m sftjob_operator --standalone` with the cluster's admin
kubeconfig, on free ports) and can be killed and restarted by a test (the chaos test does). Every test
that uses `jobs` gets the root conftest's fresh namespace; its SFTJobs are deleted and their pods waited
for afterwards, so the next test finds the fake GPUs free. The operator's log is attached to failures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import CRD, Jobs, Operator

from sftjob_dev.cluster import Cluster


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/sftjobs.sftjob.io", "--timeout=30s")


@pytest.fixture(scope="session")
def operator(cluster: Cluster, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def jobs(cluster: Cluster, operator: Operator, namespace: str) -> Iterator[Jobs]:
    j = Jobs(cluster, namespace)
    yield j
    j.delete_all()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    op = item.funcargs.get("operator") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(op, Operator):
        report.sections.append(("operator log (tail)", op.tail()))
    return report
