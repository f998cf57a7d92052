"""The ``sftjob`` command: plan a fine-tuning job per GPU type without a cluster, list the GPU table.

    sftjob plan -f sftjob.yaml [--gpu L40S]
    sftjob plan --model meta-llama/Llama-3.1-8B --method lora --gpu A40 [--gpus 2] [--seq 4096]
    sftjob gpus

``plan`` exits 1 when the job fits on none of the GPU types shown or its checkpoint claim is too small
for it, 2 on bad input. A YAML file is
validated as the SFTJob spec and planned by the same function as the operator's (``job_plan``), for
the GPU types the job allows unless ``--gpu`` names others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sftjob.architectures import resolve_architecture
from sftjob.config import TrainingOverrides
from sftjob.gpus import GPU_TYPES, PROFILES, GpuProfile, profile_for_key
from sftjob.job_plan import plan_job
from sftjob.plan import Plan
from sftjob.planner import PlanRequest, plan
from sftjob.spec import SFTJobSpec, to_plan_request
from sftjob.storage import too_small

EXIT_NOTHING_FITS = 1
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """Bad command-line or YAML input, with a message naming the field."""


def _job_from_yaml(path: str) -> SFTJobSpec:
    """The SFTJob spec in a YAML file (a whole SFTJob or just its spec), validated like admission."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"cannot read {path}: {e}") from e
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected an SFTJob object")
    try:
        return SFTJobSpec.model_validate(doc.get("spec", doc))
    except ValidationError as e:
        problems = "; ".join(
            f"spec.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()[:5]
        )
        raise InputError(f"{path}: {problems}") from e


def _request_from_flags(args: argparse.Namespace) -> tuple[PlanRequest, str]:
    if not args.model and not args.parameters:
        raise InputError("give -f sftjob.yaml, or --model (a hub id) and/or --parameters")
    try:
        architecture = resolve_architecture(args.model, None, args.parameters)
        request = PlanRequest(
            architecture=architecture,
            method=args.method,
            max_seq_length=args.seq,
            gpus_per_node=args.gpus,
            nodes=args.nodes,
            overrides=TrainingOverrides(global_batch_size=args.global_batch),
        )
    except (ValidationError, ValueError) as e:
        raise InputError(str(e)) from e
    return request, args.model or architecture.name or "model"


def _profiles(names: list[str]) -> list[GpuProfile]:
    try:
        return [profile_for_key(n) for part in names for n in part.split(",") if n.strip()]
    except ValueError as e:
        raise InputError(f"--gpu / spec.gpu.type: {e}") from e


def plan_json(p: Plan, method: str, capacity_gib: float) -> dict[str, Any]:
    """One GPU type's plan as the ``-o json`` object (camelCase, like the SFTJob status)."""
    t = p.training
    return {
        "gpu": p.gpu,
        "fits": p.fits,
        "estimatedPeakGiB": p.memory.total_gib,
        "capacityGiB": capacity_gib,
        "usableGiB": p.memory.budget_gib,
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
            each(lambda p: f"{p.resources.cpu} / {p.resources.memory} / {p.resources.shm_size}"),
        )
    )
    out = [title, "", _table(rows, [p.gpu for p in plans]), ""]
    for p in plans:
        out.append(f"{p.gpu}: {p.verdict}")
        out += [f"  - try: {s}" for s in p.suggestions]
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sftjob", description="Plan LLM fine-tuning jobs for A800/A40/L40S."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a job per GPU type: memory breakdown, fit verdict, settings")
    p.add_argument("-f", "--file", help="SFTJob YAML file")
    p.add_argument("--model", help="hub id, e.g. meta-llama/Llama-3.1-8B")
    p.add_argument("--parameters", type=int, help="model size in parameters when the model is not built in")
    p.add_argument("--method", choices=["lora", "qlora", "full"], default="lora")
    p.add_argument(
        "--gpu",
        action="append",
        default=[],
        help="GPU type or profile (A800, A40, L40S, A800-PCIE-40GB, ...); repeat or comma-separate",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048, help="max sequence length (tokens)")
    p.add_argument("--global-batch", type=int, help="global batch size in rows (default: ~128k tokens)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    g = sub.add_parser("gpus", help="list the GPU profile table")
    g.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return parser


def _plan_command(args: argparse.Namespace) -> int:
    if args.file:
        spec = _job_from_yaml(args.file)
        profiles = _profiles(args.gpu or list(spec.gpu.candidates()))
        try:
            request = to_plan_request(spec, spec.gpu.count, spec.gpu.nodes)
            plans = [plan_job(spec, gpu) for gpu in profiles]
        except ValueError as e:
            raise InputError(f"{args.file}: {e}") from e
        model = spec.model.name or spec.model.path or request.architecture.name or "model"
        volume = too_small(spec, plans[0])
    else:
        request, model = _request_from_flags(args)
        profiles = _profiles(args.gpu or list(GPU_TYPES))
        plans = [plan(request, gpu) for gpu in profiles]
        volume = None
    if args.output == "json":
        print(
            json.dumps(
                [plan_json(p, request.method, g.memory_gib) for p, g in zip(plans, profiles, strict=True)],
                indent=2,
            )
        )
    else:
        print(render_plans(plans, request, model))
    if volume is not None:  # the operator would fail the job at admission for it
        print(f"sftjob: {volume}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    return 0 if any(p.fits for p in plans) else EXIT_NOTHING_FITS


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "gpus":
            if args.output == "json":
                print(json.dumps([dataclasses.asdict(p) for p in PROFILES], indent=2))
            else:
                print(render_gpus())
            return 0
        return _plan_command(args)
    except InputError as e:
        print(f"sftjob: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
