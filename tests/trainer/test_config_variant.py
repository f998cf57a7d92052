"""The trainer loads the plan rendered for the card it landed on when the operator rendered several."""

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


def test_a_card_without_a_plan_of_its_own_loads_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A40")
    assert configs.config_for_device(str(_configs(tmp_path))) == str(tmp_path / "config.json")


def test_a_cpu_run_loads_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert configs.config_for_device(str(_configs(tmp_path))) == str(tmp_path / "config.json")
