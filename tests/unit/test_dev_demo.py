"""The demo's verdict after its watch, its stale processes and its way out of an error, without a cluster:
the demo job's status is given, the operator and runner are real sleeping processes recorded in demo.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sftjob_dev import demo as demo_module
from sftjob_dev import processes
from sftjob_dev.cluster import Cluster, outside_pod_env
from sftjob_dev.demo import COMPONENTS, DEMO_JOB, NAMESPACE, Demo
from sftjob_dev.errors import ClusterError

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    """A demo whose cluster has a CA (no process of its own) and whose operator and runner run."""
    cluster = Cluster(tmp_path / "cluster")
    cluster.pki.ca_crt.parent.mkdir(parents=True)
    cluster.pki.ca_crt.write_text("this cluster's CA\n")
    demo = Demo(cluster)
    demo.local.mkdir(parents=True)
    for name in COMPONENTS:
        demo._record(name, processes.start(SLEEPER, tmp_path / f"{name}.log"))
    yield demo
    for pid in demo._state()["pids"].values():
        processes.stop(pid, Path(sys.executable), grace=2)


def given_status(monkeypatch: pytest.MonkeyPatch, status: dict[str, Any]) -> None:
    monkeypatch.setattr(Demo, "_job_status", lambda self: status)


def running_condition(reason: str, message: str = "") -> dict[str, Any]:
    return {"conditions": [{"type": "Running", "status": "False", "reason": reason, "message": message}]}


def test_a_failed_demo_job_fails_the_demo_naming_its_phase_reason_and_the_logs(
    demo: Demo, monkeypatch: pytest.MonkeyPatch
) -> None:
    given_status(
        monkeypatch,
        {"phase": "Failed", **running_condition("DataError", "[exit 13] no rows"), "progress": {}},
    )
    with pytest.raises(ClusterError) as failed:
        demo._verdict(90)
    message = str(failed.value)
    assert f"{DEMO_JOB} is Failed (DataError: [exit 13] no rows" in message
    assert str(demo.cluster.log("operator")) in message and str(demo.cluster.log("runner")) in message


def test_a_dead_operator_fails_the_demo_even_when_the_job_succeeded(
    demo: Demo, monkeypatch: pytest.MonkeyPatch
) -> None:
    given_status(monkeypatch, {"phase": "Succeeded", "progress": {"summary": "1000/1000"}})
    processes.stop(demo._state()["pids"]["operator"], Path(sys.executable), grace=2)
    with pytest.raises(ClusterError, match=r"the operator stopped running .*the end of each log says why"):
        demo._verdict(90)


def test_a_job_still_training_when_the_watch_ends_is_reported_as_such_not_as_a_success(
    demo: Demo, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    given_status(
        monkeypatch,
        {"phase": "Running", **running_condition("Training"), "progress": {"summary": "420/1000"}},
    )
    demo._verdict(90)
    out = capsys.readouterr().out
    assert f"{DEMO_JOB} is still Running (420/1000 steps, Training) after the 90s watch" in out
    assert "Succeeded" not in out


def test_a_job_the_operator_never_handled_fails_the_demo(demo: Demo, monkeypatch: pytest.MonkeyPatch) -> None:
    given_status(monkeypatch, {})
    with pytest.raises(ClusterError, match=f"{DEMO_JOB} is without a phase"):
        demo._verdict(90)


def test_the_hints_name_the_summary_only_once_the_trainer_wrote_it(
    demo: Demo, capsys: pytest.CaptureFixture[str]
) -> None:
    demo._hints()
    assert "summary.json" not in capsys.readouterr().out
    summary = demo.local / NAMESPACE / DEMO_JOB / "checkpoints" / "final" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text("{}")
    demo._hints()
    assert f"cat {summary}" in capsys.readouterr().out


def test_an_operator_and_runner_of_an_earlier_cluster_are_stopped_not_reused(demo: Demo) -> None:
    pids = dict(demo._state()["pids"])
    demo._stop_stale()  # the same cluster: kept
    assert all(demo._running(name) for name in COMPONENTS)

    demo.cluster.pki.ca_crt.write_text("a new cluster's CA\n")  # `down`, then `up` again
    demo._stop_stale()
    assert not any(processes.is_running(pid) for pid in pids.values())
    assert not demo.state_file.exists()


def test_processes_recorded_before_the_cluster_was_recorded_count_as_stale(demo: Demo) -> None:
    state = demo._state()
    del state["cluster"]  # a demo.json written by an older demo
    demo.state_file.write_text(json.dumps(state))
    demo._stop_stale()
    assert not any(demo._running(name) for name in COMPONENTS)


def test_demo_json_records_the_fingerprint_of_the_clusters_ca(demo: Demo) -> None:
    expected = hashlib.sha256(b"this cluster's CA\n").hexdigest()
    assert demo._state()["cluster"] == expected


def test_a_failed_up_says_how_to_stop_what_did_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(self: Demo, watch_seconds: float) -> None:
        raise ClusterError("operator exited during start-up")

    monkeypatch.setattr(Demo, "up", fail)
    assert demo_module.main(["up", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: operator exited during start-up\n")
    assert f"`hack/demo.sh down --workdir {tmp_path}` stops all of it" in err


def test_local_processes_never_see_the_api_server_of_a_pod_they_run_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    in_pod = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
        "KUBERNETES_PORT_443_TCP_ADDR": "10.96.0.1",
    }
    for key, value in in_pod.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KUBECONFIG", "/tmp/local-cluster/kubeconfig")
    env = outside_pod_env()
    assert not set(in_pod) & set(env)
    assert env["KUBECONFIG"] == "/tmp/local-cluster/kubeconfig"
