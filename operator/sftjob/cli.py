"""The ``sftjob`` command: plan a fine-tuning job per GPU type without a cluster, list the GPU table.

    sftjob plan -f sftjob.yaml [--gpu L40S] [--gpus 2 --seq 4096 ...]
    sftjob plan --model meta-llama/Llama-3.1-8B --method lora --gpu A40 [--gpus 2] [--seq 4096]
    sftjob gpus

``plan`` builds an SFTJob spec (from the YAML file, a whole SFTJob or just its spec, with the flags
applied over it; or from the flags alone), validates it as admission does and plans it with the
operator's own function (``job_plan``) for the GPU types the job allows unless ``--gpu`` names others.
It exits 1 when the job fits on none of the GPU types shown or (with ``-f``) its checkpoint claim is too
small for it, 2 on bad input, with the flag or the spec field to fix named.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sftjob import constants as c
from sftjob.gpus import PROFILES, GpuProfile, profile_for_key
from sftjob.job_plan import memory_problem, plan_job
from sftjob.plan import Plan
from sftjob.planner import PlanRequest
from sftjob.spec import (
    ANY_ORDER,
    MAX_JOB_NAME,
    SFTJobSpec,
    to_plan_request,
    valid_job_name,
)
from sftjob.spec_rules import batch_problem, packing_problem
from sftjob.storage import too_small

EXIT_NOTHING_FITS = 1
EXIT_BAD_INPUT = 2
# The spec field each flag sets (errors name the flag instead of the field it set).
FLAG_FIELDS: dict[str, str] = {
    "--model": "spec.model.name",
    "--parameters": "spec.model.parameters",
    "--method": "spec.method",
    "--gpus": "spec.gpu.count",
    "--nodes": "spec.gpu.nodes",
    "--seq": "spec.dataset.maxSeqLength",
    "--global-batch": "spec.training.globalBatchSize",
}
# A spec built from flags alone names no dataset (the plan does not depend on it) and, with only
# --parameters, no model.
FLAGS_DATASET = "none"
UNNAMED_MODEL = "unnamed-model"


GENERATED_SUFFIX = 5  # characters the API server appends to metadata.generateName


class InputError(Exception):
    """Bad command-line or YAML input, with a message naming the flag or the field."""


def _read_spec(path: str) -> dict[str, Any]:
    """The spec in a YAML file holding a whole SFTJob (its kind, apiVersion and name checked as the API
    server checks them) or just its spec."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"cannot read {path}: {e}") from e
    if isinstance(doc, dict) and ("kind" in doc or "apiVersion" in doc):
        api_version = f"{c.API_GROUP}/{c.API_VERSION}"
        if doc.get("kind") != c.KIND or doc.get("apiVersion") != api_version:
            raise InputError(
                f"{path}: kind {doc.get('kind')!r}, apiVersion {doc.get('apiVersion')!r}: expected kind"
                f" {c.KIND}, apiVersion {api_version} (one object per file)"
            )
        metadata = doc.get("metadata") or {}
        name = metadata.get("name")
        prefix = metadata.get("generateName")
        if name is None and isinstance(prefix, str):  # the API server appends 5 characters
            name = prefix + "x" * GENERATED_SUFFIX
        if not isinstance(name, str) or not valid_job_name(name):
            raise InputError(
                f"{path}: metadata.name {name!r}: at most {MAX_JOB_NAME} characters, a lowercase letter"
                " first, then lowercase letters, digits and '-' (pods are named <job>-<attempt>-<rank>)"
            )
    spec = doc.get("spec", doc) if isinstance(doc, dict) else None
    if not isinstance(spec, dict):
        raise InputError(f"{path}: expected an SFTJob object")
    return spec


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The spec flags given on the command line, by flag."""
    given = {
        "--model": args.model,
        "--parameters": args.parameters,
        "--method": args.method,
        "--gpus": args.gpus,
        "--nodes": args.nodes,
        "--seq": args.seq,
        "--global-batch": args.global_batch,
    }
    return {flag: value for flag, value in given.items() if value is not None}


def _with_flags(spec: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with each flag's field set; ``--model`` replaces the whole model block (its path,
    volume and size hints belong to the other model)."""
    doc = copy.deepcopy(spec)
    if "--model" in flags:
        doc["model"] = {}
    for flag, value in flags.items():
        *parents, leaf = FLAG_FIELDS[flag].split(".")[1:]
        node = doc
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return doc


def _name_flags(message: str, flags: list[str]) -> str:
    """``message`` with the fields these flags set called by the flags' names."""
    for flag in flags:
        message = message.replace(FLAG_FIELDS[flag], flag)
    return message


