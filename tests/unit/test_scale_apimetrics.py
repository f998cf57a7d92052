"""The operator-scale benchmark's request accounting: what counts against the jobs, what is background."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def apimetrics(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("scale.apimetrics")


def test_the_fake_kubelets_heartbeats_are_background_and_everything_else_counts(
    apimetrics: ModuleType,
) -> None:
    counts = Counter(
        {
            "PUT leases.coordination.k8s.io": 50,
            "PATCH nodes/status": 20,
            "PATCH nodes": 5,
            "GET nodes": 3,  # a read: someone asked, so it counts
            "POST pods": 10,
            "PATCH sftjobs.sftjob.io/status": 20,
        }
    )
    jobs, background = apimetrics.split(counts)
    assert jobs == Counter({"GET nodes": 3, "POST pods": 10, "PATCH sftjobs.sftjob.io/status": 20})
    assert sum(background.values()) == 75


def test_metric_lines_become_verb_and_resource_keys(apimetrics: ModuleType) -> None:
    text = "\n".join(
        [
            'apiserver_request_total{code="201",group="",resource="pods",verb="POST",version="v1"} 4',
            'apiserver_request_total{code="200",group="sftjob.io",resource="sftjobs",subresource="status",'
            'verb="PATCH",version="v1alpha1"} 2',
            'apiserver_request_total{code="200",resource="",subresource="/healthz",verb="GET"} 9',
        ]
    )
    assert apimetrics.parse(text) == Counter(
        {"POST pods": 4, "PATCH sftjobs.sftjob.io/status": 2, "GET /healthz": 9}
    )
