"""The local trainer runner's handling of API errors, without a cluster: its API clients are fakes that
fail as an API server does (HTTP status) or as a lost connection does (urllib3)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client

from sftjob import constants as c
from sftjob.failures import ExitCode
from sftjob_dev.cluster import Cluster
from sftjob_dev.runner import Runner, Trainer


class FakeApi:
    """Raises `error` from every call, or records the patches it is asked for."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def get_namespaced_custom_object(self, *args: Any) -> Any:
        if self.error:
            raise self.error
        return {"metadata": {"annotations": {}}}  # not a local-trainer job

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        if self.error:
            raise self.error
        self.patches.append((namespace, name, body))


@pytest.fixture
def runner(tmp_path: Path) -> Runner:
    cluster = Cluster(tmp_path)
    cluster.kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    return Runner(cluster)


def running_pod(uid: str = "uid-1") -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": "tiny-0-0", "namespace": "default", "labels": {c.LABEL_JOB: "tiny"}},
        "status": {"phase": "Running"},
    }


def use(runner: Runner, api: FakeApi) -> None:
    runner.core = runner.custom = api  # type: ignore[assignment]


@pytest.mark.parametrize(
    "error",
    [
        client.ApiException(status=503, reason="Service Unavailable"),
        client.ApiException(status=429, reason="Too Many Requests"),
        urllib3.exceptions.ProtocolError("Connection aborted"),
    ],
    ids=["503", "429", "connection-lost"],
)
def test_a_transient_api_error_while_starting_a_trainer_is_retried_not_a_config_error(
    runner: Runner, error: Exception
) -> None:
    api = FakeApi(error)
    use(runner, api)
    runner._on_pod("ADDED", running_pod())
    assert api.patches == [], "the pod must not be failed"
    assert "uid-1" not in runner.done
    not_before, _ = runner.waiting["uid-1"]
    assert not_before > time.monotonic()

    api.error = None  # the API server is back: the next try goes through
    runner.waiting["uid-1"] = (0.0, running_pod())
    runner._retry_waiting()
    assert "uid-1" in runner.done and "uid-1" not in runner.waiting


def test_a_permanent_api_error_while_starting_fails_the_pod_as_a_config_error(runner: Runner) -> None:
    use(runner, FakeApi(client.ApiException(status=403, reason="Forbidden")))
    patched = FakeApi()
    runner.core = patched  # type: ignore[assignment]
    runner._on_pod("ADDED", running_pod())
    (_, _, body), *_ = patched.patches
    assert body["metadata"]["annotations"][c.SIM_EXIT_CODE] == str(int(ExitCode.CONFIG_ERROR))
    assert "uid-1" in runner.done and not runner.waiting


def test_an_outcome_the_api_server_could_not_take_is_annotated_later(runner: Runner) -> None:
    api = FakeApi(urllib3.exceptions.ProtocolError("Connection aborted"))
    use(runner, api)
    runner._steer("default", "tiny-0-0", 0, "completed 60 steps", preempted=False)
    assert api.patches == []

    api.error = None
    runner.unsteered[("default", "tiny-0-0")] = (0.0, runner.unsteered[("default", "tiny-0-0")][1])
    runner._retry_unsteered()
    assert [(ns, pod) for ns, pod, _ in api.patches] == [("default", "tiny-0-0")]
    assert api.patches[0][2]["metadata"]["annotations"][c.SIM_OUTCOME] == "succeed"
    assert not runner.unsteered


def test_a_failing_run_loop_still_stops_every_trainer(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    runner.trainers["uid-1"] = Trainer("default", "tiny", "tiny-0-0", "uid-1", proc, Path("/dev/null"))
    monkeypatch.setattr(runner, "_watch", lambda: None)

    def broken() -> None:
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(runner, "_retry_waiting", broken)
    with pytest.raises(RuntimeError, match="a bug in the loop"):
        runner.run()
    assert proc.poll() is not None, "the trainer must not outlive the runner"
    assert runner.stop_requested.is_set()
