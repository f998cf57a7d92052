"""What the chart tells the installer after `helm install` (templates/NOTES.txt) about uninstalling.

`helm template` renders no notes, so each case renders NOTES.txt through `tpl` from a copy of the
chart, with the same values and release as an install.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from helmchart import CHART, KUBE_VERSION, NAMESPACE, RELEASE, helm

PROBE = "templates/notes-probe.yaml"


def notes(tmp_path: Path, *sets: str) -> str:
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / PROBE).write_text('notes: {{ tpl (.Files.Get "files/NOTES.txt") . | toJson }}\n')
    args = ["template", RELEASE, str(chart), "-n", NAMESPACE, "--kube-version", KUBE_VERSION, "-s", PROBE]
    for s in sets:
        args += ["--set", s]
    text: str = yaml.safe_load(helm(*args).stdout)["notes"]
    return " ".join(text.split())


def test_the_default_install_says_uninstalling_keeps_the_crd_and_every_job(tmp_path: Path) -> None:
    text = notes(tmp_path)
    assert "Uninstalling keeps the CRD and every SFTJob." in text
    assert "WARNING" not in text


def test_an_install_without_crd_keep_warns_that_uninstalling_deletes_every_job(tmp_path: Path) -> None:
    text = notes(tmp_path, "crds.keep=false")
    assert "keeps the CRD" not in text
    assert "WARNING: crds.keep=false. Uninstalling this release deletes the SFTJob CRD" in text
    assert "every SFTJob in the cluster and the checkpoint claims they own" in text
    assert "so does a helm upgrade that sets crds.enabled=false" in text


@pytest.mark.parametrize("keep", ["true", "false"])
def test_an_install_without_the_crd_says_uninstalling_leaves_it(tmp_path: Path, keep: str) -> None:
    text = notes(tmp_path, "crds.enabled=false", f"crds.keep={keep}")
    assert "managed outside this release: uninstalling leaves it and every SFTJob" in text
    assert "WARNING" not in text


def test_an_install_without_the_crd_says_to_apply_the_releases_crd_before_each_upgrade(
    tmp_path: Path,
) -> None:
    text = notes(tmp_path, "crds.enabled=false")
    assert "Before each upgrade of the operator, apply the release's CRD" in text
    assert "kubectl apply --server-side -f crds/sftjob.io_sftjobs.yaml" in text
