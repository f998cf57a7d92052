"""A trainer pod may carry containers the operator did not put there (a sidecar a mutating webhook injects:
istio-proxy, a log shipper, a Vault agent): only the trainer container says whether and how an attempt ended,
and a sidecar that ends neither ends the attempt nor lends it its cause."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sftjob.failures import ExitCode, FailureClass
from sftjob_operator.classify import Outcome, finished_at, running_since
from tests.unit.classify_cases import NOW, classify, exited, pod, running, ts


def with_sidecar(p: dict[str, Any], name: str, state: dict[str, Any]) -> dict[str, Any]:
    """``p`` with a sidecar container; the kubelet lists container statuses by name, often before ours."""
    p["status"]["containerStatuses"].insert(0, {"name": name, "image": f"{name}:1", "state": state})
    return p


def test_a_sidecar_that_exits_0_while_the_trainer_runs_is_no_success() -> None:
    result = classify(with_sidecar(pod("Running", state=running(600)), "agent", exited(0, "Completed")))
    assert result.outcome is Outcome.RUNNING


def test_a_sidecar_oomkilled_under_its_own_limit_neither_ends_the_attempt_nor_is_the_trainers_host_oom() -> (
    None
):
    result = classify(
        with_sidecar(pod("Running", state=running(600)), "istio-proxy", exited(137, "OOMKilled"))
    )
    assert result.outcome is Outcome.RUNNING


def test_the_trainers_own_failure_decides_though_a_sidecar_ended_first() -> None:
    oom = pod("Failed", state=exited(1, message="[exit 15] CUDA out of memory: Tried to allocate 2.00 GiB"))
    result = classify(with_sidecar(oom, "fluent-bit", exited(143)))
    assert (result.failure_class, result.exit_code) == (FailureClass.CUDA_OOM, ExitCode.CUDA_OOM)


def test_a_trainer_that_finished_succeeds_though_a_failed_sidecar_made_the_pod_failed() -> None:
    done = pod("Failed", state=exited(0, "Completed", message="completed 200 steps, final loss 1.2345"))
    result = classify(with_sidecar(done, "istio-proxy", exited(137, "OOMKilled")))
    assert (result.outcome, result.exit_code) == (Outcome.SUCCEEDED, 0)


def test_a_trainer_that_finished_succeeds_while_a_sidecar_still_runs() -> None:
    done = with_sidecar(pod("Running", state=exited(0, "Completed")), "istio-proxy", running(600))
    assert classify(done).outcome is Outcome.SUCCEEDED


def test_when_the_trainer_started_and_ended_is_read_from_the_trainer_container() -> None:
    started = with_sidecar(pod("Running", state=running(60)), "agent", running(600))
    assert running_since(started["status"]) == NOW - timedelta(seconds=60)
    waiting = with_sidecar(
        pod("Pending", state={"waiting": {"reason": "PodInitializing"}}), "agent", running(60)
    )
    assert running_since(waiting["status"]) is None
    sidecar_ended = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": ts(900)}}
    ended = with_sidecar(pod("Failed", state=exited(1)), "agent", sidecar_ended)
    assert finished_at(ended) == NOW - timedelta(seconds=1)


def test_a_sidecar_that_cannot_pull_its_image_does_not_fail_a_trainer_that_runs() -> None:
    pulling = {
        "waiting": {"reason": "ErrImagePull", "message": "pull access denied, repository does not exist"}
    }
    result = classify(with_sidecar(pod("Running", state=running(1800)), "log-shipper", pulling))
    assert result.outcome is Outcome.RUNNING


def test_an_init_container_that_cannot_pull_its_image_still_fails_the_pod_it_holds_back() -> None:
    held = pod("Pending", state={"waiting": {"reason": "PodInitializing"}})
    pulling = {
        "waiting": {"reason": "ErrImagePull", "message": "pull access denied, repository does not exist"}
    }
    held["status"]["initContainerStatuses"] = [{"name": "vault-init", "image": "vault:1", "state": pulling}]
    assert classify(held).failure_class is FailureClass.IMAGE_PULL_ERROR
