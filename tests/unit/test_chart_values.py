"""The chart's values.schema.json lets through exactly the job defaults the operator starts with.

The chart hands `defaults.*` to the operator as SFTJOB_* variables, which it checks at start with the
spec models; a value the schema accepted and the operator refused would crash it (exit 2,
CrashLoopBackOff) after the install succeeded. Each case renders the chart with the real `helm template`
and runs the operator's own flag parsing on the environment the Deployment would give it.
"""

from __future__ import annotations

import json

import pytest
import yaml
from helmchart import CHART, helm, template_args

from sftjob.kube_names import DNS_SUBDOMAIN, IMAGE, POSITIVE_QUANTITY
from sftjob_operator.main import parse_args

# The chart value behind each variable the operator checks at start.
VARIABLES = {
    "defaults.checkpoints.storageClassName": "SFTJOB_CHECKPOINT_STORAGE_CLASS",
    "defaults.checkpoints.size": "SFTJOB_CHECKPOINT_SIZE",
    "defaults.restartPolicy.maxRestarts": "SFTJOB_MAX_RESTARTS",
    "defaults.restartPolicy.backoffSeconds": "SFTJOB_BACKOFF_SECONDS",
    "defaults.restartPolicy.onOOM": "SFTJOB_ON_OOM",
    "defaults.trainerImage": "SFTJOB_TRAINER_IMAGE",
    "defaults.trainerImageMinDriverMajor": "SFTJOB_IMAGE_MIN_DRIVER_MAJOR",
    "defaults.trainerImagePullSecrets": "SFTJOB_TRAINER_IMAGE_PULL_SECRETS",
    "trainerNetworkPolicy.enabled": "SFTJOB_TRAINER_NETWORK_POLICY",
}
# (--set value, whether the operator starts with it)
CASES = [
    ("defaults.checkpoints.size=1.5Ti", True),
    ("defaults.checkpoints.size=1Ei", False),
    ("defaults.checkpoints.size=2E", False),
    ("defaults.checkpoints.size=0Gi", False),
    ("defaults.checkpoints.storageClassName=", True),
    ("defaults.checkpoints.storageClassName=fast-ssd.example.com", True),
    ("defaults.checkpoints.storageClassName=Fast_SSD", False),
    ("defaults.checkpoints.storageClassName=fast..ssd", False),
    ("defaults.restartPolicy.maxRestarts=100", True),
    ("defaults.restartPolicy.maxRestarts=101", False),
    (
        "defaults.restartPolicy.backoffSeconds=601",
        True,
    ),  # above the built-in maxBackoffSeconds: capped per job
    ("defaults.restartPolicy.backoffSeconds=3600", True),
    ("defaults.restartPolicy.backoffSeconds=3601", False),
    ("defaults.restartPolicy.backoffSeconds=null", False),  # helm drops the key; the template renders ""
    ("defaults.restartPolicy.onOOM=null", False),
    ("defaults.trainerImage=registry.example.com/sftjob/trainer:0.2.0", True),
    ("defaults.trainerImage=my trainer", False),
    ("defaults.trainerImageMinDriverMajor=0", True),
    ("defaults.trainerImageMinDriverMajor=-1", False),
    ("defaults.trainerImagePullSecrets={regcred,mirror.example.com}", True),
    ("defaults.trainerImagePullSecrets=Reg_Cred", False),  # a string, not a list: the schema says so
    ("trainerNetworkPolicy.enabled=false", True),
    ("trainerNetworkPolicy.enabled=maybe", False),
]


def operator_starts(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> bool:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        parse_args([])
    except SystemExit as exit:  # argparse's error: a message and status 2, never a traceback
        assert exit.code == 2
        return False
    return True


@pytest.mark.parametrize(("setting", "starts"), CASES)
def test_the_chart_accepts_a_job_default_exactly_when_the_operator_starts_with_it(
    setting: str, starts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, value = setting.split("=", 1)
    result = helm(*template_args(sets=(setting,)), check=False)
    if starts:
        assert result.returncode == 0, result.stderr
        deployment = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("SFTJOB_")}
        assert operator_starts(env, monkeypatch)
    else:
        assert result.returncode != 0 and path.rsplit(".", 1)[1] in result.stderr, result.stderr
        assert not operator_starts({VARIABLES[path]: "" if value == "null" else value}, monkeypatch)


def test_the_schema_holds_the_spec_models_patterns() -> None:
    defaults = json.loads((CHART / "values.schema.json").read_text())["properties"]["defaults"]["properties"]
    checkpoints = defaults["checkpoints"]["properties"]
    assert checkpoints["size"]["pattern"] == POSITIVE_QUANTITY
    assert checkpoints["storageClassName"]["pattern"] == f"^$|{DNS_SUBDOMAIN}"
    assert defaults["trainerImage"]["pattern"] == IMAGE
    assert defaults["trainerImagePullSecrets"]["items"]["pattern"] == DNS_SUBDOMAIN


def test_trainer_pull_secrets_reach_the_operator_as_the_list_of_names_it_parses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered = helm(*template_args(sets=("defaults.trainerImagePullSecrets={regcred,mirror.example.com}",)))
    deployment = next(d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    variable = VARIABLES["defaults.trainerImagePullSecrets"]
    (value,) = [e["value"] for e in container["env"] if e["name"] == variable]
    monkeypatch.setenv(variable, value)
    assert parse_args([]).trainer_image_pull_secrets == ("regcred", "mirror.example.com")


@pytest.mark.parametrize(("enabled", "isolated"), [("true", True), ("false", False)])
def test_the_network_policy_value_reaches_the_operator_as_the_switch_it_parses(
    enabled: str, isolated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = helm(*template_args(sets=(f"trainerNetworkPolicy.enabled={enabled}",)))
    deployment = next(d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (value,) = [e["value"] for e in container["env"] if e["name"] == "SFTJOB_TRAINER_NETWORK_POLICY"]
    monkeypatch.setenv("SFTJOB_TRAINER_NETWORK_POLICY", value)
    assert parse_args([]).trainer_network_policy is isolated
    assert parse_args(["--no-trainer-network-policy"]).trainer_network_policy is False  # the flag wins
