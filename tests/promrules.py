"""The chart's alert rules run by `promtool test rules` over made-up series (one sample a minute), for the
unit tests of the operator's and the training alerts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import alert_groups


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: apt-get install prometheus (hack/test.sh does)")
    return found


def rule(alert: str) -> dict[str, Any]:
    """The rendered rule of ``alert`` (both monitors, default thresholds)."""
    (found,) = [r for g in alert_groups() for r in g["rules"] if r["alert"] == alert]
    return found


def promtool_test(tmp_path: Path, series: dict[str, str], labels: str, checks: list[dict[str, Any]]) -> None:
    """Run ``checks`` (promtool alert_rule_test entries) against the rendered rules fed ``series``, each
    carrying ``labels`` (``a="x",b="y"``) beside any of its own."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": alert_groups()}))
    inputs = [
        {
            "series": f"{name[:-1]},{labels}}}" if name.endswith("}") else f"{name}{{{labels}}}",
            "values": values,
        }
        for name, values in series.items()
    ]
    test = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": checks}],
    }
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def fires(minute: int, alert: str, labels: dict[str, str], description: str) -> dict[str, Any]:
    """``alert`` fires at ``minute`` with ``labels`` (its severity added), saying ``description``."""
    found = rule(alert)
    return {
        "eval_time": f"{minute}m",
        "alertname": alert,
        "exp_alerts": [
            {
                "exp_labels": labels | found["labels"],
                "exp_annotations": found["annotations"] | {"description": description},
            }
        ],
    }


def quiet(minute: int, alert: str) -> dict[str, Any]:
    return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": []}
