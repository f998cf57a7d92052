"""The operator's defaults fill what a spec leaves unset, and what they fill still reads as unset: the
messages then speak of the default, never of a field the user did not write."""

from __future__ import annotations

from typing import Any

import pytest

from sftjob.spec import SFTJobSpec
from sftjob_operator.conditions import Reason
from sftjob_operator.defaults import JobDefaults, effective
from sftjob_operator.planning import PlanningError, check_checkpoint_volume, plan_candidates
from sftjob_operator.scheduling import default_products

FULL_8B = {
    "model": {"name": "meta-llama/Llama-3.1-8B"},
    "dataset": {"name": "org/chats"},
    "method": "full",
    "gpu": {"type": "A800", "count": 8},
}


def volume_problem(spec: dict[str, Any], defaults: JobDefaults) -> str:
    filled = defaults.fill(SFTJobSpec.model_validate(spec))
    with pytest.raises(PlanningError) as raised:
        check_checkpoint_volume(filled, plan_candidates(filled, default_products()))
    assert raised.value.reason == Reason.CHECKPOINT_VOLUME_TOO_SMALL
    return raised.value.message


def test_a_claim_too_small_at_the_operators_default_size_is_called_the_default_not_the_users() -> None:
    message = volume_problem(FULL_8B, JobDefaults.of(size="100Gi"))
    assert (
        message.startswith("the default checkpoint claim (100Gi")
        and "spec.checkpoints.size 100Gi" not in message
    )


def test_a_claim_too_small_at_the_users_own_size_names_the_users_field() -> None:
    message = volume_problem({**FULL_8B, "checkpoints": {"size": "100Gi"}}, JobDefaults.of(size="2Ti"))
    assert message.startswith("spec.checkpoints.size 100Gi cannot hold the run")


def test_filled_defaults_are_in_force_but_still_count_as_unset() -> None:
    spec = SFTJobSpec.model_validate({**FULL_8B, "restartPolicy": {"maxBackoffSeconds": 5}})
    filled = JobDefaults.of(storage_class_name="fast", size="7Gi", max_restarts=9, backoff_seconds=60).fill(
        spec
    )
    cp, rp = filled.checkpoints, filled.restart_policy
    assert (cp.storage_class_name, cp.size, rp.max_restarts, rp.backoff_seconds) == ("fast", "7Gi", 9, 5)
    assert cp.model_fields_set == set() and rp.model_fields_set == {"max_backoff_seconds"}


def test_a_default_backoff_above_the_built_in_cap_is_capped_by_each_jobs_own_cap() -> None:
    defaults = JobDefaults.of(backoff_seconds=900)
    assert defaults.fill(SFTJobSpec.model_validate(FULL_8B)).restart_policy.backoff_seconds == 600
    allowing = SFTJobSpec.model_validate({**FULL_8B, "restartPolicy": {"maxBackoffSeconds": 3600}})
    assert defaults.fill(allowing).restart_policy.backoff_seconds == 900


def test_a_job_admitted_with_a_backoff_above_the_built_in_cap_keeps_reading_its_recorded_defaults() -> None:
    spec = SFTJobSpec.model_validate(
        {**FULL_8B, "restartPolicy": {"backoffSeconds": 1000, "maxBackoffSeconds": 3600}}
    )
    recorded = JobDefaults.recorded(effective(JobDefaults.of().fill(spec)))
    assert recorded.fill(spec).restart_policy.backoff_seconds == 1000
