"""A container that cannot start: an image that cannot be had, or a Secret that is missing, fails the job;
a registry's bad minute or the kubelet's slow secret cache is given the kubelet's retries first."""

from __future__ import annotations

import pytest

from sftjob.failures import FailureClass
from sftjob_operator.classify import Outcome
from sftjob_operator.not_started import (
    CONFIG_GIVE_UP_SECONDS,
    CONFIG_MISSING_GIVE_UP_SECONDS,
    IMAGE_PULL_GIVE_UP_SECONDS,
)
from tests.unit.classify_cases import classify, pod, waiting

IMAGE = "ghcr.io/sftjob/trainer:0.9.9"
# What containerd and the registries say when the image cannot be had.
FINAL = [
    f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}": {IMAGE}: not found',
    f"Error response from daemon: manifest for {IMAGE} not found: manifest unknown: manifest unknown",
    'failed to resolve reference "docker.io/org/private:1": pull access denied, repository does not exist or'
    " may require authorization: server message: insufficient_scope: authorization failed",
    "failed to authorize: failed to fetch anonymous token: unexpected status from GET request to"
    " https://registry.example.com/token: 401 Unauthorized",
    "unexpected status from HEAD request to https://registry.example.com/v2/t/manifests/1: 403 Forbidden",
    "reading manifest 0.9.9 in ghcr.io/sftjob/trainer: denied: requested access to the resource is denied",
]
# ... and when it may be had a minute later (the digest holds "404", as digests may).
PASSING = [
    # A registry token that expired while a large layer downloaded: no verdict on the image.
    'failed to pull and unpack image "ghcr.io/sftjob/trainer:0.9.9": failed to copy: httpReadSeeker: failed'
    " open: unexpected status code https://ghcr.io/v2/sftjob/trainer/blobs/sha256:abcd: 401 Unauthorized",
    f'failed to pull and unpack image "{IMAGE}": failed to copy: httpReadSeeker: failed open: unexpected'
    " status code https://ghcr.io/v2/sftjob/trainer/manifests/sha256:9a404e1c: 429 Too Many Requests",
    f'failed to resolve reference "{IMAGE}": Head "https://ghcr.io/v2/": dial tcp 140.82.112.33:443:'
    " i/o timeout",
    f'failed to resolve reference "{IMAGE}": unexpected status: 503 Service Unavailable',
    f'Back-off pulling image "{IMAGE}"',  # a kubelet that does not say why
    f'failed to pull and unpack image "{IMAGE}": failed to extract layer sha256:ab12: mount callback failed'
    " on /var/lib/containerd/tmpmounts/containerd-mount1: permission denied",  # the node's trouble
]


def pulling(reason: str, message: str, seconds: float) -> Outcome:
    """The pod's outcome when its trainer container has waited in ``reason`` since the kubelet took the
    pod ``seconds`` ago."""
    return classify(
        pod("Pending", state=waiting(reason, message), kubelet_took_it_seconds_ago=seconds)
    ).outcome


@pytest.mark.parametrize("message", FINAL)
@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
def test_an_image_that_cannot_be_had_ends_the_attempt_at_once(reason: str, message: str) -> None:
    result = classify(pod("Pending", state=waiting(reason, message), kubelet_took_it_seconds_ago=10))
    assert (result.outcome, result.failure_class) == (Outcome.FAILED, FailureClass.IMAGE_PULL_ERROR)
    assert result.message.startswith(f"{reason}: ")


@pytest.mark.parametrize("reason", ["InvalidImageName", "ErrImageNeverPull"])
def test_an_image_the_kubelet_will_never_pull_ends_the_attempt_at_once(reason: str) -> None:
    result = classify(pod("Pending", state=waiting(reason), kubelet_took_it_seconds_ago=5))
    assert result.failure_class is FailureClass.IMAGE_PULL_ERROR
    assert "ghcr.io/sftjob/trainer:0.1.0" in result.message  # the image, when the kubelet says no more


@pytest.mark.parametrize("message", PASSING)
def test_a_pull_that_may_pass_is_retried_by_the_kubelet_then_by_a_new_attempt_never_failed_for_good(
    message: str,
) -> None:
    assert pulling("ImagePullBackOff", message, 20) is Outcome.RUNNING
    assert pulling("ImagePullBackOff", message, IMAGE_PULL_GIVE_UP_SECONDS - 1) is Outcome.RUNNING
    result = classify(
        pod(
            "Pending",
            state=waiting("ImagePullBackOff", message),
            kubelet_took_it_seconds_ago=IMAGE_PULL_GIVE_UP_SECONDS + 1,
        )
    )
    # Counted and restarted with a backoff: a slow pull that hit one 503 must not end the job.
    assert result.failure_class is FailureClass.NETWORK_ERROR
    assert result.message.endswith("(the pod has not started in 15 min)")


def test_a_single_failed_pull_between_back_offs_never_ends_the_attempt_by_itself() -> None:
    assert pulling("ErrImagePull", PASSING[0], 3 * IMAGE_PULL_GIVE_UP_SECONDS) is Outcome.RUNNING


def test_the_give_up_clock_starts_when_the_kubelet_took_the_pod_not_when_it_waited_for_gpus() -> None:
    long_pending = pod(
        "Pending",
        state=waiting("ImagePullBackOff", PASSING[0]),
        created_seconds_ago=4 * IMAGE_PULL_GIVE_UP_SECONDS,
        kubelet_took_it_seconds_ago=60,
    )
    assert classify(long_pending).outcome is Outcome.RUNNING


def test_without_a_start_time_the_give_up_clock_starts_at_the_pods_creation() -> None:
    young = pod("Pending", state=waiting("ImagePullBackOff", PASSING[1]), created_seconds_ago=60)
    old = pod(
        "Pending",
        state=waiting("ImagePullBackOff", PASSING[1]),
        created_seconds_ago=IMAGE_PULL_GIVE_UP_SECONDS + 1,
    )
    assert classify(young).outcome is Outcome.RUNNING
    assert classify(old).failure_class is FailureClass.NETWORK_ERROR


@pytest.mark.parametrize(
    "message",
    [
        'secret "hf-token" not found',
        "couldn't find key token in Secret default/hf-token",
        'configmap "chat-template" not found',
    ],
)
def test_a_missing_secret_or_key_fails_the_attempt_once_it_has_stayed_missing_a_few_minutes(
    message: str,
) -> None:
    assert pulling("CreateContainerConfigError", message, 30) is Outcome.RUNNING
    result = classify(
        pod(
            "Pending",
            state=waiting("CreateContainerConfigError", message),
            kubelet_took_it_seconds_ago=CONFIG_MISSING_GIVE_UP_SECONDS + 1,
        )
    )
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert message in result.message


def test_a_secret_cache_that_failed_to_sync_is_given_the_longer_give_up_time() -> None:
    message = "failed to sync secret cache: timed out waiting for the condition"
    assert (
        pulling("CreateContainerConfigError", message, CONFIG_MISSING_GIVE_UP_SECONDS + 1) is Outcome.RUNNING
    )
    assert pulling("CreateContainerConfigError", message, CONFIG_GIVE_UP_SECONDS + 1) is Outcome.FAILED


def test_an_init_container_that_cannot_pull_its_image_counts_too() -> None:
    stuck = pod(
        "Pending",
        state=waiting("PodInitializing"),
        init_state=waiting("ErrImagePull", FINAL[0]),
        kubelet_took_it_seconds_ago=10,
    )
    assert classify(stuck).failure_class is FailureClass.IMAGE_PULL_ERROR
