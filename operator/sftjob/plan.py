"""The planner's output: what the operator injects into the trainer and shows in ``status.plan``.

Kept apart from ``planner.py`` (the decision logic) so the operator can read and store a plan
without caring how it was made.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sftjob.config import DistributedSettings, TrainingSettings

# A time-sliced card's plan says what its budget assumes (GpuProfile.time_sliced).
TIME_SLICED_REASON = (
    "time-sliced GPU (a -SHARED product label): time-slicing isolates no memory between the pods sharing"
    " it, so this budget assumes the job has the card to itself; another pod's memory on it can run the job"
    " out of memory"
)


class MemoryTerm(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str  # "weights", "gradients", "optimizer", "activations", "logits", "lora", "overhead", ...
    gib: float
    note: str = ""


class MemoryEstimate(BaseModel):
    """Predicted peak memory per GPU, term by term, against the usable budget of the card."""

    model_config = ConfigDict(frozen=True)

    terms: list[MemoryTerm]
    total_gib: float
    budget_gib: float  # card memory x safety fraction

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.budget_gib


class PodResources(BaseModel):
    model_config = ConfigDict(frozen=True)

    cpu: str  # Kubernetes quantity, e.g. "16"
    memory: str  # e.g. "128Gi": the pod of node rank 0, or every pod when worker_memory is None
    shm_size: str  # size of the /dev/shm emptyDir (medium Memory), e.g. "16Gi"
    # The other nodes' pods when only global rank 0 loads and saves the whole model (multi-node FSDP/HSDP).
    worker_memory: str | None = None

    def memory_for(self, node_rank: int) -> str:
        """The memory request (and limit) of the pod of ``node_rank``."""
        return self.memory if node_rank == 0 or self.worker_memory is None else self.worker_memory


class Plan(BaseModel):
    """A training configuration for one job on one GPU type, with the numbers behind it."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    gpu: str  # GPU profile key, e.g. "A800-SXM4-80GB"
    fits: bool
    training: TrainingSettings
    distributed: DistributedSettings
    env: dict[str, str] = Field(default_factory=dict)  # PYTORCH_CUDA_ALLOC_CONF, NCCL_*, OMP_NUM_THREADS
    resources: PodResources
    # One complete checkpoint on disk (trainable weights + optimizer state); the claim holds keep + 1
    # of them while a save rotates, beside the Hugging Face cache.
    checkpoint_gib: float = Field(default=0.0, alias="checkpointGiB")
    memory: MemoryEstimate
    predicted_tokens_per_second: float  # real (non-padding) tokens/s for the whole job
    predicted_mfu: float  # 0..1
    reasons: list[str] = Field(default_factory=list)  # why each choice was made, one line each
    suggestions: list[str] = Field(default_factory=list)  # when it does not fit: what would
    ladder: list[str] = Field(default_factory=list)  # OOM re-plan steps applied so far, oldest first
    verdict: str = ""  # one sentence: why it does not fit, or how it fits (and what was traded)

    def summary(self) -> str:
        """One line for ``status.plan.summary`` and ``kubectl describe``."""
        t = self.training
        parts = [
            self.gpu,
            t.precision,
            f"micro-batch {t.micro_batch_size} x accumulation {t.gradient_accumulation_steps}"
            f" x {self.distributed.world_size} GPU(s) = {t.global_batch_size}",
            f"seq {t.packing_length or 'max'}{' packed' if t.packing else ''}",
        ]
        if t.gradient_checkpointing:
            parts.append("gradient checkpointing")
        if t.liger_kernels:
            parts.append("Liger kernels")
        parts.append(f"~{self.memory.total_gib:.1f}/{self.memory.budget_gib:.1f} GiB")
        parts.append(f"~{self.predicted_tokens_per_second:,.0f} tokens/s")
        if TIME_SLICED_REASON in self.reasons:
            parts.append("time-sliced GPU: the budget assumes no other pod uses it")
        return ", ".join(parts)
