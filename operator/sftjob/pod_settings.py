"""The pod settings an SFTJob may add to its trainer pods, held to the rules the API server applies to a pod.

``spec.env`` (never the names the operator sets: a user's value would silently win, as the last
duplicate of a pod's env does, and break progress reporting) and ``spec.tolerations`` (keys and values
checked as label keys and values, the operator/value/effect combinations a pod accepts), so a job the
spec admits never has its pods refused for them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from sftjob.kube_names import (
    ENV_NAME,
    LABEL_KEY_RULE,
    LABEL_VALUE_RULE,
    SpecModel,
    valid_label_key,
    valid_label_value,
)

RESERVED_ENV_PREFIX = "SFTJOB_"
# Set by the operator for the trainer (its pod's identity, writable HOME and caches) and by the NVIDIA
# device plugin and runtime (the GPUs the pod was given): a user's value would silently win (the last
# duplicate of a pod's env wins), break reporting, or hand the trainer GPUs the scheduler gave another pod.
RESERVED_ENV_NAMES = frozenset(
    {
        "POD_NAME",
        "POD_NAMESPACE",
        "NODE_NAME",
        "HOME",
        "HF_HOME",
        "TRITON_CACHE_DIR",
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "NVIDIA_DRIVER_CAPABILITIES",
    }
)


class EnvVar(SpecModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ENV_NAME)]
    value: Annotated[str, StringConstraints(max_length=4096)] = ""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(RESERVED_ENV_PREFIX) or name in RESERVED_ENV_NAMES:
            raise ValueError(
                f"spec.env: {name} is set by the operator (reserved: {', '.join(sorted(RESERVED_ENV_NAMES))}"
                f" and names starting with {RESERVED_ENV_PREFIX})"
            )
        return name


class Toleration(SpecModel):
    """One extra toleration of the trainer pods, held to the rules the API server applies to a pod's."""

    key: Annotated[str, StringConstraints(max_length=317)] | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: Annotated[str, StringConstraints(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0, le=31_536_000)

    @field_validator("key")
    @classmethod
    def _key_is_a_label_key(cls, key: str | None) -> str | None:
        if key and not valid_label_key(key):
            raise ValueError(f"key {key!r} is not a label key: {LABEL_KEY_RULE}")
        return key

    @field_validator("value")
    @classmethod
    def _value_is_a_label_value(cls, value: str | None) -> str | None:
        if value is not None and not valid_label_value(value):
            raise ValueError(f"value {value!r} is not a label value: {LABEL_VALUE_RULE}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise ValueError("operator must be Exists when key is empty (a toleration of every taint)")
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds needs effect NoExecute")
        return self
