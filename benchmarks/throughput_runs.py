"""Which configurations the trainer throughput benchmark runs, on which model shapes and samples, in
each mode, and the training settings each one trains with.

Each model and method gets the seed guide's settings (``seed``), plain tuning with and without Liger
(``plain``, ``plain+liger``) and the planner's plan for A800 at 80 GiB and for A40/L40S under a 46 GiB
per-process cap (``planned``). Modes set the step counts and sample sizes: ``tiny`` for the CPU (CI),
``quick`` and ``full`` for a GPU, ``plans`` for the planned rows' 20-step memory check (with the full
fine-tune's seed and plain rows, so the planned rows have a seed to compare with), ``tiny-plans`` for the
same on the tiny shape (the CPU dry run of hack/gpu-check.sh). Workloads set the synthetic samples'
length range and the LoRA dropout: issue 8's (8..4,096 tokens, the trainer's default dropout 0.05) or the
anchors' (32..2,048, dropout 0) for rows compared with them like for like.

The caps are the anchors' (shared/research/h200-anchors.md ran under 46 GiB), a little above the cards'
own capacity (A40 44.35, L40S 44.42, A800 79.15 GiB): planned rows say apart whether their peak fits the
card itself (``fitsCard``, throughput_results).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sftjob.architectures import Architecture
from sftjob.candidates import PlanRequest
from sftjob.config import LoraSettings, Method, TrainingOverrides, TrainingSettings
from sftjob.gpus import profile_for_type
from sftjob.model_shapes import known_architecture
from sftjob.planner import plan

GLOBAL_BATCH = 32  # the seed guide's 4 x 8, and the global batch issue 8's MFU targets are for


@dataclasses.dataclass(frozen=True)
class Workload:
    """The synthetic samples' length range (log-normal around the mode's median, clipped) and the LoRA
    adapters' dropout (r 16, alpha 32, every linear layer)."""

    name: str
    shortest: int
    longest: int
    lora_dropout: float

    @property
    def lora(self) -> LoraSettings:
        return LoraSettings(r=16, alpha=32, dropout=self.lora_dropout, target_modules="all-linear")

    def describe(self) -> str:
        return f"{self.name}: lengths {self.shortest}..{self.longest}, LoRA dropout {self.lora_dropout:g}"


WORKLOADS = {
    # Issue 8's: lengths up to 4,096; the dropout a job gets when its spec names none (sftjob.config).
    "issue": Workload("issue", 8, 4096, 0.05),
    # shared/research/h200-anchors.md: lengths "clipped to 32..2048"; its LoRA rows name no dropout, so
    # peft's LoraConfig default, 0 (dropout alone costs ~5% tokens/s: benchmarks/planner/README.md).
    "anchors": Workload("anchors", 32, 2048, 0.0),
}


def _known(model: str) -> Architecture:
    arch = known_architecture(model)
    if arch is None:
        raise LookupError(f"{model} is not in sftjob.architectures' built-in table")
    return arch


# Model shapes: the built-in table's rows for the anchors' models (TinyLlama, Llama-2-7B), and a tiny one.
SHAPES: dict[str, Architecture] = {
    "tiny": Architecture(
        layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128, vocab_size=320
    ),
    "1.1B": _known("TinyLlama/TinyLlama-1.1B"),
    "7B": _known("meta-llama/Llama-2-7b-hf"),
}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    method: Method
    config: str  # seed | plain | plain+liger | planned
    cap_gib: float | None = None  # per-process memory cap emulating a smaller card
    plan_for: str | None = None  # GPU type the planner planned for
    micro: int = 4
    accumulation: int = 8

    @property
    def name(self) -> str:
        return f"{self.model}/{self.method}/{self.config}" + (f"-{self.plan_for}" if self.plan_for else "")


def _group(model: str, method: Method, plain: tuple[int, int, float | None], liger: bool) -> list[Run]:
    micro, accumulation, cap = plain
    runs = [Run(model, method, "seed"), Run(model, method, "plain", cap, None, micro, accumulation)]
    if liger:
        runs.append(Run(model, method, "plain+liger", cap, None, micro, accumulation))
    return runs + [
        Run(model, method, "planned", c, g) for g, c in (("A800", 80.0), ("A40", 46.0), ("L40S", 46.0))
    ]


GPU_RUNS = (
    _group("1.1B", "full", (4, 2, None), liger=True)
    + _group("7B", "lora", (1, 4, 46.0), liger=True)
    + _group("7B", "qlora", (1, 4, 46.0), liger=False)
)
TINY_RUNS = [
    *_group("tiny", "full", (4, 2, None), liger=True),
    Run("tiny", "lora", "seed"),
    Run("tiny", "lora", "planned", 46.0, "A40"),  # packed LoRA through the planner, as on the GPU
    Run("tiny", "qlora", "seed"),
]


def plans_runs(full: str, adapters: str) -> list[Run]:
    """``--plans``' runs, most valuable first so a session cut short keeps them: every method's plan
    under both caps (A40 at 46 GiB, then A800 at 80), the full fine-tune's seed and plain rows (its
    ``ratioToSeed``), then L40S, usually the A40 plan again (a copied row, measured once)."""
    methods: tuple[tuple[str, Method], ...] = ((full, "full"), (adapters, "lora"), (adapters, "qlora"))
    planned = [Run(m, method, "planned", 46.0, "A40") for m, method in methods]
    planned += [Run(m, method, "planned", 80.0, "A800") for m, method in methods]
    baselines = [r for r in _group(full, "full", (4, 2, None), liger=True) if r.config != "planned"]
    return planned + baselines + [Run(m, method, "planned", 46.0, "L40S") for m, method in methods]


