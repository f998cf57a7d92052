"""The ``sftjob`` command: plan a fine-tuning job per GPU type without a cluster, list the GPU table.

    sftjob plan -f sftjob.yaml [--gpu L40S] [--gpus 2 --seq 4096 ...]   (-f -: standard input)
    sftjob plan --model meta-llama/Llama-3.1-8B --method lora --gpu A40 [--gpus 2] [--seq 4096]
    sftjob gpus

``plan`` builds an SFTJob spec (from the YAML file, a whole SFTJob or just its spec, with the flags
applied over it; or from the flags alone), validates it as admission does and plans it with the
operator's own function (``job_plan``) for the GPU types the job allows unless ``--gpu`` names others.
It exits 1 when the job fits on none of the GPU types shown or (with ``-f``) its checkpoint claim is too
small for it, 2 on bad input, with the flag or the spec field to fix named, and on an unexpected error
(never 1, which says nothing fits). The file is read as kubectl reads it (:mod:`sftjob.cli_input`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from typing import Any

from pydantic import ValidationError

from sftjob.architectures import Architecture
from sftjob.cli_input import InputError, read_spec, source
from sftjob.gpu_products import cards_for_job, cards_for_types, default_products, selector_problem
from sftjob.gpus import GPU_TYPES, PROFILES, GpuProfile, profile_for_key
from sftjob.job_plan import memory_problem, plan_job
from sftjob.model_shapes import known_architecture
from sftjob.plan_table import plan_json, render_gpus, render_plans
from sftjob.spec import ANY_ORDER, SFTJobSpec, to_plan_request
from sftjob.spec_rules import batch_problem, packing_problem, tensorboard_problem
from sftjob.storage import too_small

EXIT_NOTHING_FITS = 1
EXIT_BAD_INPUT = 2
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command whose reader went away
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

# `sftjob plan` knows the built-in default of an unset spec.checkpoints.size, not the operator's.
BUILT_IN_DEFAULT_CLAIM = (
    "the built-in default checkpoint claim {size} (the operator's may differ: its --checkpoint-size flag,"
    " the Helm value defaults.checkpoints.size)"
)


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
        parent: Any = doc
        for key in parents:  # a missing block is made; a malformed one (gpu: L40S) is left to validation
            if isinstance(parent, dict):
                parent = parent.setdefault(key, {})
        if isinstance(parent, dict):
            parent[leaf] = value
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
        if err["type"] in ("int_type", "float_type") and isinstance(err["input"], str):
            message += f", not the string {err['input']!r}: the API server refuses it; write it unquoted"
        # A rule's message that names its field itself (spec.model.architecture.kvHeads ...) stands alone.
        return f"spec.{where}: {message}" if where and not message.startswith("spec.") else message

    return "; ".join(one(err) for err in error.errors()[:5])


def _spec(args: argparse.Namespace) -> tuple[SFTJobSpec, str, list[str]]:
    """The spec to plan, validated like admission; the prefix of errors about it (the ``-f`` file) and
    the flags whose names they use for the fields the flags set."""
    flags = _flags(args)
    if args.file:
        doc, where, named = _with_flags(read_spec(args.file), flags), f"{source(args.file)}: ", list(flags)
    elif "--model" in flags or "--parameters" in flags:
        model = {"name": flags.get("--model", UNNAMED_MODEL)}
        doc = _with_flags({"model": model, "dataset": {"name": FLAGS_DATASET}}, flags)
        where, named = "", list(FLAG_FIELDS)  # every field the flags can set is a flag's
    else:
        raise InputError("give -f sftjob.yaml, or --model (a hub id) and/or --parameters")
    try:  # strictly, as the API server checks the types: "4096" is no integer
        spec = SFTJobSpec.model_validate_json(json.dumps(doc, default=str), strict=True)
    except ValidationError as e:
        raise InputError(where + _name_flags(_problems(e), named)) from e
    if problem := packing_problem(spec) or batch_problem(spec) or tensorboard_problem(spec):  # as admission
        raise InputError(where + _name_flags(problem, named))
    # As the operator admits it, under the default product mapping (an operator may configure its own).
    if problem := selector_problem(spec.node_selector, spec.gpu.candidates(), default_products()):
        raise InputError(where + problem)
    return spec, where, named


def _warnings(spec: SFTJobSpec, architecture: Architecture) -> list[str]:
    """What admission lets through but the job will not do as written."""
    found: list[str] = []
    model = spec.model.name or spec.model.path or ""
    known = known_architecture(model) if spec.model.architecture is None else None
    if spec.model.parameters is not None and known is not None:  # the planner takes the built-in shape
        found.append(
            f"spec.model.parameters {spec.model.parameters} is ignored: {model} is planned as the built-in"
            f" {known.name} ({known.parameters / 1e9:.2f}B params)"
        )
    if spec.method == "full" and "lora" in spec.model_fields_set:
        found.append("spec.lora is ignored: method full trains every weight of the model, with no adapters")
    targets = spec.lora.target_modules
    # peft matches a name against the end of each module's path: self_attn.q_proj, q_proj.
    named = [t.rsplit(".", 1)[-1] for t in targets] if targets != "all-linear" else []
    family = architecture.family  # a shape the planner knows the layer names of (not a guess from size)
    if spec.method != "full" and named and family and sum(architecture.lora_widths(named)) == 0:
        found.append(
            f"spec.lora.targetModules {targets}: none is an attention or MLP projection of a {family}"
            " model (q_proj, v_proj, down_proj ..., or all-linear); unless they name other layers of the"
            " model, the trainer fails at once with ConfigError"
        )
    return found


def _job_cards(spec: SFTJobSpec) -> list[GpuProfile]:
    """The cards the operator plans the job for: every card of its GPU types, or the one its
    nodeSelector names."""
    return list(cards_for_job(spec, default_products()).profiles.values())


def _profiles(names: list[str], spec: SFTJobSpec) -> list[GpuProfile]:
    """The profiles ``--gpu`` names, in order: a GPU type is every card of it as the operator plans it
    (the job's nodeSelector applied), ``Any`` every type in the order ``Any`` prefers, a profile key of
    ``sftjob gpus`` that one card."""
    keys = [k.strip() for part in names for k in part.split(",") if k.strip()]
    if not keys:
        raise InputError("--gpu: give a GPU type (A800, A40, L40S, Any) or a profile of `sftjob gpus`")
    profiles: list[GpuProfile] = []
    for key in keys:
        if gpu_types := _gpu_types(key):
            profiles += cards_for_types(gpu_types, default_products(), spec.node_selector).profiles.values()
            continue
        try:
            profiles.append(profile_for_key(key))
        except ValueError as e:
            raise InputError(f"--gpu: {e}, or a profile of `sftjob gpus`") from e
    return list({p.key: p for p in profiles}.values())


def _gpu_types(key: str) -> list[str]:
    """The GPU types ``key`` names (``Any``: all, in the order it prefers); none for a profile key."""
    if key.casefold() == "any":
        return list(ANY_ORDER)
    return [t for t in GPU_TYPES if t.casefold() == key.casefold()]


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
    p.add_argument("-f", "--file", help="SFTJob YAML file (or its spec); - reads standard input")
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
    profiles = _profiles(args.gpu, spec) if args.gpu else _job_cards(spec)
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
    # The pods ask for the user's memory wherever they land: said for the first card whose plan needs more.
    fitting = [g for g, p in zip(profiles, plans, strict=True) if p.fits]
    short = next((problem for g in fitting if (problem := memory_problem(spec, g))), None)
    for warning in [short, *_warnings(spec, request.architecture)]:
        if warning:
            print(f"sftjob: warning: {_name_flags(warning, named)}", file=sys.stderr)
    volume = too_small(spec, plans[0], BUILT_IN_DEFAULT_CLAIM) if args.file else None
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
    except BrokenPipeError:  # `sftjob plan ... | head` closed the pipe: end quietly, as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
    except Exception as e:  # a bug: exit 1 would say the job fits nowhere
        print(f"sftjob: error: unexpected {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
