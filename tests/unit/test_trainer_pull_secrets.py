"""Trainer images from a private registry: the operator's --trainer-image-pull-secrets reach every
trainer pod through the job's trainer ServiceAccount (Kubernetes adds an account's imagePullSecrets to
each pod that runs as it and names none itself)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sftjob.config import JobRef
from sftjob_operator import builders
from sftjob_operator.main import parse_args
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import CTX, observed

JOB = JobRef(namespace="team", name="llama", uid="uid-1", attempt=1)
ENV = "SFTJOB_TRAINER_IMAGE_PULL_SECRETS"


def test_the_trainer_account_carries_the_operators_pull_secrets_and_its_pods_inherit_them() -> None:
    ctx = replace(CTX, trainer_image_pull_secrets=("regcred", "mirror.example.com"))
    children = reconcile(observed(), ctx).children
    (account,) = [m for m in children if m["kind"] == "ServiceAccount"]
    assert account["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.example.com"}]
    for pod in (m for m in children if m["kind"] == "Pod"):
        assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert "imagePullSecrets" not in pod["spec"]  # a pod naming its own would not get the account's


def test_without_pull_secrets_the_trainer_account_names_none() -> None:
    assert "imagePullSecrets" not in builders.service_account(JOB)
    (account,) = [m for m in reconcile(observed(), CTX).children if m["kind"] == "ServiceAccount"]
    assert "imagePullSecrets" not in account


def test_pull_secrets_come_from_the_environment_as_a_comma_separated_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, " regcred, mirror.example.com ,")
    assert parse_args([]).trainer_image_pull_secrets == ("regcred", "mirror.example.com")
    assert parse_args(["--trainer-image-pull-secrets=other"]).trainer_image_pull_secrets == ("other",)
    monkeypatch.setenv(ENV, "")
    assert parse_args([]).trainer_image_pull_secrets == ()


def test_a_pull_secret_that_is_no_secret_name_stops_the_operator_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--trainer-image-pull-secrets=regcred,Reg_Cred"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--trainer-image-pull-secrets" in err and "'Reg_Cred'" in err and "'regcred'" not in err
