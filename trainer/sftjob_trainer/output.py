"""The trained model as the user takes it away: whole or not at all, only from the attempt that owns the
job, and stopping where its answers end.

Rank 0 writes the output (the adapter or the model, the tokenizer, ``summary.json`` last) into a
temporary folder, ``.tmp-<name>-attempt-A``, fsyncs it and makes it readable by any user (safetensors
writes its files 0600: a serving pod running as another user could not read them). Every rank then
checks that this attempt still owns the job's checkpoint folder (``ownership.check_owner``: a
superseded attempt still running commits nothing), and rank 0 puts the folder in place. A kill leaves
the previous output or the new one whole, never a config beside a cut-off weight file (or, between
moving an earlier output aside and renaming the new one, none: the restart writes it again);
``summary.json`` marks a complete output.

The output folder is replaced whole (the temporary folder beside it, renamed over it) when it is the
job's own: new, holding only the train log (``train_log.jsonl``, written there as the run trains, and
carried over), or an earlier output of a job of this namespace and name (a restart after the output was
written, or the job deleted and created again). Any other folder (a volume's root, the checkpoint folder,
a folder holding other files) keeps its other files: the temporary folder is made inside it and its files
moved out one by one, ``summary.json`` set aside first and put back last. When it held an earlier output
(its ``summary.json`` was there), that output's model and tokenizer files (:data:`MODEL_FILES`) and its
merged model are removed first, as they would load along with the new ones: a stale
``adapter_config.json`` beside a full model applies the old adapter to it. Without one, a user's files of
those names stay, except those the new output writes.

With ``mergeAdapter``, the adapter's output also holds the base with the adapter merged in, in its
``merged`` folder (:mod:`sftjob_trainer.merging`), written into the temporary folder with the rest.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from sftjob.config import JobRef, TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import merging, ownership, strict_json
from sftjob_trainer.chat import answer_end_token
from sftjob_trainer.distributed import DistContext, shards, unwrap
from sftjob_trainer.durable import TMP_PREFIX, fsync_dir
from sftjob_trainer.failures import os_error, storage_failure
from sftjob_trainer.model import precision_plan
from sftjob_trainer.observer import TRAIN_LOG_FILE

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"  # written last: the output is complete when it is there
FILE_MODE, DIR_MODE = 0o644, 0o755  # readable by a serving pod's user, whatever its uid
# What save_pretrained writes for a model, an adapter (peft) and a tokenizer, by exact name: an earlier
# output's are removed from a folder that is not the job's own before the new output's files are moved in.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model-*-of-*.bin",
    "pytorch_model.bin.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# A BPE tokenizer's vocabulary (a slow GPT-2-style tokenizer's save): an earlier output's only beside its
# tokenizer_config.json.
BPE_FILES = ("vocab.json", "merges.txt")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The earlier output's summary.json while the new output moves in: a kill before its files are gone leaves
# the restart knowing they are an output's.
EARLIER_SUMMARY_FILE = f"{TMP_PREFIX}earlier-{SUMMARY_FILE}"
GENERATION_CONFIG_FILE = "generation_config.json"


def check_owner(config: TrainerConfig, ctx: DistContext) -> None:
    """Collective: stop (PREEMPTED) before gathering the weights when another attempt owns the job now."""
    ownership.check_owner(Path(config.checkpoints.dir), config.job, ctx, "without saving its output")


def write_model(
    config: TrainerConfig, ctx: DistContext, model: torch.nn.Module, tokenizer: Any, summary: dict[str, Any]
) -> Path:
    """Collective: the model (gathered from the shards under FSDP: only the adapters of a LoRA run) and
    ``summary.json``, as :func:`save` and :func:`save_output` write them, after checking that this attempt
    still owns the job (:func:`check_owner`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    check_owner(config, ctx)
    state_dict = None
    full = config.method == "full"
    if shards(config, ctx):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not full)
        state_dict = _tied_once(get_model_state_dict(model, options=options), unwrap(model))
    dtype = precision_plan(config.method, config.training.precision).compute_dtype if full else None

    def write(folder: Path) -> None:
        save_output(unwrap(model), tokenizer, folder, state_dict, dtype)
        if config.merge_adapter:
            merged = folder / merging.MERGED_FOLDER
            merged.mkdir()
            save_output(
                merging.merged_model(config, folder), tokenizer, merged, None, merging.merge_dtype(config)
            )

    if config.merge_adapter:
        summary = summary | {"mergedModel": merging.MERGED_FOLDER}
    return save(config, ctx, summary, write)


