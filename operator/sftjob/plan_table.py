"""What ``sftjob plan`` and ``sftjob gpus`` print: the plans side by side, the ``-o json`` objects, the GPU
table. Pure functions of plans and profiles, kept apart from the command's input handling (``cli.py``)."""

from __future__ import annotations

from typing import Any

from sftjob.gpus import PROFILES
from sftjob.plan import Plan, PodResources
from sftjob.planner import PlanRequest
from sftjob.storage import quantity_gib


def plan_json(p: Plan, method: str, card_gib: float) -> dict[str, Any]:
    """One GPU type's plan as the ``-o json`` object (camelCase, like the SFTJob status: capacityGiB is
    the usable budget per GPU, card memory x safety fraction; cardGiB the card's memory)."""
    t = p.training
    return {
        "gpu": p.gpu,
        "fits": p.fits,
        "estimatedPeakGiB": p.memory.total_gib,
        "capacityGiB": p.memory.budget_gib,
        "cardGiB": card_gib,
        "microBatchSize": t.micro_batch_size,
        "gradientAccumulationSteps": t.gradient_accumulation_steps,
        "globalBatchSize": t.global_batch_size,
        "gradientCheckpointing": t.gradient_checkpointing,
        "precision": t.precision,
        "method": method,
        "reason": p.verdict,
        "packingLength": t.packing_length,
        "ligerKernels": t.liger_kernels,
        "sharding": p.distributed.sharding,
        "worldSize": p.distributed.world_size,
        "predictedTokensPerSecond": p.predicted_tokens_per_second,
        "predictedMfu": p.predicted_mfu,
        "checkpointGiB": round(p.checkpoint_gib, 2),
        "podMemory": p.resources.memory,
        "podMemoryOtherNodes": p.resources.worker_memory,
        "memory": {term.name: term.gib for term in p.memory.terms},
        "suggestions": p.suggestions,
        "summary": p.summary(),
    }


def _table(rows: list[tuple[str, list[str]]], header: list[str]) -> str:
    width = max(len(label) for label, _ in rows) + 2
    cols = [max(len(h), *(len(r[1][i]) for r in rows)) + 2 for i, h in enumerate(header)]
    lines = ["".ljust(width) + "".join(h.ljust(c) for h, c in zip(header, cols, strict=True))]
    lines += [
        label.ljust(width) + "".join(v.ljust(c) for v, c in zip(values, cols, strict=True))
        for label, values in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def render_plans(plans: list[Plan], request: PlanRequest, model: str) -> str:
    """The side-by-side comparison ``sftjob plan`` prints."""
    a = request.architecture
    title = (
        f"{model} ({a.name}, {a.parameters / 1e9:.2f}B params), {request.method},"
        f" {request.nodes} node(s) x {request.gpus_per_node} GPU(s), max seq {request.max_seq_length}"
    )
    terms: list[str] = []
    for p in plans:
        terms += [t.name for t in p.memory.terms if t.name not in terms]

    def each(f: Any) -> list[str]:
        return [f(p) for p in plans]

    rows: list[tuple[str, list[str]]] = [
        ("fits", each(lambda p: "yes" if p.fits else "NO")),
        ("peak / usable GiB", each(lambda p: f"{p.memory.total_gib:.1f} / {p.memory.budget_gib:.1f}")),
        ("precision", each(lambda p: p.training.precision)),
        (
            "micro x accum x GPUs",
            each(
                lambda p: (
                    f"{p.training.micro_batch_size} x"
                    f" {p.training.gradient_accumulation_steps} x {p.distributed.world_size}"
                )
            ),
        ),
        ("global batch (rows)", each(lambda p: str(p.training.global_batch_size))),
        ("packed row tokens", each(lambda p: str(p.training.packing_length or "padded"))),
        ("gradient checkpointing", each(lambda p: "on" if p.training.gradient_checkpointing else "off")),
        ("Liger kernels", each(lambda p: "on" if p.training.liger_kernels else "off")),
        ("sharding", each(lambda p: p.distributed.sharding)),
        ("tokens/s (predicted)", each(lambda p: f"{p.predicted_tokens_per_second:,.0f}")),
        ("MFU (predicted)", each(lambda p: f"{p.predicted_mfu:.0%}")),
    ]
    for name in terms:
        rows.append(
            (
                f"  {name} GiB",
                each(lambda p, n=name: next((f"{t.gib:.2f}" for t in p.memory.terms if t.name == n), "-")),
            )
        )
    rows.append(
        (
            "checkpoint GiB (one)",
            each(lambda p: f"{p.checkpoint_gib:.1f}"),
        )
    )
    rows.append(
        (
            "pod cpu / memory / shm",
            each(lambda p: f"{p.resources.cpu} / {_memory(p.resources)} / {p.resources.shm_size}"),
        )
    )
    out = [title, "", _table(rows, [p.gpu for p in plans]), ""]
    for p in plans:
        out.append(f"{p.gpu}: {p.verdict}")
        out += [f"  - try: {s}" for s in p.suggestions]
    fitting = [p.resources for p in plans if p.fits]
    if len({_memory(r) for r in fitting}) > 1:  # a pod is made before it lands: it asks for the most
        first = max((r.memory_for(0) for r in fitting), key=quantity_gib)
        others = max((r.memory_for(1) for r in fitting), key=quantity_gib)
        asked = PodResources(
            cpu="", memory=first, shm_size="", worker_memory=None if others == first else others
        )
        out.append(f"pods of a job allowed on these cards ask for {_memory(asked)} wherever they land")
    return "\n".join(out)


def render_gpus() -> str:
    rows = [
        (
            p.key,
            [
                p.family,
                f"{p.memory_gib:g}",
                f"{p.bandwidth_gbs:g}",
                f"{p.bf16_tflops:g}",
                f"{p.fp8_tflops:g}" if p.fp8_tflops else "-",
                f"{p.compute_capability[0]}.{p.compute_capability[1]}",
                p.interconnect,
                ", ".join(x for x in p.products if " " not in x),
            ],
        )
        for p in PROFILES
    ]
    header = ["family", "GiB", "GB/s", "bf16 TF", "fp8 TF", "sm", "interconnect", "nvidia.com/gpu.product"]
    return "Dense tensor-core TFLOPS (no 2:4 sparsity); GiB as CUDA reports it.\n\n" + _table(rows, header)


def _memory(resources: PodResources) -> str:
    if resources.worker_memory is None:
        return resources.memory
    return f"{resources.memory} (node rank 0), {resources.worker_memory} (other nodes)"
