"""The operator reads the SFTJob CRD's schema revision on the real API server when it starts: silent when
the cluster has its own revision, an error naming the fix when an older CRD would drop the fields it
writes (a CRD applied by hand and never updated)."""

from __future__ import annotations

import pytest
from operator_harness import Operator

from sftjob import constants as c
from sftjob_dev.cluster import Cluster

pytestmark = pytest.mark.e2e

CRD = f"{c.PLURAL}.{c.API_GROUP}"


def test_an_operator_started_against_its_own_crd_says_nothing_of_it(operator: Operator) -> None:
    # The session operator's log holds every start of the session (the next test's, warning, among them):
    # only what a start made here says counts.
    before = len(operator.log.read_text(errors="replace"))
    operator.stop()
    operator.start()
    said = operator.log.read_text(errors="replace")[before:]
    assert said.strip(), "the restarted operator logged nothing"
    assert "schema revision" not in said, said[-2000:]


def test_an_operator_started_against_an_older_crd_says_so_and_how_to_update_it(
    cluster: Cluster, operator: Operator
) -> None:
    older = f"{c.ANNOTATION_SCHEMA_REVISION}={c.CRD_SCHEMA_REVISION - 1}"
    current = f"{c.ANNOTATION_SCHEMA_REVISION}={c.CRD_SCHEMA_REVISION}"
    before = len(operator.log.read_text(errors="replace"))
    cluster.kubectl("annotate", "--overwrite", "crd", CRD, older)
    try:
        operator.stop()
        operator.start()
        said = operator.log.read_text(errors="replace")[before:]
        assert f"schema revision {c.CRD_SCHEMA_REVISION - 1}" in said and "kubectl apply" in said, said[
            -2000:
        ]
    finally:
        cluster.kubectl("annotate", "--overwrite", "crd", CRD, current)
        operator.stop()
        operator.start()
