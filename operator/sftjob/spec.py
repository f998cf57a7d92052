"""The SFTJob API's ``spec`` as typed models: what the user asks for (the status: :mod:`sftjob.job_status`).

The CRD schema (``crds/sftjob.io_sftjobs.yaml``) rejects bad input at admission; these models are the
second line of defence the operator parses every spec with, and the vocabulary the reconcile speaks.
Blocks the trainer contract already defines are reused as they are: ``spec.training`` is
:class:`~sftjob.config.TrainingOverrides`, ``spec.lora`` is :class:`~sftjob.config.LoraSettings`,
``spec.evaluation`` is :class:`~sftjob.config.EvaluationSettings`, ``spec.model.architecture`` is
:class:`~sftjob.architectures.Architecture` (its ``family`` narrowed to the CRD's enum),
``spec.restartPolicy`` is :class:`~sftjob.attempts.RestartPolicy`, volumes are :mod:`sftjob.volumes`'s,
``spec.network`` :mod:`sftjob.network`'s, ``spec.env`` and ``spec.tolerations``
:mod:`sftjob.pod_settings`'s. Node labels, names and sizes are checked as the API server checks them in
the pods and the claim (:mod:`sftjob.kube_names`), so an admitted job's children are not refused for
them; cross-field rules are :mod:`sftjob.spec_rules`'s. A unit test keeps the CRD and these models on the
same field names, enums, patterns and numeric bounds.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from sftjob.architectures import Architecture, ModelFamily
from sftjob.attempts import OnOOM, RestartPolicy
from sftjob.config import (
    DEFAULT_MAX_BAD_ROW_FRACTION,
    DatasetFormat,
    EvaluationSettings,
    LoraSettings,
    Method,
    TrainingOverrides,
)
from sftjob.constants import CHECKPOINT_VOLUME_NAMES
from sftjob.kube_names import (
    IMAGE,
    LABEL_KEY_RULE,
    LABEL_VALUE_RULE,
    ObjectName,
    Quantity,
    QueueName,
    SecretKeyRef,
    SpecModel,
    valid_label_key,
    valid_label_value,
)
from sftjob.model_shapes import parameters_problem
from sftjob.network import NetworkSpec, inter_node_gbs
from sftjob.pod_settings import EnvVar, Toleration, pod_annotation_key
from sftjob.tracking import TrackingSpec
from sftjob.volumes import VolumeSource, relative_path, writable

if TYPE_CHECKING:
    from sftjob.planner import PlanRequest

GpuType = Literal["A800", "A40", "L40S"]
GpuChoice = Literal["A800", "A40", "L40S", "Any"]
# The order `Any` prefers: the biggest card first, so a job that fits anywhere gets the most headroom.
ANY_ORDER: tuple[GpuType, ...] = ("A800", "L40S", "A40")

# Job names end up in pod names (`<job>-<attempt>-<rank>`, a 63-character DNS label) and a Service name.
MAX_JOB_NAME = 40
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A Hugging Face hub id: [owner/]name, letters, digits, '-', '_' and '.', neither part starting or ending
# with '-' or '.'. The CRD's CEL rule holds the same regex.
HUB_ID = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
HUB_ID_RULE = "a Hugging Face hub id: [owner/]name of letters, digits, '-', '_' and '.', e.g. org/model-7B"
# Below this a memory quantity is a unit left out (`64` is 64 bytes), not a trainer pod's memory.
MIN_POD_MEMORY = "1Gi"
DEFAULT_CHECKPOINT_MINUTES = 30
DEFAULT_CHECKPOINT_SIZE = "100Gi"

RelativePath = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


def _hub_id(name: str | None, field: str) -> str | None:
    if name is not None and not re.fullmatch(HUB_ID, name):
        raise ValueError(f"{field} {name!r} is not {HUB_ID_RULE}")
    return name


# Architecture's fields the CRD does not expose (the planner's label for a shape; a mixture of experts,
# read from a model's config.json), and what a spec writes instead.
NOT_IN_THE_API = {
    "name": "the model is spec.model.name",
    "experts": "size a mixture-of-experts model with spec.model.parameters (all experts counted)",
}


class ArchitectureSpec(Architecture):
    """``spec.model.architecture``: the shape, held to the CRD's bounds (far beyond any released model;
    the planner's own guesses from a parameter count are not), with ``family`` one the planner knows, and
    heads that split evenly (as every transformers attention implementation requires)."""

    layers: int = Field(ge=1, le=1024)
    hidden_size: int = Field(ge=1, le=131072)
    heads: int = Field(ge=1, le=1024)
    kv_heads: int = Field(ge=1, le=1024)
    intermediate_size: int = Field(ge=1, le=1048576)
    vocab_size: int = Field(ge=1, le=4194304)
    head_dim: int | None = Field(default=None, ge=1, le=4096)
    sliding_window: int | None = Field(default=None, ge=1, le=1048576)
    family: ModelFamily | None = None

    @model_validator(mode="before")
    @classmethod
    def _only_the_apis_fields(cls, data: Any) -> Any:
        for key, why in NOT_IN_THE_API.items():
            if isinstance(data, dict) and data.get(key) is not None:
                raise ValueError(f"spec.model.architecture has no field {key}: {why}")
        return data

    @model_validator(mode="after")
    def _heads_split_evenly(self) -> ArchitectureSpec:
        if self.heads % self.kv_heads:
            raise ValueError(
                f"spec.model.architecture.kvHeads {self.kv_heads} must divide heads {self.heads}"
            )
        if self.head_dim is None and self.hidden_size % self.heads:
            raise ValueError(
                f"spec.model.architecture.heads {self.heads} must divide hiddenSize {self.hidden_size}"
                " (or set headDim)"
            )
        return self


class ModelSpec(SpecModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    path: RelativePath | None = None
    volume: VolumeSource | None = None
    revision: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    token_secret_ref: SecretKeyRef | None = None
    trust_remote_code: bool = False
    parameters: int | None = Field(default=None, ge=1_000_000, le=10_000_000_000_000)
    architecture: ArchitectureSpec | None = None

    @field_validator("path")
    @classmethod
    def _path_isrelative_path(cls, path: str | None) -> str | None:
        return relative_path(path, "spec.model.path")

    @field_validator("name")
    @classmethod
    def _name_is_a_hub_id(cls, name: str | None) -> str | None:
        return _hub_id(name, "spec.model.name")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name is None) == (self.path is None):
            raise ValueError("spec.model needs exactly one of name (a hub id) or path (inside volume)")
        if (self.path is None) != (self.volume is None):
            raise ValueError("spec.model.path and spec.model.volume go together")
        if self.revision is not None and self.name is None:
            raise ValueError("spec.model.revision pins a hub model: it needs spec.model.name, not path")
        if problem := parameters_problem(self.architecture, self.parameters):  # CEL lacks the formula
            raise ValueError(problem)
        return self


class DatasetSpec(SpecModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    path: RelativePath | None = None
    volume: VolumeSource | None = None
    revision: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None
    format: DatasetFormat = "auto"
    split: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "train"
    max_seq_length: int = Field(default=2048, ge=16, le=131072)
    max_bad_row_fraction: float = Field(default=DEFAULT_MAX_BAD_ROW_FRACTION, ge=0.0, le=1.0)

    @field_validator("path")
    @classmethod
    def _path_isrelative_path(cls, path: str | None) -> str | None:
        return relative_path(path, "spec.dataset.path")

    @field_validator("name")
    @classmethod
    def _name_is_a_hub_id(cls, name: str | None) -> str | None:
        return _hub_id(name, "spec.dataset.name")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if (self.name is None) == (self.path is None):
            raise ValueError("spec.dataset needs exactly one of name (a hub id) or path (inside volume)")
        if (self.path is None) != (self.volume is None):
            raise ValueError("spec.dataset.path and spec.dataset.volume go together")
        if self.revision is not None and self.name is None:
            raise ValueError("spec.dataset.revision pins a hub dataset: it needs spec.dataset.name, not path")
        return self


class GpuSpec(SpecModel):
    """``type`` names one GPU type (or Any); ``types`` is an ordered preference list that replaces it.
    (A structural CRD schema cannot hold "a string or a list" in one field.)"""

    type: GpuChoice = "Any"
    types: Annotated[list[GpuType], Field(min_length=1, max_length=3)] | None = None
    count: int = Field(default=1, ge=1, le=8)
    nodes: int = Field(default=1, ge=1, le=16)

    @model_validator(mode="after")
    def _type_or_types(self) -> GpuSpec:
        if self.types is not None:
            if self.type != "Any":
                raise ValueError(
                    "spec.gpu.types (an ordered preference list) replaces spec.gpu.type; leave type unset"
                )
            if len(set(self.types)) != len(self.types):
                raise ValueError("spec.gpu.types lists a GPU type twice")
        return self

    def candidates(self) -> list[GpuType]:
        """The concrete GPU types the job may run on, most preferred first."""
        if self.types is not None:
            return list(self.types)
        return list(ANY_ORDER) if self.type == "Any" else [self.type]

    def describe(self) -> str:
        """``8xA800``, ``2x8xA800`` or ``1xL40S|A40`` for the printer column before the job lands."""
        kinds = "|".join(self.types) if self.types else self.type
        per_node = f"{self.count}x{kinds}"
        return per_node if self.nodes == 1 else f"{self.nodes}x{per_node}"


class CheckpointSpec(SpecModel):
    volume: VolumeSource | None = None
    # The operator's defaults (sftjob_operator.defaults) fill storageClassName and size when unset.
    storage_class_name: ObjectName | None = None
    size: Quantity = DEFAULT_CHECKPOINT_SIZE
    every_steps: int | None = Field(default=None, ge=1, le=1_000_000)
    every_minutes: int | None = Field(default=None, ge=1, le=1440)
    keep: int = Field(default=3, ge=1, le=100)
    keep_on_delete: bool = False

    @model_validator(mode="after")
    def _one_schedule(self) -> CheckpointSpec:
        if self.every_steps is not None and self.every_minutes is not None:
            raise ValueError("spec.checkpoints takes everySteps or everyMinutes, not both")
        writable(self.volume, "spec.checkpoints.volume")
        return self


class OutputSpec(SpecModel):
    volume: VolumeSource | None = None
    path: RelativePath = "final"
    merge_adapter: bool = False  # beside a LoRA or QLoRA adapter, its base with it merged in (merged/)

    @field_validator("path")
    @classmethod
    def _path_isrelative_path(cls, path: str) -> str:
        return relative_path(path, "spec.output.path") or path

    @model_validator(mode="after")
    def _volume_is_writable(self) -> OutputSpec:
        writable(self.volume, "spec.output.volume")
        if self.volume is None and re.match(CHECKPOINT_VOLUME_NAMES, self.path):
            raise ValueError(
                f"spec.output.path {self.path!r} is the checkpoint volume's own (its root, checkpoint-N,"
                " .tmp-*, .bad-*, .cache, OWNER): choose another folder, or give output a volume"
            )
        return self


class ResourceSpec(SpecModel):
    cpu: Quantity | None = None
    memory: Quantity | None = None

    @field_validator("memory")
    @classmethod
    def _memory_has_a_unit(cls, memory: str | None) -> str | None:
        from sftjob.storage import quantity_value  # storage plans from this module's spec

        if memory is not None and quantity_value(memory) < quantity_value(MIN_POD_MEMORY):
            raise ValueError(
                f"spec.resources.memory {memory} is below {MIN_POD_MEMORY}, too little for a trainer pod"
                " (a quantity without a unit is bytes: 64Gi, not 64)"
            )
        return memory


class RestartPolicySpec(RestartPolicy):
    """``spec.restartPolicy``: :class:`~sftjob.attempts.RestartPolicy` with the acronym spelled ``onOOM``
    on the wire, as Kubernetes spells acronyms (``podIP``, ``OOMKilled``)."""

    on_oom: OnOOM = Field(default="Replan", alias="onOOM")


class SFTJobSpec(SpecModel):
    model: ModelSpec
    dataset: DatasetSpec
    evaluation: EvaluationSettings | None = None
    method: Method = "lora"
    lora: LoraSettings = LoraSettings()
    gpu: GpuSpec = GpuSpec()
    training: TrainingOverrides = TrainingOverrides()
    checkpoints: CheckpointSpec = CheckpointSpec()
    output: OutputSpec = OutputSpec()
    restart_policy: RestartPolicySpec = RestartPolicySpec()
    image: Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=IMAGE)] | None = None
    resources: ResourceSpec = ResourceSpec()
    env: Annotated[list[EnvVar], Field(max_length=64)] = Field(default_factory=list)
    tolerations: Annotated[list[Toleration], Field(max_length=32)] = Field(default_factory=list)
    node_selector: Annotated[
        dict[str, Annotated[str, StringConstraints(max_length=63)]], Field(max_length=32)
    ] = Field(default_factory=dict)
    pod_annotations: Annotated[
        dict[str, Annotated[str, StringConstraints(max_length=4096)]], Field(max_length=32)
    ] = Field(default_factory=dict)
    network: NetworkSpec = NetworkSpec()
    priority_class_name: ObjectName | None = None
    queue_name: QueueName | None = None  # a Kueue LocalQueue of the job's namespace (pods.py)
    suspend: bool = False
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    tracking: TrackingSpec = TrackingSpec()

    @field_validator("node_selector")
    @classmethod
    def _node_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not valid_label_key(key):
                raise ValueError(f"key {key!r} is not a label key: {LABEL_KEY_RULE}")
            if not valid_label_value(value):
                raise ValueError(f"value {value!r} of {key!r} is not a label value: {LABEL_VALUE_RULE}")
        return labels

    @field_validator("pod_annotations")
    @classmethod
    def _annotation_keys(cls, annotations: dict[str, str]) -> dict[str, str]:
        for key in annotations:
            pod_annotation_key(key)
        return annotations

    @model_validator(mode="after")
    def _qlora_is_single_gpu(self) -> SFTJobSpec:
        if self.method == "qlora" and (self.gpu.count != 1 or self.gpu.nodes != 1):
            raise ValueError(
                "spec.method qlora runs on exactly one GPU: set spec.gpu.count 1 and spec.gpu.nodes 1"
            )
        return self

    @model_validator(mode="after")
    def _merge_needs_an_adapter(self) -> SFTJobSpec:
        if self.output.merge_adapter and self.method == "full":
            raise ValueError(
                "spec.output.mergeAdapter merges a LoRA or QLoRA adapter into its base: spec.method full"
                " writes the whole model already; remove mergeAdapter"
            )
        return self

    @model_validator(mode="after")
    def _multi_node_checkpoints_are_shared(self) -> SFTJobSpec:
        volume = self.checkpoints.volume
        if self.gpu.nodes > 1 and volume is not None and volume.host_path is not None:
            raise ValueError(
                "spec.checkpoints.volume.hostPath: a multi-node job (spec.gpu.nodes > 1) needs a checkpoint"
                " volume every node shares (a ReadWriteMany persistentVolumeClaim or nfs); each node's"
                " hostPath holds only its own ranks' files, so no checkpoint could be resumed"
            )
        return self

    @model_validator(mode="after")
    def _evaluation_is_held_out(self) -> SFTJobSpec:
        if self.evaluation is not None and self.evaluation.split == self.dataset.split:
            raise ValueError(
                f"spec.evaluation.split {self.dataset.split!r} is the split the job trains on"
                " (spec.dataset.split): name another split, or hold out a fraction of it"
            )
        return self

    @property
    def checkpoint_every_minutes(self) -> int | None:
        """Time-based checkpoints every 30 minutes unless the spec chose steps or minutes."""
        if self.checkpoints.every_steps is not None:
            return None
        return self.checkpoints.every_minutes or DEFAULT_CHECKPOINT_MINUTES


def valid_job_name(name: str) -> bool:
    """Whether a job name leaves room for the children's names (the CRD enforces the same rule)."""
    return len(name) <= MAX_JOB_NAME and re.match(JOB_NAME_PATTERN, name) is not None


