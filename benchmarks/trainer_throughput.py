"""Trainer throughput: the seed guide's settings, plain tuning and the planner's configs, side by side.

Random-initialised Llama shapes (1.1B full, 7B LoRA, 7B QLoRA; no downloads) train on synthetic SFT
samples (log-normal lengths, median ~300 tokens, up to 4,096) through the trainer's own code: its
attention choice (``resolve_attention``: packed rows run ``sftjob_varlen``), model preparation
(``prepare_for_training``), batching (``make_units``/``StepBatches``) and optimizer step
(``train_step``). Before the runs it checks that attention against SDPA with a block mask on the
device (``meta.attentionSelfCheck``). For each configuration it reports real (non-padding) tokens/s,
MFU against a measured bf16 matmul peak, peak memory and the ratio to the seed config; a configuration
that fails (out of memory, say) is recorded as such and the next one runs.

    python benchmarks/trainer_throughput.py --quick     # one GPU, ~6 minutes
    python benchmarks/trainer_throughput.py             # one GPU, the full step counts
    python benchmarks/trainer_throughput.py --plans     # one GPU: the planned configs, 20 steps each
    python benchmarks/trainer_throughput.py --tiny      # CPU, a tiny model, seconds (CI)

``--plans`` is the planner's check (issue 4): every planned config (1.1B full, 7B LoRA, 7B QLoRA for
A800 at 80 GiB and A40/L40S under a 46 GiB cap) runs 20 optimizer steps of a global batch of 8, its
accumulation capped at 2 (the micro-batch sets the peak), and its row compares the measured allocator
peak with the planner's estimate of it (``peakVsEstimate``, ``withinEstimate`` at +-15%, ``fitsCard``: the
reserved peak inside the card planned for); the 1.1B seed and plain rows follow, for ``ratioToSeed``.
With ``--tiny`` it runs the same on the tiny shape (``--fake-peak`` gives those CPU rows a made-up peak,
marked ``peakSource``, so the verdict code runs: dry runs only). ``--run-seconds`` stops a run past that
wall time after its next step (once it has a timed step), as ``partial``, and goes on to the next.
``--profile [REGEX]`` adds a torch profiler table of one more warm micro-batch and optimizer step per
run (or per run matching REGEX) (``<stem>-profile-<run>.txt``: the top kernels and ops by device time).
``--workload anchors`` trains on the anchors' samples (lengths 32..2,048, LoRA dropout 0) instead of
issue 8's (8..4,096, dropout 0.05), to compare with them like for like; every row names its workload.
A run whose settings equal an earlier run's is measured once: its row copies the numbers, keeps its own
settings and plan, and says that the two are identical.

Stopped by SIGINT (``timeout --signal=INT``) or SIGTERM, it writes the rows so far and exits 130; the
run it was in keeps what its finished steps measured (``stepsDone``, peak memory, tokens/s and MFU of
the timed steps; ``status: partial``), which goes into its row after every step, or says which run it
was (``status: timeout``) when it was stopped before a step ended.

MFU (``mfu``) follows the anchors' convention so the numbers compare with
shared/research/h200-anchors.md: 6·N (full) or 4·N (LoRA) FLOPs per real token, N = matmul weights;
``mfuWithAttention`` adds causal attention FLOPs (sftjob_trainer.flops).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the planner's pod env

import torch
from throughput_results import (  # beside this script
    add_note,
    copied,
    environment,
    fake_peak,
    finish_rows,
    identity,
    stopped,
    write_results,
)
from throughput_runs import MODES, SHAPES, WORKLOADS, Mode, Run, configure
from throughput_workload import (
    attention_check,
    matmul_peak,
    missing,
    profiled_step,
    quantize_linears,
    synthetic_examples,
)

from sftjob.config import TrainingSettings
from sftjob_trainer.attention import FLATTENED, VARLEN, kernel_backend
from sftjob_trainer.batching import Layout, Schedule, StepBatches, make_units
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.data import Example
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.flops import FlopsModel, flops_model
from sftjob_trainer.liger import liger_kernels_in
from sftjob_trainer.loop import build_optimizer, build_scheduler, make_scaler, train_step
from sftjob_trainer.model import precision_plan, prepare_for_training, resolve_attention

GIB = 1024**3


def build_model(
    run: Run, mode: Mode, t: TrainingSettings, device: torch.device, attention: str
) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[run.model].to_hf_config(), max_position_embeddings=8192)
    precision = precision_plan(run.method, t.precision)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=precision.load_dtype, attn_implementation=attention
        )
    if run.method == "qlora":
        quantize_linears(model, precision.compute_dtype)
    return prepare_for_training(model, run.method, mode.workload.lora, t, device), config.to_dict()


def measure(
    run: Run,
    mode: Mode,
    device: torch.device,
    examples: dict[int, list[Example]],
    peak: float | None,
    row: dict[str, Any],
    profile: Path | None = None,
    deadline: float | None = None,
) -> None:
    """Train the run's steps, writing into ``row`` after each one what the steps so far measured: an
    interrupt (the time limit) keeps it. Past ``deadline`` (``perf_counter``) it stops after a step, once
    one was timed, as ``partial``. ``profile``: then one more warm micro-batch and optimizer step under
    the profiler."""
    t, fields = configure(run, mode)
    row |= fields
    if row.get("planFits") is False:
        row |= {"status": "skipped", "note": "the planner found no configuration that fits"}
        return
    if run.method == "qlora" and (device.type != "cuda" or missing("bitsandbytes")):
        row |= {"status": "skipped", "note": "QLoRA needs a CUDA GPU and bitsandbytes"}
        return
    if t.liger_kernels and (device.type != "cuda" or missing("liger_kernel")):
        row["note"] = "Liger kernels not available here: ran without them"
    attention = resolve_attention(t.attention, device, t.packing)  # as the trainer does
    row["attention"] = attention
    if attention == VARLEN:
        row["attentionKernel"] = kernel_backend(device)
    model, hf_config = build_model(run, mode, t, device, attention)
    row["ligerKernels"] = liger_kernels_in(getattr(model, "get_base_model", lambda: model)())
    ctx = DistContext(0, 1, 0, 1, device)
    optimizer = build_optimizer(model, t, device)
    precision = precision_plan(run.method, t.precision)
    parts = Trainables(
        model, optimizer, build_scheduler(optimizer, t, mode.steps), make_scaler(precision, device)
    )
    units = make_units(examples[SHAPES[run.model].vocab_size], t.packing_length if t.packing else None)
    schedule = Schedule(len(units), t.micro_batch_size, t.gradient_accumulation_steps, 1, t.seed)
    layout = Layout(t.packing, flatten=attention in FLATTENED, pad_id=0)
    batches = StepBatches(units, schedule, layout, 0, 0, mode.steps)
    steps = [batches[i] for i in range(mode.steps)]
    flops = flops_model(hf_config, run.method, 0)
    timed = {"steps": 0.0, "seconds": 0.0, "tokens": 0.0, "pairs": 0.0}
    if device.type == "cuda":  # the training peak, not building the model (QLoRA builds it in bf16 first)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    for i, micro_batches in enumerate(steps):
        started = time.perf_counter()
        result = train_step(parts, micro_batches, precision, t.max_grad_norm, ctx)
        if device.type == "cuda":  # train_step's own sync comes before the optimizer step: wait for it too
            torch.cuda.synchronize()
        if i >= mode.discard:
            timed["steps"] += 1
            timed["seconds"] += time.perf_counter() - started
            timed["tokens"] += result.tokens
            timed["pairs"] += result.attention_pairs
        row |= {"stepsDone": i + 1, "lastLoss": round(result.loss, 4)} | so_far(device, timed, flops, peak)
        if mode.fake_peak:
            row |= fake_peak(row)
        if deadline and timed["steps"] and i + 1 < mode.steps and time.perf_counter() > deadline:
            row["status"] = "partial"  # and no profile: the next run needs the time
            add_note(
                row, f"stopped by --run-seconds {mode.run_seconds:g} after {i + 1} of {mode.steps} steps"
            )
            return
    row["status"] = "ok"
    if profile is not None:  # one micro-batch: a whole 7B LoRA step is ~600k events
        step = functools.partial(train_step, parts, steps[-1][:1], precision, t.max_grad_norm, ctx)
        try:
            profiled_step(profile, step)
        except Exception as exc:
            add_note(row, f"no profile: {type(exc).__name__}: {str(exc)[:200]}")
        except KeyboardInterrupt:
            add_note(row, "profile cut short by the time limit")
            raise


def so_far(
    device: torch.device, timed: dict[str, float], flops: FlopsModel, peak: float | None
) -> dict[str, Any]:
    """The row's numbers after a step: peak memory since the first step, and the timed steps' rates."""
    numbers: dict[str, Any] = {"timedSteps": int(timed["steps"])}
    if device.type == "cuda":  # a few microseconds: the allocator's own counters
        numbers |= {
            "peakGiB": round(torch.cuda.max_memory_allocated(device) / GIB, 2),
            "peakReservedGiB": round(torch.cuda.max_memory_reserved(device) / GIB, 2),
        }
    if timed["seconds"] > 0:
        rate, pairs_rate = timed["tokens"] / timed["seconds"], timed["pairs"] / timed["seconds"]
        numbers |= {
            "tokensPerSecond": round(rate, 1),
            "mfu": round(flops.per_token * rate / peak, 4) if peak else None,
            "mfuWithAttention": round(flops.step_flops(rate, pairs_rate) / peak, 4) if peak else None,
        }
    return numbers


def llama_namespace() -> dict[str, Any]:
    """The Llama modeling module's namespace, whose functions Liger patches: saved before a run and
    restored after it, so the next run starts unpatched."""
    import transformers.models.llama.modeling_llama as llama

    return vars(llama)


def run_isolated(
    run: Run,
    mode: Mode,
    device: torch.device,
    examples: dict[int, list[Example]],
    peak: float | None,
    card_gib: float | None,
    row: dict[str, Any],
    profile: Path | None = None,
) -> None:
    """One configuration into ``row`` (its ``identity`` already); its failure (OOM or otherwise) becomes
    the row, and memory is freed after. An interrupt (the time limit) marks the row and goes on up, to
    end the benchmark."""
    started = time.perf_counter()
    deadline = started + mode.run_seconds if mode.run_seconds else None
    namespace: dict[str, Any] | None = None
    patched: dict[str, Any] = {}
    try:
        namespace = llama_namespace()
        patched = dict(namespace)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            if run.cap_gib and card_gib:
                torch.cuda.set_per_process_memory_fraction(min(1.0, run.cap_gib / card_gib), device)
        measure(run, mode, device, examples, peak, row, profile, deadline)
    except torch.OutOfMemoryError as exc:
        row |= {"status": "oom", "note": f"out of memory: {str(exc).splitlines()[0][:200]}"}
    except Exception as exc:  # record and go on to the next configuration
        row |= {
            "status": "error",
            "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
        }
    except KeyboardInterrupt:
        stopped(row, mode.steps)
        raise
    finally:
        if namespace is not None:
            namespace.clear()
            namespace.update(patched)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        row["wallSeconds"] = round(time.perf_counter() - started, 1)
        print(
            f"{run.name}: {row.get('status')} {row.get('tokensPerSecond', '')} tokens/s"
            f" mfu {row.get('mfu')} peak {row.get('peakGiB')} GiB {row.get('note', '')}",
            flush=True,
        )


def arguments(argv: list[str] | None) -> tuple[str, Mode, argparse.Namespace]:
    """The mode's name, the mode as the flags change it, and the flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="CPU, tiny model, 2 steps (CI)")
    size.add_argument("--quick", action="store_true", help="GPU, 8 steps (3 discarded), accumulation <= 2")
    parser.add_argument(
        "--plans", action="store_true", help="planned configs, 20 steps, peak vs estimate (with --tiny: CPU)"
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="",
        default=None,
        metavar="REGEX",
        help="write a profiler table of one micro-batch per run (or per run matching REGEX)",
    )
    parser.add_argument("--run-seconds", type=float, default=None, help="stop a run past this wall time")
    parser.add_argument(
        "--fake-peak", action="store_true", help="with --tiny only: a made-up peak, so the verdicts run"
    )
    parser.add_argument(
        "--max-accumulation", type=int, default=None, help="cap every run's accumulation (like for like)"
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="issue",
        help="sample lengths and LoRA dropout: issue 8's (8..4096, 0.05) or the anchors' (32..2048, 0)",
    )
    parser.add_argument("--only", default=None, help="regex on run names, e.g. '1.1B/full' or 'planned'")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.plans and args.quick:
        parser.error("--plans has its own step counts: not with --quick")
    if args.fake_peak and not args.tiny:  # a made-up peak must never reach a GPU's results
        parser.error("--fake-peak is for the CPU dry run only: it needs --tiny")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA GPU: use --tiny for the CPU check")
    sized = "tiny" if args.tiny else "quick" if args.quick else "full"
    name = {"tiny": "tiny-plans", "full": "plans"}[sized] if args.plans else sized
    mode = dataclasses.replace(
        MODES[name].with_workload(args.workload), run_seconds=args.run_seconds, fake_peak=args.fake_peak
    )
    if args.max_accumulation is not None:
        mode = dataclasses.replace(mode, max_accumulation=args.max_accumulation)
    return name, mode, args


