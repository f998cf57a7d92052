"""LoRA adapters on the language model, and what of a model is not the language model.

``lora.targetModules`` names layers, and ``all-linear`` means the linear layers peft's would take in a dense
model, but the fused experts and router of a mixture (far more than the planner counts). A multimodal
model (Gemma 3, loaded as ``Gemma3ForConditionalGeneration``) also holds towers text never reaches: they get
no adapters; full fine-tuning keeps them trainable without a gradient, which DDP is told to expect.
Each name of an explicit ``targetModules`` must reach one of the language model's layers: peft itself
refuses only a list none of which matches (Phi-3's fused ``qkv_proj`` where ``q_proj`` was named).
"""

from __future__ import annotations

import logging
import re
from typing import Any, cast

import torch

from sftjob.config import LoraSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.failures import adapter_target_error

log = logging.getLogger(__name__)


def add_adapters(model: Any, lora: LoraSettings, seed: int, revision: str | None) -> Any:
    """The peft model with LoRA adapters, initialised from ``seed`` alone (lora_A drawn as peft draws it,
    lora_B zeros), whatever drew from the global RNG before, which is left as it was.

    LoRA under FSDP adds them to a model without weights on every rank and to rank 0's loaded copy
    (:func:`pretrained_weights`), whose values are broadcast into the shards: the same adapters as one
    process starts from.

    Only the language model gets adapters, not a multimodal model's towers (:func:`outside_language_model`,
    peft's ``exclude_modules``), and each name of an explicit ``lora.targetModules`` must reach one of its
    layers: else the spec is wrong (a fused ``qkv_proj`` where ``q_proj`` was named).
    """
    from peft import LoraConfig, NoMatchingPeftModuleError, get_peft_model

    all_linear = lora.target_modules == "all-linear"
    offered = linear_layer_names(model)  # before peft replaces the layers
    outside = outside_language_model(model)
    adapters = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=offered if all_linear else lora.target_modules,
        exclude_modules=_subtrees_pattern(outside) if outside else None,
        task_type="CAUSAL_LM",
    )
    # peft draws on the CPU; manual_seed reseeds the GPUs too, so their states are kept as well.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            adapted = get_peft_model(model, adapters, revision=revision)
        except ValueError as exc:  # a typo in spec.lora.targetModules fails the job, not each attempt
            if (error := adapter_target_error(exc, lora.target_modules)) is not None:
                raise error from exc
            if isinstance(exc, NoMatchingPeftModuleError) and not all_linear:  # only the towers' layers
                raise _unmatched_targets(list(lora.target_modules), offered) from exc
            raise
    if not all_linear:
        # Names peft turned into a mixture's expert tensors are no longer among its target_modules.
        kept = set(cast(LoraConfig, adapted.peft_config["default"]).target_modules or ())
        wrapped = adapted.targeted_module_names
        missing = [t for t in lora.target_modules if t in kept and not _reaches(t, wrapped)]
        if missing:
            raise _unmatched_targets(missing, offered)
    return adapted


def _reaches(target: str, modules: list[str]) -> bool:
    """Whether a ``targetModules`` name matches one of ``modules``, as peft matches a name in a list."""
    return any(name == target or name.endswith(f".{target}") for name in modules)


def _unmatched_targets(missing: list[str], offered: list[str]) -> TrainerError:
    return TrainerError(
        ExitCode.CONFIG_ERROR,
        f"spec.lora.targetModules {missing} match no layer of the model's language model: name some of its"
        f" linear layers, {offered}, or use all-linear",
    )


def outside_language_model(model: Any) -> list[str]:
    """The modules of a multimodal model that are neither its language model (``get_decoder``) nor its
    output head, outermost only: Gemma 3's ``model.vision_tower`` and ``model.multi_modal_projector``.
    None for a text-only model, whose decoder and head hold everything. Text never reaches them: their
    parameters get no gradient."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):  # a model's own code may lack it or refuse it
        return []
    names = {id(module): name for name, module in model.named_modules()}
    if not names.get(id(decoder)):  # the model itself, or none of its modules: nothing to tell apart
        return []
    text = [n for n in (names[id(decoder)], names.get(id(model.get_output_embeddings()))) if n]
    outside: list[str] = []
    for name in names.values():  # parents before their children
        if (
            name
            and not _within(name, outside)
            and not any(_within(name, [t]) or _within(t, [name]) for t in text)
        ):
            outside.append(name)
    return outside


def _within(name: str, roots: list[str]) -> bool:
    return any(name == root or name.startswith(f"{root}.") for root in roots)


def _subtrees_pattern(roots: list[str]) -> str:
    """A regular expression peft matches in full against module names: ``roots`` and all they hold."""
    return f"(?:{'|'.join(re.escape(root) for root in roots)})(?:\\..*)?"


def towers_in_training(model: Any) -> bool:
    """Whether a multimodal model's towers hold trainable parameters (full fine-tuning trains every weight):
    text never reaches them, so they get no gradient, which DDP must be told to expect. They stay trainable
    rather than frozen so that a full fine-tune's checkpoint holds every weight under any layout: a resume
    under FSDP loads no pretrained weights, only the checkpoint."""
    outside = outside_language_model(model)
    return any(p.requires_grad for name in outside for p in model.get_submodule(name).parameters())


def linear_layer_names(model: Any) -> list[str]:
    """What ``all-linear`` adapts: the linear layers (``nn.Linear``, ``Linear4bit`` subclasses it, GPT-2's
    ``Conv1D``) but the head, by name (by path where another module has the name), as peft's ``all-linear``
    in a dense model. Of a mixture (Mixtral, Qwen3-MoE, OLMoE) peft's would also take the fused experts and
    router, without dropout and far more than the planner counts (``Architecture.lora_widths``). Of a
    multimodal model, those of its language model only (:func:`outside_language_model`)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    outside = outside_language_model(model)
    modules = {n: m for n, m in model.named_modules() if not _within(n, outside)}
    linear = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear | Conv1D) and m is not head}
    leaf = {n: n.rpartition(".")[2] for n in modules}
    elsewhere = {leaf[n] for n in modules if n not in linear}
    return sorted({n if leaf[n] in elsewhere else leaf[n] for n in linear})
