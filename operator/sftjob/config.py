"""The trainer configuration: the one contract between the operator and the trainer.

The operator renders it from the SFTJob spec and the planner's plan into a ConfigMap mounted at
``/etc/sftjob/config.json`` (path in ``$SFTJOB_CONFIG``); the trainer loads it with
:func:`TrainerConfig.load` and prints it at start. Environment the operator sets beside it
(``PYTORCH_CUDA_ALLOC_CONF``, ``NCCL_*``, ``POD_NAME``) comes from the plan, not from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.alias_generators import to_camel

# The version of this contract. Bump it (and TrainerConfig.schema_version's Literal) on every change to what
# the operator writes or the trainer reads: a trainer image pinned in spec.image checks it before anything
# else and says which image it needs, rather than failing on the first field it does not know.
SCHEMA_VERSION: Final = 6
Method = Literal["lora", "qlora", "full"]
# No fp8: the trainer has no FP8 training path yet (torchao float8 would be it), so nothing plans for it.
Precision = Literal["bf16", "fp16", "fp32"]
DatasetFormat = Literal["auto", "messages", "alpaca", "text"]
# The weights the output is written from: the last step's, or the checkpoint with the lowest eval loss.
FinalModel = Literal["Last", "Best"]
Attention = Literal["sdpa", "flash_attention_2", "eager"]
Optimizer = Literal["adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit"]
# hsdp: FSDP inside each node, the nodes' shards replicated (FSDP2 on a nodes x GPUs-per-node mesh).
Sharding = Literal["none", "ddp", "fsdp", "hsdp"]
# Malformed dataset rows the trainer skips (and counts) before it fails the job with DataError.
DEFAULT_MAX_BAD_ROW_FRACTION = 0.01
# Held-out examples an evaluation reads at most (a bounded pause at every checkpoint).
DEFAULT_EVAL_MAX_SAMPLES = 1000


class _Strict(BaseModel):
    """Unknown keys are errors. Fields read as snake_case or camelCase, so the SFTJob spec (camelCase)
    can reuse these models as its own blocks instead of restating them."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class JobRef(_Strict):
    namespace: str = "default"
    name: str = "local"
    uid: str = ""
    attempt: int = Field(default=0, ge=0)


class ModelSource(_Strict):
    """A hub id (``name``) or a local folder (``path``, already resolved inside the pod)."""

    name: str | None = None
    path: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.name is None) == (self.path is None):
            raise ValueError("model needs exactly one of name (hub id) or path")
        return self


class DatasetSource(_Strict):
    """A hub dataset (``name``) or a JSONL/Parquet file or folder (``path``)."""

    name: str | None = None
    path: str | None = None
    revision: str | None = None  # a hub dataset's branch, tag or commit
    format: DatasetFormat = "auto"
    split: str = "train"
    max_seq_length: int = Field(default=2048, ge=16)
    # Malformed rows are skipped and counted; more than this fraction fails the job with DataError.
    max_bad_row_fraction: float = Field(default=DEFAULT_MAX_BAD_ROW_FRACTION, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSource:
        if (self.name is None) == (self.path is None):
            raise ValueError("dataset needs exactly one of name (hub id) or path")
        return self


class EarlyStopping(_Strict):
    """Training ends (successfully) once ``patience`` evaluations in a row have not lowered the lowest
    evaluation loss so far by more than ``min_delta``."""

    patience: int = Field(ge=1, le=1000)
    min_delta: float = Field(default=0.0, ge=0, le=100)


class EvaluationSettings(_Strict):
    """Examples kept out of training whose mean loss per target token the trainer reports: at every
    checkpoint, every ``every_steps`` steps when set, and after the last step. They come from another
    ``split`` of the dataset or are a ``fraction`` of the training rows, held out the same way on every
    rank and attempt; at most ``max_samples`` of them.

    ``final_model`` Best writes the output from the checkpoint whose evaluation loss is the lowest (or
    from the final weights when theirs is lower still) and keeps that checkpoint out of the rotation.
    """

    split: str | None = Field(default=None, min_length=1, max_length=64)
    fraction: float | None = Field(default=None, gt=0, le=0.5)
    max_samples: int = Field(default=DEFAULT_EVAL_MAX_SAMPLES, ge=1, le=100_000)
    every_steps: int | None = Field(default=None, ge=1, le=1_000_000)
    final_model: FinalModel = "Last"
    early_stopping: EarlyStopping | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EvaluationSettings:
        if (self.split is None) == (self.fraction is None):
            raise ValueError(
                "evaluation needs exactly one of split (another split of the dataset) or fraction"
                " (a share of the training rows held out)"
            )
        return self


ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=128)]
ALL_LINEAR = "all-linear"  # peft's shorthand for every linear layer but the output head