def main(argv: list[str] | None = None) -> int:
    # `timeout --signal=INT` must stop a run cleanly also where SIGINT was ignored at the start (a command
    # started in the background without job control), and so must a SIGTERM: both raise KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    mode_name, mode, args = arguments(argv)
    try:
        return run_all(mode_name, mode, args)
    except KeyboardInterrupt:  # a stop in a run is caught there: this one came while starting up
        print("interrupted before the first run began: no rows to write", flush=True)
        return 130


def run_all(mode_name: str, mode: Mode, args: argparse.Namespace) -> int:
    """The runs, their rows written after each one; 130 if the time limit stopped one."""
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    torch.set_float32_matmul_precision("high")
    card_gib = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    card = round(card_gib, 1) if card_gib else None
    peak = matmul_peak(device)
    runs = [r for r in mode.runs if args.only is None or re.search(args.only, r.name)]
    w = mode.workload
    examples = {
        v: synthetic_examples(mode.samples, mode.median, w.shortest, w.longest, v)
        for v in {SHAPES[r.model].vocab_size for r in runs}
    }
    meta = environment(device, peak, mode_name, mode.steps, mode.discard, mode.max_accumulation)
    meta |= {"workload": w.describe(), "runSeconds": mode.run_seconds, "fakePeak": mode.fake_peak}
    meta["attentionSelfCheck"] = attention_check(device)
    print(f"attention self-check: {meta['attentionSelfCheck']}; workload {meta['workload']}", flush=True)
    stem = (
        f"trainer-throughput-{mode_name}"
        + (f"-accum{args.max_accumulation}" if args.max_accumulation else "")
        + (f"-{w.name}" if args.workload != "issue" else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    measured: dict[str, tuple[Run, dict[str, Any]]] = {}  # A40 and L40S plans are often the same
    for run in runs:
        row = identity(run, card)  # first: a stop from here on leaves a row that says which run it was
        rows.append(row)
        try:
            settings, fields = configure(run, mode)
            key = f"{run.model}/{run.method}/{run.cap_gib}/{settings}"
            if key in measured:
                row |= copied(*measured[key], run, fields)
            else:
                measured[key] = (run, row)
                wanted = args.profile is not None and re.search(args.profile, run.name)
                profile = args.out / f"{stem}-profile-{re.sub(r'[^A-Za-z0-9.]+', '-', run.name)}.txt"
                run_isolated(run, mode, device, examples, peak, card, row, profile if wanted else None)
            paths = save(rows, meta, args.out, stem)  # after every run: a session cut short keeps them
        except KeyboardInterrupt:  # the time limit: keep this run's row, write, stop
            stopped(row, mode.steps)
            save(rows, meta, args.out, stem)
            print("interrupted: the rows so far are written", flush=True)
            return 130
    print("wrote " + ", ".join(str(p) for p in paths) if rows else "no run matched --only")
    return 0 if any(r.get("status") in ("ok", "partial") for r in rows) else 1  # numbers, at least


def save(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, stem: str) -> list[Path]:
    finish_rows(rows, meta["gpu"])
    return write_results(rows, meta, out, stem)


if __name__ == "__main__":
    sys.exit(main())