def save(
    config: TrainerConfig, ctx: DistContext, summary: dict[str, Any], write: Callable[[Path], None]
) -> Path:
    """Collective: every rank calls it, rank 0 calls ``write(folder)`` to put the model and tokenizer
    into a folder. Returns the output folder."""
    out, job = Path(config.output_dir), config.job
    whole = ctx.is_main and replaceable(out, Path(config.checkpoints.dir), job)  # rank 0 alone writes
    tmp = (out.parent if whole else out) / f"{TMP_PREFIX}{out.name}-attempt-{job.attempt}"
    try:
        if ctx.is_main:
            if config.merge_adapter and not whole:
                _check_merged_place(out)
            _remove_unfinished(out)  # a killed attempt's, which may hold a whole merged model: its space back
            _write_aside(tmp, out if whole else None, summary | {"job": _identity(job)}, write)
        # Writing a 70B model takes longer than a collective may wait (PROCESS_GROUP_TIMEOUT): the other
        # ranks wait for rank 0 in the setup group instead, as for its download.
        ctx.wait_for_rank0()
        ownership.check_owner(
            Path(config.checkpoints.dir), job, ctx, "without committing its output", discard=tmp
        )
        if ctx.is_main:
            (_replace if whole else _move_into)(tmp, out)
            _remove_unfinished(out)
            log.info("saved the %s to %s", "model" if config.method == "full" else "adapter", out)
        ctx.wait_for_rank0()
    except OSError as exc:
        raise storage_failure(exc, f"could not save the output to {out}", out) from exc
    return out


def _write_aside(
    tmp: Path, replaced: Path | None, summary: dict[str, Any], write: Callable[[Path], None]
) -> None:
    """The whole output in ``tmp``, ``summary.json`` last, with the train log of the folder it replaces; a
    failed write leaves nothing there (its files would take the space a restart after a full disk needs)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if replaced is not None and (replaced / TRAIN_LOG_FILE).is_file():
            shutil.copyfile(replaced / TRAIN_LOG_FILE, tmp / TRAIN_LOG_FILE)
        (tmp / SUMMARY_FILE).write_text(strict_json.dumps(summary, indent=2) + "\n")
        _readable_and_synced(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replaceable(out: Path, checkpoint_dir: Path, job: JobRef) -> bool:
    """Whether the output folder is the job's own, to be replaced whole (see the module's docstring): an
    earlier output of a job of the same namespace and name is, whatever its uid."""
    resolved, holds_checkpoints = out.resolve(), checkpoint_dir.resolve()
    if resolved == holds_checkpoints or resolved in holds_checkpoints.parents or os.path.ismount(out):
        return False
    if not out.exists():
        return True
    if {p.name for p in out.iterdir()} <= {TRAIN_LOG_FILE}:
        return True
    try:
        earlier = json.loads((out / SUMMARY_FILE).read_text())["job"]
        return (earlier["namespace"], earlier["name"]) == (job.namespace, job.name)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _identity(job: JobRef) -> dict[str, str]:
    """What says whose output a folder holds (in ``summary.json``): the attempt does not matter."""
    return {"namespace": job.namespace, "name": job.name, "uid": job.uid}


def _readable_and_synced(folder: Path) -> None:
    for parent, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = Path(parent) / name
            path.chmod(FILE_MODE)
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
        for name in dirs:
            (Path(parent) / name).chmod(DIR_MODE)
        fsync_dir(Path(parent))
    folder.chmod(DIR_MODE)


def _remove_unfinished(out: Path) -> None:
    """Other attempts' unfinished outputs (killed, or superseded), beside ``out`` or inside it."""
    unfinished = re.compile(rf"{re.escape(TMP_PREFIX + out.name)}-attempt-\d+(-replaced)?")
    for where in (out.parent, out):
        if not where.is_dir():
            continue
        for path in where.iterdir():
            if unfinished.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, after moving an earlier ``out`` away (renamed, then deleted)."""
    earlier = tmp.with_name(f"{tmp.name}-replaced")
    if out.exists():
        shutil.rmtree(earlier, ignore_errors=True)
        os.rename(out, earlier)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(earlier, ignore_errors=True)


def _move_into(tmp: Path, out: Path) -> None:
    """Move each file of ``tmp`` (a folder inside ``out``) into ``out``, ``summary.json`` last, after
    removing an earlier output's model and tokenizer files when one was there."""
    earlier = out / EARLIER_SUMMARY_FILE
    if (out / SUMMARY_FILE).is_file():
        os.replace(out / SUMMARY_FILE, earlier)
        fsync_dir(out)
    if earlier.is_file():
        _remove_earlier_output(out)
    for path in tmp.iterdir():
        if path.name != SUMMARY_FILE:
            if (out / path.name).is_dir() and not (out / path.name).is_symlink():  # a folder of that name
                shutil.rmtree(out / path.name)  # rename replaces only an empty one
            os.replace(path, out / path.name)
    fsync_dir(out)
    os.replace(tmp / SUMMARY_FILE, out / SUMMARY_FILE)
    fsync_dir(out)
    earlier.unlink(missing_ok=True)
    tmp.rmdir()