class LoraSettings(_Strict):
    """``spec.lora`` and the trainer's adapter settings; the list bounds are the CRD's.

    peft expands only the string ``all-linear`` to every linear layer; in a list it is a module name no
    model has. The CRD takes a list, so ``[all-linear]`` is read as the string, and ``all-linear`` beside
    other names is refused (as the CRD's rule refuses it): it already names them all."""

    r: int = Field(default=16, ge=1, le=1024)
    alpha: int = Field(default=32, ge=1, le=4096)
    dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    target_modules: (
        Annotated[list[ModuleName], Field(min_length=1, max_length=64)] | Literal["all-linear"]
    ) = "all-linear"

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear_alone(cls, modules: Any) -> Any:
        if not isinstance(modules, list) or ALL_LINEAR not in modules:
            return modules
        if len(modules) > 1:
            raise ValueError(
                "all-linear already adapts every linear layer: give it alone ([all-linear]) or name"
                " the modules without it"
            )
        return ALL_LINEAR


class TrainingSettings(_Strict):
    """Everything the planner decided (or the user overrode). The trainer applies it as given."""

    epochs: float = Field(default=1.0, gt=0)
    max_steps: int | None = Field(default=None, ge=1)
    learning_rate: float = Field(default=2e-4, gt=0)
    lr_scheduler: Literal["cosine", "linear", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(default=0.03, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    global_batch_size: int = Field(default=32, ge=1)
    micro_batch_size: int = Field(default=1, ge=1)
    gradient_accumulation_steps: int = Field(default=1, ge=1)
    gradient_checkpointing: bool = False
    precision: Precision = "bf16"
    tf32: bool = True
    packing: bool = True
    # Rows of packed sequences are this long (tokens); defaults to max_seq_length.
    packing_length: int | None = Field(default=None, ge=16)
    attention: Attention = "sdpa"
    liger_kernels: bool = False
    optimizer: Optimizer = "adamw_torch_fused"
    dataloader_workers: int = Field(default=2, ge=0)
    seed: int = 42
    logging_every_steps: int = Field(default=10, ge=1)


class TrainingOverrides(_Strict):
    """The user's overrides (the SFTJob's ``spec.training``): every field unset means "plan it".

    The planner applies what is set and never silently changes it; a plan that cannot fit with the
    overrides is reported as not fitting. The bounds are the CRD's (tests/unit/test_crd.py compares
    them), so ``sftjob plan -f`` refuses what ``kubectl apply`` would.
    """

    epochs: float | None = Field(default=None, gt=0, le=1000)
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000)
    learning_rate: float | None = Field(default=None, gt=0, le=1)
    warmup_ratio: float | None = Field(default=None, ge=0, lt=1)
    weight_decay: float | None = Field(default=None, ge=0, le=1)
    global_batch_size: int | None = Field(default=None, ge=1, le=65536)
    micro_batch_size: int | None = Field(default=None, ge=1, le=1024)
    gradient_checkpointing: bool | None = None
    precision: Precision | None = None
    packing: bool | None = None
    # Fixes the packed row length (at most the dataset's maxSeqLength); the OOM ladder then never
    # shortens it.
    packing_length: int | None = Field(default=None, ge=16, le=131072)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)


class DistributedSettings(_Strict):
    nnodes: int = Field(default=1, ge=1)
    nproc_per_node: int = Field(default=1, ge=1, le=8)
    sharding: Sharding = "none"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class CheckpointSettings(_Strict):
    dir: str = "/checkpoints"
    every_steps: int | None = Field(default=None, ge=1)
    every_minutes: float | None = Field(default=30.0, gt=0)
    keep: int = Field(default=3, ge=1)


