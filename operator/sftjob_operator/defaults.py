"""The operator's defaults for the settings a cluster administrator decides for every SFTJob.

The checkpoint claim's ``storageClassName`` and ``size`` and the restart policy's ``maxRestarts``,
``backoffSeconds`` and ``onOOM`` have no default in the CRD schema: a job that leaves them unset gets
the operator's (flags, or the environment the Helm chart's ``defaults`` values set). The values a job
runs with are recorded in ``status.effective`` on its first pass and taken from there afterwards, so
new operator defaults (a chart upgrade) never change a job that already exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from sftjob.attempts import MAX_BACKOFF_LIMIT
from sftjob.job_status import EffectiveCheckpoints, EffectiveRestartPolicy, EffectiveSettings
from sftjob.spec import CheckpointSpec, RestartPolicySpec, SFTJobSpec

# The fields the operator's defaults fill when the spec leaves them unset.
CHECKPOINT_FIELDS = ("storage_class_name", "size")
RESTART_FIELDS = ("max_restarts", "backoff_seconds", "on_oom")
Block = TypeVar("Block", CheckpointSpec, RestartPolicySpec)


@dataclass(frozen=True)
class JobDefaults:
    """Defaults for :data:`CHECKPOINT_FIELDS` and :data:`RESTART_FIELDS`; other fields are ignored.
    Built from the spec models, so a default is validated exactly like the field it stands in for."""

    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    restart_policy: RestartPolicySpec = field(default_factory=RestartPolicySpec)

    @classmethod
    def of(
        cls,
        *,
        storage_class_name: str | None = None,
        size: str | None = None,
        max_restarts: int | None = None,
        backoff_seconds: int | None = None,
        on_oom: str | None = None,
    ) -> JobDefaults:
        """From operator flags (None: the built-in default); raises pydantic's ValidationError. Each field
        is validated alone: a default backoff is no error above the built-in ``maxBackoffSeconds`` (a job
        may allow more, and :meth:`fill` caps it at the job's own)."""
        checkpoints = {"storage_class_name": storage_class_name or None, "size": size}
        restarts = {"max_restarts": max_restarts, "backoff_seconds": backoff_seconds, "on_oom": on_oom}
        given = {k: v for k, v in restarts.items() if v is not None}
        # The widest cap, so that only the bounds of each field are checked here.
        restart_policy = RestartPolicySpec.model_validate({**given, "max_backoff_seconds": MAX_BACKOFF_LIMIT})
        return cls(
            CheckpointSpec.model_validate({k: v for k, v in checkpoints.items() if v is not None}),
            _defaulted(RestartPolicySpec(), {k: getattr(restart_policy, k) for k in given}),
        )

    @classmethod
    def recorded(cls, effective: EffectiveSettings) -> JobDefaults:
        """The defaults a job was admitted with, from its ``status.effective``."""
        cp, rp = effective.checkpoints, effective.restart_policy
        return cls.of(
            storage_class_name=cp.storage_class_name,
            size=cp.size,
            max_restarts=rp.max_restarts,
            backoff_seconds=rp.backoff_seconds,
            on_oom=rp.on_oom,
        )

    def fill(self, spec: SFTJobSpec) -> SFTJobSpec:
        """``spec`` with every defaulted field it leaves unset taken from these defaults. A default
        backoff above the job's own ``maxBackoffSeconds`` is capped there. A filled field still counts
        as unset (``model_fields_set``), so messages call it the default, not the user's."""
        cp, rp = spec.checkpoints, spec.restart_policy
        cp_update = {
            f: getattr(self.checkpoints, f) for f in CHECKPOINT_FIELDS if f not in cp.model_fields_set
        }
        rp_update = {
            f: getattr(self.restart_policy, f) for f in RESTART_FIELDS if f not in rp.model_fields_set
        }
        if "backoff_seconds" in rp_update:
            rp_update["backoff_seconds"] = min(rp_update["backoff_seconds"], rp.max_backoff_seconds)
        return spec.model_copy(
            update={
                "checkpoints": _defaulted(cp, cp_update),
                "restart_policy": _defaulted(rp, rp_update),
            }
        )


def _defaulted(block: Block, defaults: dict[str, Any]) -> Block:
    """``block`` with ``defaults`` filled in and its set fields what the user set (``model_copy`` would
    count the defaults as set)."""
    return type(block).model_construct(_fields_set=set(block.model_fields_set), **{**dict(block), **defaults})


def effective(spec: SFTJobSpec) -> EffectiveSettings:
    """``status.effective`` for a spec :meth:`JobDefaults.fill` has completed."""
    cp, rp = spec.checkpoints, spec.restart_policy
    return EffectiveSettings(
        checkpoints=EffectiveCheckpoints(storage_class_name=cp.storage_class_name, size=cp.size),
        restart_policy=EffectiveRestartPolicy(
            max_restarts=rp.max_restarts, backoff_seconds=rp.backoff_seconds, on_oom=rp.on_oom
        ),
    )