def _remove_earlier_output(out: Path) -> None:
    """The merged model (first, when the earlier output wrote one), and the model and tokenizer files of
    the earlier output in ``out`` (:data:`MODEL_FILES`), its tokenizer_config.json last: what says the BPE
    files are the output's until they are gone."""
    merged = out / merging.MERGED_FOLDER
    if _earlier_merged(out) and merged.is_dir() and not merged.is_symlink():
        log.warning("removing the merged model of an earlier output from %s", out)
        shutil.rmtree(merged)
    patterns = MODEL_FILES + (BPE_FILES if (out / TOKENIZER_CONFIG_FILE).is_file() else ())
    found = {p for pattern in patterns for p in out.glob(pattern) if p.is_file()}
    files = sorted(found, key=lambda p: (p.name == TOKENIZER_CONFIG_FILE, p.name))
    if not files:
        return
    log.warning("removing the files of an earlier output from %s: %s", out, ", ".join(p.name for p in files))
    for path in files:
        path.unlink()
    fsync_dir(out)


def _earlier_merged(out: Path) -> bool:
    """Whether the earlier output in ``out`` (its ``summary.json``, or the one set aside while an output
    moves in) wrote a merged model."""
    for name in (EARLIER_SUMMARY_FILE, SUMMARY_FILE):
        try:
            return "mergedModel" in json.loads((out / name).read_text())
        except (OSError, ValueError, TypeError):
            continue
    return False


def _check_merged_place(out: Path) -> None:
    """Before a merged model moves into a folder that is not the job's own: what holds its name there must
    be an earlier output's merged model (replaced), not a user's folder, file or link (CONFIG_ERROR)."""
    place = out / merging.MERGED_FOLDER
    if not os.path.lexists(place):
        return
    if place.is_dir() and not place.is_symlink() and _earlier_merged(out):
        return
    raise TrainerError(
        ExitCode.CONFIG_ERROR,
        f"{place} is in the way of the merged model (output.mergeAdapter) and is no earlier output's merged"
        " model: move it away, or choose another output.path",
    )


