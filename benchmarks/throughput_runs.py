"""Which configurations the trainer throughput benchmark runs, on which model shapes, in each mode.

Each model and method gets the seed guide's settings (``seed``), plain tuning with and without Liger
(``plain``, ``plain+liger``) and the planner's plan for A800 at 80 GiB and for A40/L40S under a 46 GiB
per-process cap (``planned``). Modes set the step counts and sample sizes: ``tiny`` for the CPU (CI),
``quick`` and ``full`` for a GPU, ``plans`` for the planned rows' 20-step memory check.

The caps are the anchors' (shared/research/h200-anchors.md ran under 46 GiB), a little above the cards'
own capacity (A40 44.35, L40S 44.42, A800 79.15 GiB): planned rows say apart whether their peak fits the
card itself (``fitsCard``, throughput_results).
"""

from __future__ import annotations

import dataclasses

from sftjob.architectures import Architecture
from sftjob.config import LoraSettings, Method
from sftjob.model_shapes import known_architecture

GLOBAL_BATCH = 32  # the seed guide's 4 x 8, and the global batch issue 8's MFU targets are for
LORA = LoraSettings(r=16, alpha=32, dropout=0.05, target_modules="all-linear")


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

# The planned rows, the 46 GiB cards first: a session cut short keeps every method's tightest plan (issue
# 4 needs each method once), and the L40S rows are the A40's measurement again when the plans agree.
PLANNED_RUNS = [
    r for g in ("A40", "L40S", "A800") for r in GPU_RUNS if r.config == "planned" and r.plan_for == g
]


@dataclasses.dataclass(frozen=True)
class Mode:
    runs: list[Run]
    steps: int
    discard: int
    max_accumulation: int | None
    seq: int  # longest sample = packed row length
    median: int
    samples: int
    global_batch: int = GLOBAL_BATCH  # what the planned rows ask the planner for


MODES = {
    "tiny": Mode(TINY_RUNS, 2, 1, None, 128, 24, 200),
    "quick": Mode(GPU_RUNS, 8, 3, 2, 4096, 300, 3000),
    "full": Mode(GPU_RUNS, 14, 4, None, 4096, 300, 6000),
    # 20 steps at global batch 8 (so a 7B step is seconds, not tens): micro-batch and memory as at 32.
    "plans": Mode(PLANNED_RUNS, 20, 4, None, 4096, 300, 4000, 8),
}