class GpuExpectation(_Strict):
    """What preflight checks before heavy work. ``required=False`` is an explicit CPU run (tests).

    Whatever the image, preflight requires a driver that supports the CUDA major version its PyTorch
    was built for: that is the real incompatibility. ``min_driver`` is an extra floor ("": none, which
    trainers of every version read as no floor). The operator sets none: the image decides which
    drivers can run it (a CUDA 12 build of the trainer runs on drivers older than the default's 580).
    """

    required: bool = True
    memory_gib: float | None = None  # free memory the plan needs per GPU
    min_driver: str = ""  # e.g. "580.65.06"


class ReportSettings(_Strict):
    """How the trainer tells the operator about progress (annotations on its own Pod) and Prometheus about
    the run (the metrics endpoint)."""

    enabled: bool = True
    interval_seconds: float = Field(default=30.0, gt=0)
    metrics_port: int | None = 9401
    # The plan's predicted real tokens/s for the whole job, exported beside the measured rate so that an
    # alert can tell a job slow from its first step (no faster past to drop from); None: no plan (a run
    # from a hand-written config), exported as 0, which nothing compares with.
    planned_tokens_per_second: float | None = Field(default=None, ge=0)


class MlflowSettings(_Strict):
    """An MLflow tracking server: the job is one run of ``experiment`` (default: the job's namespace),
    found again on every attempt by its ``sftjob.io/uid`` tag. Credentials come as the environment MLflow
    reads (``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``), never in this file."""

    tracking_uri: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    experiment: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None


class WandbSettings(_Strict):
    """A Weights & Biases project: the job is one run whose id is the job's uid, resumed by every attempt.
    The API key comes as ``WANDB_API_KEY`` (a self-hosted server as ``WANDB_BASE_URL``)."""

    project: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    entity: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None


class TrackingSettings(_Strict):
    """Experiment trackers rank 0 logs to besides its metrics endpoint and train log: at every logging
    step, at every evaluation, and the plan each attempt runs. ``tensorboard_dir`` is where TensorBoard's
    event files go (on the checkpoint volume, so they outlive a pod); None: no TensorBoard. A tracker that
    fails is logged and dropped for the rest of the attempt: training never stops for one."""

    tensorboard_dir: str | None = None
    mlflow: MlflowSettings | None = None
    wandb: WandbSettings | None = None

    @property
    def enabled(self) -> bool:
        return self.tensorboard_dir is not None or self.mlflow is not None or self.wandb is not None


class TrainerConfig(_Strict):
    schema_version: Literal[6] = SCHEMA_VERSION
    job: JobRef = JobRef()
    model: ModelSource
    dataset: DatasetSource
    evaluation: EvaluationSettings | None = None
    method: Method = "lora"
    lora: LoraSettings = LoraSettings()
    training: TrainingSettings = TrainingSettings()
    distributed: DistributedSettings = DistributedSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    output_dir: str = "/output"
    # Beside the adapter, the base with the adapter merged in, in output_dir's ``merged`` folder.
    merge_adapter: bool = False
    gpu: GpuExpectation = GpuExpectation()
    report: ReportSettings = ReportSettings()
    tracking: TrackingSettings = TrackingSettings()

    @model_validator(mode="after")
    def _batch_is_exact(self) -> TrainerConfig:
        t = self.training
        per_step = t.micro_batch_size * t.gradient_accumulation_steps * self.distributed.world_size
        if per_step != t.global_batch_size:
            raise ValueError(
                f"global_batch_size {t.global_batch_size} != micro_batch_size {t.micro_batch_size}"
                f" x gradient_accumulation_steps {t.gradient_accumulation_steps}"
                f" x world_size {self.distributed.world_size}"
            )
        return self

    @model_validator(mode="after")
    def _qlora_is_single_gpu(self) -> TrainerConfig:
        d = self.distributed
        if self.method == "qlora" and (d.sharding != "none" or d.world_size > 1):
            raise ValueError(
                f"method qlora runs on exactly one GPU (its 4-bit base is neither sharded nor replicated):"
                f" distributed.sharding {d.sharding} and world_size {d.world_size} must be none and 1"
            )
        return self

    @model_validator(mode="after")
    def _merge_needs_an_adapter(self) -> TrainerConfig:
        if self.merge_adapter and self.method == "full":
            raise ValueError(
                "merge_adapter merges a LoRA or QLoRA adapter into its base: method full writes the whole"
                " model already"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def load(cls, path: str | Path) -> TrainerConfig:
        return cls.model_validate(json.loads(Path(path).read_text()))
