"""The operator's defaults for what a spec leaves unset: recorded per job, so upgrades change no job."""

from __future__ import annotations

from dataclasses import replace

from sftjob_operator.defaults import JobDefaults
from sftjob_operator.reconcile import reconcile
from tests.unit.reconcile_cases import (
    CTX,
    SPEC,
    condition,
    observed,
    pod,
    started,
    terminated,
    then,
)

SITE = JobDefaults.of(
    storage_class_name="fast", size="70Gi", max_restarts=0, backoff_seconds=30, on_oom="Fail"
)


def test_unset_claim_and_restart_settings_take_the_operators_defaults_and_show_in_status() -> None:
    actions = reconcile(observed(), replace(CTX, defaults=SITE))
    (claim,) = [m for m in actions.children if m["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == "fast"
    assert claim["spec"]["resources"]["requests"]["storage"] == "70Gi"
    shown = actions.status.to_patch()["effective"]
    assert shown == {
        "checkpoints": {"storageClassName": "fast", "size": "70Gi"},
        "restartPolicy": {"maxRestarts": 0, "backoffSeconds": 30, "onOOM": "Fail"},
    }


def test_settings_the_spec_gives_win_over_the_operators_defaults() -> None:
    spec = {**SPEC, "checkpoints": {"size": "1Ti"}, "restartPolicy": {"maxRestarts": 5, "onOOM": "Retry"}}
    actions = reconcile(observed(spec=spec), replace(CTX, defaults=SITE))
    effective = actions.status.effective
    assert effective is not None
    assert (effective.checkpoints.size, effective.checkpoints.storage_class_name) == ("1Ti", "fast")
    policy = effective.restart_policy
    assert (policy.max_restarts, policy.backoff_seconds, policy.on_oom) == (5, 30, "Retry")


def test_a_default_backoff_above_the_jobs_own_cap_is_capped_there() -> None:
    spec = {**SPEC, "restartPolicy": {"maxBackoffSeconds": 5}}
    effective = reconcile(observed(spec=spec), replace(CTX, defaults=SITE)).status.effective
    assert effective is not None and effective.restart_policy.backoff_seconds == 5


def test_new_operator_defaults_do_not_change_a_job_admitted_under_the_old_ones() -> None:
    obs, first = started()  # the built-in defaults: 100Gi, maxRestarts 3
    failed = pod(phase="Failed", status=terminated(1, "Error", "boom"))
    actions = reconcile(then(obs, first, pods=[failed]), replace(CTX, defaults=SITE))
    assert actions.status.effective == first.status.effective
    assert actions.status.phase == "Restarting", "maxRestarts 3 still applies, not the new default 0"


def test_the_operators_default_restart_budget_decides_the_restart() -> None:
    obs = observed()
    first = reconcile(obs, replace(CTX, defaults=SITE))
    failed = pod(phase="Failed", status=terminated(1, "Error", "boom"))
    actions = reconcile(then(obs, first, pods=[failed]), replace(CTX, defaults=SITE))
    assert actions.status.phase == "Failed" and condition(actions, "Failed") == (
        "True",
        "RestartLimitExceeded",
    )
