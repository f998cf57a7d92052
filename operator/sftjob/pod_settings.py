"""The pod settings an SFTJob may add to its trainer pods, held to the rules the API server applies to a pod.

``spec.env`` (never the names the operator sets: a user's value would silently win, as the last
duplicate of a pod's env does, and break progress reporting; nor those torchrun or the NVIDIA container
runtime act on), ``spec.podAnnotations`` keys (none the operator writes or that set a security profile)
and ``spec.tolerations`` (keys and values checked as label keys and values, the operator/value/effect
combinations a pod accepts), so a job the spec admits never has its pods refused for them.
"""

from __future__ import annotations

import re
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

# SFTJOB_: the operator's contract with the trainer; PET_: torchrun takes every flag the operator leaves
# unset from PET_<FLAG> (PET_NNODES, PET_MAX_RESTARTS...), so these would change how the trainer is run;
# TORCHELASTIC_: torchrun's own settings for its workers (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE changes the
# [default<rank>]: prefix the launcher tells the ranks' last words apart by; TORCHELASTIC_ERROR_FILE).
RESERVED_ENV_PREFIXES = ("SFTJOB_", "PET_", "TORCHELASTIC_")
# Set by the operator for the trainer (its pod's identity, writable HOME and caches) and by the NVIDIA
# device plugin and runtime (the GPUs the pod was given): a user's value would silently win (the last
# duplicate of a pod's env wins), break reporting, or hand the trainer GPUs the scheduler gave another pod.
# The NVIDIA container toolkit also mounts host devices for NVIDIA_MOFED (/dev/infiniband), NVIDIA_NVSWITCH,
# NVIDIA_GDS, NVIDIA_GDRCOPY, NVIDIA_IMEX_CHANNELS (/dev/nvidia-caps-imex-channels/channelN: the GPU memory
# other workloads export over multi-node NVLink) and the MIG ones into a container whose environment names
# them. (The job's image may still set any of them in its own ENV: spec.image is the user's choice.)
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
        "NVIDIA_MOFED",
        "NVIDIA_NVSWITCH",
        "NVIDIA_GDS",
        "NVIDIA_GDRCOPY",
        "NVIDIA_IMEX_CHANNELS",
        "NVIDIA_MIG_CONFIG_DEVICES",
        "NVIDIA_MIG_MONITOR_DEVICES",
    }
)


RESERVED_ANNOTATION = r"^([^/]*[.])?sftjob[.]io/"  # the progress and checkpoint reports on the pods
# The pod group the operator declares with spec.queueName (Kueue's topology annotations stay the user's).
KUEUE_ANNOTATION = (
    r"^kueue[.]x-k8s[.]io/(pod-group-|retriable-in-group$|role-hash$|pod-suspending-parent$|queue-name$)"
)
# The AppArmor and seccomp annotations (container.apparmor.security.beta.kubernetes.io/<container>,
# [container.]seccomp.security.alpha.kubernetes.io/...): the API server turns them into the pod's security
# profile (an `unconfined` trainer), or Pod Security refuses every pod of the job. The pods' profile is the
# operator's (RuntimeDefault).
SECURITY_PROFILE_ANNOTATION = r"^([^/]*[.])?(apparmor|seccomp)[.]security[.](alpha|beta)[.]kubernetes[.]io/"


def pod_annotation_key(key: str) -> str:
    """``key`` of ``spec.podAnnotations`` when the pods may carry it; raises ValueError otherwise."""
    if not valid_label_key(key):
        raise ValueError(f"key {key!r} is not an annotation key: {LABEL_KEY_RULE}")
    if re.match(RESERVED_ANNOTATION, key):
        raise ValueError(f"key {key!r}: annotations under sftjob.io are the operator's and trainer's")
    if re.match(KUEUE_ANNOTATION, key):
        raise ValueError(f"key {key!r}: Kueue's pod-group annotations are the operator's: set spec.queueName")
    if re.match(SECURITY_PROFILE_ANNOTATION, key):
        raise ValueError(
            f"key {key!r}: AppArmor and seccomp annotations would set the pods' security profile,"
            " which is the operator's (RuntimeDefault)"
        )
    return key


class EnvVar(SpecModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ENV_NAME)]
    value: Annotated[str, StringConstraints(max_length=4096)] = ""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name in (".", "..") or name.startswith(".."):  # the API server's own rule (a path's parent)
            raise ValueError(
                f"spec.env: {name!r} is no environment variable name: '.', '..' or starting '..'"
            )
        if name.startswith(RESERVED_ENV_PREFIXES) or name in RESERVED_ENV_NAMES:
            raise ValueError(
                f"spec.env: {name} is reserved: set by the operator, or read by torchrun or the NVIDIA"
                f" container runtime (reserved are {', '.join(sorted(RESERVED_ENV_NAMES))}"
                f" and names starting with {', '.join(RESERVED_ENV_PREFIXES)})"
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