@dataclasses.dataclass(frozen=True)
class Mode:
    runs: list[Run]
    steps: int
    discard: int
    max_accumulation: int | None
    seq: int  # packed row length, so no sample is longer
    median: int
    samples: int
    global_batch: int = GLOBAL_BATCH  # what the planned rows ask the planner for
    workload: Workload = WORKLOADS["issue"]
    planned_accumulation: int | None = None  # planned rows' cap: the micro-batch alone sets the peak
    run_seconds: float | None = None  # a run's wall limit: past it, it stops as partial after a step
    fake_peak: bool = False  # CPU dry runs only: a made-up peak, so the verdict code runs

    def with_workload(self, name: str) -> Mode:
        """The mode on the named workload, its samples no longer than the mode's packed rows."""
        workload = WORKLOADS[name]
        return dataclasses.replace(
            self, workload=dataclasses.replace(workload, longest=min(workload.longest, self.seq))
        )


MODES = {
    "tiny": Mode(TINY_RUNS, 2, 1, None, 128, 24, 200),
    "quick": Mode(GPU_RUNS, 8, 3, 2, 4096, 300, 3000),
    "full": Mode(GPU_RUNS, 14, 4, None, 4096, 300, 6000),
    # 20 steps at global batch 8, the planned rows' accumulation capped at 2 (so a 7B step is about a
    # second): the plan's micro-batch, so its memory, as at 32.
    "plans": Mode(plans_runs("1.1B", "7B"), 20, 4, None, 4096, 300, 4000, 8, planned_accumulation=2),
    "tiny-plans": Mode(plans_runs("tiny", "tiny"), 3, 1, None, 128, 24, 200, 8, planned_accumulation=2),
}


def settings_for(run: Run, mode: Mode) -> tuple[TrainingSettings, dict[str, Any]]:
    """The run's training settings, and planner details for planned rows."""
    if run.config == "seed":  # the seed guide's TrainingArguments: fp16, 4 x 8, pad to the longest
        return TrainingSettings(
            precision="fp16",
            micro_batch_size=4,
            gradient_accumulation_steps=8,
            global_batch_size=32,
            packing=False,
            learning_rate=2e-5,
            weight_decay=0.01,
            tf32=False,
            dataloader_workers=0,
        ), {}
    if run.config.startswith("plain"):
        return TrainingSettings(
            precision="bf16",
            micro_batch_size=run.micro,
            gradient_accumulation_steps=run.accumulation,
            global_batch_size=run.micro * run.accumulation,
            packing=True,
            packing_length=mode.seq,
            liger_kernels=run.config == "plain+liger",
            dataloader_workers=0,
        ), {}
    request = PlanRequest(
        architecture=SHAPES[run.model],
        method=run.method,
        lora=mode.workload.lora,
        max_seq_length=mode.seq,
        overrides=TrainingOverrides(global_batch_size=mode.global_batch),
    )
    chosen = plan(request, profile_for_type(run.plan_for or "A800"))
    outside_allocator = sum(t.gib for t in chosen.memory.terms if t.name == "overhead")
    details = {
        "planFits": chosen.fits,
        "predictedPeakGiB": round(chosen.memory.total_gib, 1),
        # What max_memory_allocated() can see: the estimate without the CUDA context and slack.
        "predictedAllocatorGiB": round(chosen.memory.total_gib - outside_allocator, 2),
        "plannedGlobalBatch": chosen.training.global_batch_size,
        "planSummary": chosen.summary(),
        "requestedGlobalBatch": mode.global_batch,
    }
    return chosen.training.model_copy(update={"dataloader_workers": 0}), details


def configure(run: Run, mode: Mode) -> tuple[TrainingSettings, dict[str, Any]]:
    """What the run trains with (its settings, accumulation capped to the mode's limits) and the row's
    fields that say it, planner details included: also for a row copied from an identical run."""
    planned, details = settings_for(run, mode)
    t = planned
    caps = [mode.max_accumulation, mode.planned_accumulation if run.config == "planned" else None]
    cap = min((c for c in caps if c is not None), default=None)
    if cap is not None and t.gradient_accumulation_steps > cap:
        t = t.model_copy(
            update={"gradient_accumulation_steps": cap, "global_batch_size": t.micro_batch_size * cap}
        )
    w = mode.workload
    return t, {
        "microBatch": t.micro_batch_size,
        "accumulation": t.gradient_accumulation_steps,
        "accumulationCapped": t.gradient_accumulation_steps < planned.gradient_accumulation_steps,
        "sequence": t.packing_length if t.packing else "padded",
        "gradientCheckpointing": t.gradient_checkpointing,
        "liger": t.liger_kernels,
        "precision": t.precision,
        "workload": w.name,
        "sampleLengths": f"{w.shortest}..{w.longest}",
        "loraDropout": None if run.method == "full" else w.lora_dropout,
    } | details
