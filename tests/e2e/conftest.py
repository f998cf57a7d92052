"""Operator fixtures for the e2e tests: the SFTJob CRD installed, the operator running as a subprocess.

The operator runs once per session (`python -m sftjob_operator --standalone` with the cluster's admin
kubeconfig, on free ports) and can be killed and restarted by a test (the chaos test does). Every test
that uses `jobs` gets the root conftest's fresh namespace; its SFTJobs are deleted and their pods waited
for afterwards, so the next test finds the fake GPUs free. The operator's log is attached to failures.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import CRD, Jobs, Operator

from sftjob_dev.cluster import Cluster


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.wait_established("sftjobs.sftjob.io")


@pytest.fixture(scope="session")
def operator(cluster: Cluster, crd: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture(scope="module")
def runner(cluster: Cluster, operator: Operator, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The local trainer runner (real CPU trainers behind the pods of `sftjob.dev/local-trainer` jobs) as
    a subprocess, with the demo's tiny model and dataset in place; yields its log, which names each
    trainer's PID."""
    from sftjob_dev.demo import prepare_assets  # builds a model: needs the trainer's extra (torch)

    prepare_assets(cluster.workdir)
    log = tmp_path_factory.mktemp("runner") / "runner.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sftjob_dev.runner", "--workdir", str(cluster.workdir)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    yield log
    proc.terminate()
    proc.wait(timeout=90)


@pytest.fixture
def jobs(cluster: Cluster, operator: Operator, namespace: str) -> Iterator[Jobs]:
    j = Jobs(cluster, namespace)
    yield j
    j.delete_all()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """An e2e test marked ``trainer`` (a real trainer behind its pods) fails when torch does not import:
    hack/test.sh always installs the trainer extra, so a missing or broken torch is a broken environment,
    not a reason to skip. Deselect them with ``-m "not trainer"`` where torch is not meant to be."""
    if item.get_closest_marker("trainer") is None:
        return
    try:
        import torch  # noqa: F401
    except Exception as err:  # a broken install raises more than ImportError (OSError from its libraries)
        failure = repr(err)
    else:
        return
    pytest.fail(
        f"{item.name} runs the real trainer and needs torch, which does not import ({failure}): install"
        " the trainer extra (hack/test.sh does), or deselect these tests with -m 'not trainer'",
        pytrace=False,
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    op = item.funcargs.get("operator") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(op, Operator):
        report.sections.append(("operator log (tail)", op.tail()))
    return report
