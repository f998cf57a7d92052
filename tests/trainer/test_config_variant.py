"""The trainer loads the plan rendered for the card it landed on when the operator rendered several."""

import json
from pathlib import Path

import pytest
import torch

from sftjob_trainer import configs

pytestmark = pytest.mark.trainer


def _configs(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config-L40S.json").write_text("{}")
    return tmp_path / "config.json"


def test_a_pod_on_an_l40s_loads_the_l40s_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA L40S")
    assert configs.config_for_device(str(_configs(tmp_path))) == str(tmp_path / "config-L40S.json")


def test_a_gpu_no_plan_is_for_runs_the_most_preferred_plan_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A40")
    assert configs.config_for_device(str(_configs(tmp_path))) == str(tmp_path / "config.json")
    assert "no plan of the job is for this GPU (NVIDIA A40" in caplog.text


def test_a_product_the_built_in_table_lacks_finds_the_plan_the_operator_mapped_it_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --gpu-products {"A40": ["NVIDIA-A40", "NVIDIA-L40"]}: the L40 is planned as an A40.
    path = _configs(tmp_path)
    (tmp_path / "config-A40.json").write_text("{}")
    (tmp_path / "products.json").write_text(json.dumps({"NVIDIA-L40-SHARED": "A40", "NVIDIA-L40S": "L40S"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA L40")
    assert configs.config_for_device(str(path)) == str(tmp_path / "config-A40.json")


def test_a_cpu_run_loads_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert configs.config_for_device(str(_configs(tmp_path))) == str(tmp_path / "config.json")