def save_output(
    model: Any, tokenizer: Any, folder: Path, state_dict: dict[str, Any] | None, dtype: torch.dtype | None
) -> None:
    """The adapter (LoRA/QLoRA) or the whole model, with the tokenizer, as save_pretrained writes them,
    into ``folder`` (output.py makes it the output once complete).

    A fully fine-tuned model is written in ``dtype``, the precision it trained in (bf16 in every plan),
    like the base it came from, rather than as its fp32 master weights: half the disk, and a config
    whose ``dtype`` says what the files hold (save_pretrained would write the parameters' fp32). Tensors
    are converted one at a time on the CPU, tied ones once; those the model keeps in fp32 in that dtype
    (:func:`_kept_in_fp32`: a router's ``e_score_correction_bias``) stay fp32, as the base ships them.

    A disk that fails under safetensors (which raises its own error, ``... (os error 28)``) is a storage
    error, as it is under any other writer.
    """
    stops = _stops_with_answer_end(model, tokenizer)
    generation = folder / GENERATION_CONFIG_FILE
    try:
        if dtype is not None:
            state_dict = state_dict if state_dict is not None else model.state_dict()
            state_dict = _converted(state_dict, dtype, _kept_in_fp32(model, dtype))
        model.save_pretrained(folder, state_dict=state_dict)
        if dtype is not None:
            model.config.dtype = dtype
            model.config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if stops is not None and generation.exists():
            _set_eos(generation, stops)
    except (OSError, SafetensorError) as exc:
        error = os_error(exc)
        if error is None:
            raise
        raise storage_failure(error, f"could not save the output to {folder}", folder) from exc
    if stops is None:
        return
    name = f"{tokenizer.convert_ids_to_tokens(stops[-1])} (id {stops[-1]})"
    if generation.exists():
        log.info("answers end with %s: added to eos_token_id in the output's generation_config.json", name)
    else:  # an adapter: served with its base's generation config
        log.warning(
            "answers end with %s, which the base's generation config does not stop at: set it as"
            " an eos/stop token id when generating with the adapter",
            name,
        )


def _stops_with_answer_end(model: Any, tokenizer: Any) -> list[int] | None:
    """A model trained on chats ends its answers with the template's turn-end token (Llama 3 base:
    ``<|eot_id|>``, where its generation config stops at ``<|end_of_text|>``): the generation config's
    ``eos_token_id`` with it added, so that generate() and vLLM stop after an answer; None when it is there
    already."""
    end = answer_end_token(tokenizer)
    generation = getattr(model, "generation_config", None)
    if end is None or generation is None:
        return None
    eos = generation.eos_token_id
    stops = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return None if end in stops else [*stops, end]


def _set_eos(path: Path, stops: list[int]) -> None:
    """Set ``eos_token_id`` in the generation config save_pretrained wrote, as a JSON edit: the model's own
    config is left as loaded, since transformers validates a changed one strictly on save, and a base that
    ships sampling values without ``do_sample`` (``temperature``, ``top_p``) would then fail the save."""
    saved = json.loads(path.read_text())
    saved["eos_token_id"] = stops
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _tied_once(state_dict: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """A gathered (FSDP) state dict with each tied parameter's keys on one tensor, as in the model:
    ``get_model_state_dict`` gathers every key separately, and save_pretrained, which drops a tied copy
    only when it shares its storage, would write a tied head (``lm_head.weight``) beside the embeddings."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = first.setdefault(id(param), name)
        if key != name and key in state_dict and name in state_dict:
            state_dict[name] = state_dict[key]
    return state_dict


def _kept_in_fp32(model: Any, dtype: torch.dtype) -> re.Pattern[str] | None:
    """What from_pretrained keeps in fp32 when it loads the model in ``dtype``, matched as it matches them
    (a search of each name, ``*`` for any characters): ``_keep_in_fp32_modules_strict`` in bf16 and fp16
    (GLM-4.5 MoE's and DeepSeek-V3's ``e_score_correction_bias``), ``_keep_in_fp32_modules`` in fp16 only
    (gpt-oss's). None when nothing is."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype not in (torch.float16, torch.bfloat16) or not names:
        return None
    return re.compile("|".join(name.replace("*", ".*") for name in sorted(names)))


def _converted(
    state_dict: dict[str, Any], dtype: torch.dtype, fp32: re.Pattern[str] | None
) -> dict[str, Any]:
    """The floating-point tensors of ``state_dict`` in ``dtype`` on the CPU, those whose names ``fp32``
    matches in float32."""
    done: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # state_dict() detaches ties
    for name, tensor in state_dict.items():
        if tensor.is_floating_point():
            to = torch.float32 if fp32 is not None and fp32.search(name) else dtype
            key = (tensor.data_ptr(), tuple(tensor.shape), to)
            if key not in done:
                done[key] = tensor.detach().to("cpu", to)
            state_dict[name] = done[key]
    return state_dict