def _problems(error: ValidationError) -> str:
    def one(err: Any) -> str:
        where = ".".join(str(x) for x in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        return f"spec.{where}: {message}" if where else message

    return "; ".join(one(err) for err in error.errors()[:5])


def _spec(args: argparse.Namespace) -> tuple[SFTJobSpec, str, list[str]]:
    """The spec to plan, validated like admission; the prefix of errors about it (the ``-f`` file) and
    the flags whose names they use for the fields the flags set."""
    flags = _flags(args)
    if args.file:
        doc, where, named = _with_flags(_read_spec(args.file), flags), f"{args.file}: ", list(flags)
    elif "--model" in flags or "--parameters" in flags:
        model = {"name": flags.get("--model", UNNAMED_MODEL)}
        doc = _with_flags({"model": model, "dataset": {"name": FLAGS_DATASET}}, flags)
        where, named = "", list(FLAG_FIELDS)  # every field the flags can set is a flag's
    else:
        raise InputError("give -f sftjob.yaml, or --model (a hub id) and/or --parameters")
    try:
        spec = SFTJobSpec.model_validate(doc)
    except ValidationError as e:
        raise InputError(where + _name_flags(_problems(e), named)) from e
    if problem := packing_problem(spec) or batch_problem(spec):  # the CRD's rules, as admission
        raise InputError(where + _name_flags(problem, named))
    return spec, where, named


def _profiles(names: list[str]) -> list[GpuProfile]:
    """The profiles ``--gpu`` names, in order; ``Any`` is every type in the order ``Any`` prefers."""
    keys = [k.strip() for part in names for k in part.split(",") if k.strip()]
    if not keys:
        raise InputError("--gpu: give a GPU type (A800, A40, L40S, Any) or a profile of `sftjob gpus`")
    expanded = [t for k in keys for t in (ANY_ORDER if k.casefold() == "any" else (k,))]
    try:
        profiles = [profile_for_key(k) for k in expanded]
    except ValueError as e:
        raise InputError(f"--gpu: {e}, or a profile of `sftjob gpus`") from e
    return list({p.key: p for p in profiles}.values())


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
    p = sub.add_parser(
        "plan",
        help="plan a job per GPU type: memory breakdown, fit verdict, settings",
        description="Plan an SFTJob (-f) or one described by flags; with -f the flags override the file.",
    )
    p.add_argument("-f", "--file", help="SFTJob YAML file")
    p.add_argument("--model", help="hub id, e.g. meta-llama/Llama-3.1-8B (spec.model, replaced whole)")
    p.add_argument("--parameters", type=int, help="spec.model.parameters: the size of a model not built in")
    p.add_argument("--method", choices=["lora", "qlora", "full"], help="spec.method (default lora)")
    p.add_argument(
        "--gpu",
        action="append",
        default=[],
        help="GPU type or profile (A800, A40, L40S, Any, A800-PCIE-40GB, ...); repeat or comma-separate",
    )
    p.add_argument("--gpus", type=int, help="GPUs per node, spec.gpu.count (default 1)")
    p.add_argument("--nodes", type=int, help="spec.gpu.nodes (default 1)")
    p.add_argument(
        "--seq", type=int, help="max sequence length in tokens, spec.dataset.maxSeqLength (default 2048)"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        help="spec.training.globalBatchSize in rows (default: planned, ~128k tokens per step)",
    )
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    g = sub.add_parser("gpus", help="list the GPU profile table")
    g.add_argument("-o", "--output", choices=["table", "json"], default="table")
    return parser


def _plan_command(args: argparse.Namespace) -> int:
    spec, where, named = _spec(args)
    profiles = _profiles(args.gpu or list(spec.gpu.candidates()))
    try:
        request = to_plan_request(spec, spec.gpu.count, spec.gpu.nodes)
        plans = [plan_job(spec, gpu) for gpu in profiles]
    except ValueError as e:
        raise InputError(where + _name_flags(str(e), named)) from e
    model = spec.model.name or spec.model.path or "model"
    if args.output == "json":
        print(
            json.dumps(
                [plan_json(p, spec.method, g.memory_gib) for p, g in zip(plans, profiles, strict=True)],
                indent=2,
            )
        )
    else:
        print(render_plans(plans, request, model))
    if memory := memory_problem(spec, profiles[0]):
        print(f"sftjob: warning: {memory}", file=sys.stderr)
    volume = too_small(spec, plans[0]) if args.file else None
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