def to_plan_request(spec: SFTJobSpec, gpus_per_node: int, nodes: int) -> PlanRequest:
    """The planner's question for this job on ``nodes`` x ``gpus_per_node`` GPUs of one type.

    Raises ValueError when the model's size is unknown (no built-in family matches and the spec gives
    neither ``parameters`` nor ``architecture``).
    """
    from sftjob.model_shapes import resolve_architecture
    from sftjob.planner import PlanRequest

    architecture = resolve_architecture(
        spec.model.name or spec.model.path or "",
        spec.model.architecture,
        spec.model.parameters,
    )
    # Without packing the trainer pads every row to maxSeqLength: a packingLength (refused with packing
    # false at admission since; a job admitted before keeps running) must not shorten the planned rows.
    packing = spec.training.packing_length if spec.training.packing is not False else None
    return PlanRequest(
        architecture=architecture,
        method=spec.method,
        lora=spec.lora,
        max_seq_length=spec.dataset.max_seq_length,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        overrides=spec.training,
        packing_length=(None if packing is None else min(packing, spec.dataset.max_seq_length)),
        inter_node_gbs=inter_node_gbs(spec.network),
        rdma=spec.network.rdma is not None,
        remote_code=spec.model.trust_remote_code,
        merge_adapter=spec.output.merge_adapter,
    )
