"""Loading the tokenizer and the base model, and making it trainable as the plan says.

Precision policy: full fine-tuning keeps fp32 master weights and runs the maths under autocast
(bf16/fp16, the latter with a gradient scaler); LoRA keeps the frozen base in the compute dtype with
fp32 adapters under autocast; QLoRA stores the base in 4-bit NF4 (bitsandbytes, GPU only).
Full fine-tuning and LoRA under FSDP build the model without weights on every rank, and rank 0 alone
loads them (:func:`build_model`, :func:`pretrained_weights`). Liger kernels and the attention
implementation are speed choices: when they are not available the trainer says so in the log and
continues without them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from sftjob.config import LoraSettings, Method, ModelSource, Precision, TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import attention, remote_code
from sftjob_trainer.adapters import add_adapters
from sftjob_trainer.failures import causes, load_failure
from sftjob_trainer.liger import apply_liger

log = logging.getLogger(__name__)

COMMIT = re.compile(r"[0-9a-f]{40}")  # a git commit as the hub names it
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionPlan:
    compute_dtype: torch.dtype  # what matmuls run in
    load_dtype: torch.dtype  # what the model's weights are stored in
    autocast: bool
    grad_scaler: bool


def precision_plan(method: Method, precision: Precision) -> PrecisionPlan:
    compute = _DTYPES[precision]
    half = compute != torch.float32
    load = torch.float32 if method == "full" else compute
    return PrecisionPlan(compute, load, autocast=half, grad_scaler=precision == "fp16")


def resolve_model_class(model_config: Any, packing: bool, source: ModelSource) -> tuple[Any, bool]:
    """The class the model loads as, its code fetched from ``source`` for remote code, and whether its
    rows may be packed, checked before the data is read (remote_code.py): code needing a package the image
    lacks is a ConfigError naming it. A model that runs with eager attention whatever the data (its
    attention its own, no SDPA, soft-capped logits) and whose eager masks are not known to keep packed
    examples apart is trained on padded batches instead, with a warning: packing only saves time, and its
    packed examples would attend to each other (:func:`resolve_attention` checks again once the longest
    example is known, and refuses then)."""
    try:
        found = remote_code.causal_lm_class(model_config, _model_ref(source), **_hub_kwargs(source))
    except Exception as exc:
        raise _load_error("model code", source, exc) from exc
    if found is None:  # a vision-language model's own class (Qwen2.5-VL, Mistral 3), an encoder...
        from transformers import __version__

        raise TrainerError(
            ExitCode.MODEL_LOAD_ERROR,
            f"{model_config.model_type} has no causal-LM class in transformers {__version__}: sftjob trains"
            " causal language models",
        )
    reason = attention.eager_reason(model_config, found, None)
    problem = attention.packed_eager_problem(model_config, found) if packing and reason else None
    if problem is not None:
        log.warning(
            "packing off: %s, and this model runs with eager attention (%s), so packed examples would attend"
            " to each other: training on padded batches instead (the same examples and loss, slower; set"
            " spec.training.packing: false to plan for it)",
            problem,
            reason,
        )
    return found, packing and problem is None


def resolve_attention(
    requested: str,
    device: torch.device,
    packing: bool,
    model_config: Any = None,
    longest_example: int | None = None,
    model_class: Any = None,
) -> str:
    """The ``attn_implementation`` to load: packed SDPA runs become varlen attention (no dense mask); a
    model whose attention SDPA does not compute exactly (``model_config``, a transformers config), whose
    class has no SDPA attention, or (packed) whose attention is its own code and never sees the examples'
    boundaries, eager. Packed rows under eager attention (chosen here or planned) are a ConfigError
    unless the model's eager masks keep the examples apart (``attention.packed_eager_problem``).
    ``model_class`` is the one :func:`resolve_model_class` found; without it, transformers' class for
    ``model_config``.
    """
    model_class = model_class or remote_code.causal_lm_class(model_config)
    if requested == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if device.type != "cuda" or not is_flash_attn_2_available():
            log.warning("attention flash_attention_2 planned but not available here: using sdpa")
            requested = "sdpa"
    reason = attention.eager_reason(model_config, model_class, longest_example if packing else None, packing)
    chosen = "eager" if requested == "sdpa" and reason is not None else requested
    if packing and chosen == "eager":
        attention.check_packed_eager(model_config, model_class, reason or "as planned")
    if chosen != requested:
        log.warning(
            "attention sdpa planned, but %s: using eager attention%s",
            reason,
            " (its mask keeps packed examples apart: a block-diagonal mask from their position_ids)"
            if packing
            else "",
        )
    if packing and chosen == "sdpa":
        attention.register()
        dropout = attention.attention_dropout(model_config) if model_config is not None else 0.0
        log.info(
            "packed rows: attention %s (%s), examples kept apart without a mask",
            attention.VARLEN,
            attention.kernel_backend(device, dropout),
        )
        return attention.VARLEN
    return chosen


def check_positions(model_config: Any, longest_example: int) -> None:
    """Warns when the longest example (after cutting) runs past the positions the model was trained for,
    ``max_position_embeddings``, and its config scales no RoPE to reach further."""
    text = model_config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_scaling", None) or {}  # transformers 5: rope_parameters, maybe per layer type
    ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]
    scaled = any(r.get("rope_type", r.get("type", "default")) != "default" for r in ropes)
    if isinstance(limit, int) and longest_example > limit and not scaled:
        log.warning(
            "the longest example has %d tokens, more than the model's max_position_embeddings=%d, and its"
            " config sets no rope_scaling: positions past %d were never trained; lower"
            " dataset.maxSeqLength (and training.packingLength) to %d",
            longest_example,
            limit,
            limit,
            limit,
        )


def _hub_kwargs(source: ModelSource) -> dict[str, Any]:
    return {"revision": source.revision, "token": hub_token(), "trust_remote_code": source.trust_remote_code}


def hub_token() -> str | None:
    # A Secret written from a file often ends in a newline, which no HTTP header may carry.
    return os.environ.get("HF_TOKEN", "").strip() or None


def resolve_commit(source: ModelSource) -> str | None:
    """The commit a hub model's revision (unset: ``main``) points at now, as every ``from_pretrained``
    resolves it for its own files (transformers' ``resolve_revision``: the hub asked, else the commit the
    cache recorded for that revision, as offline); None for ``model.path``, or when neither knows it (the
    hub unreachable and nothing cached, a repo or revision that does not exist: the load says why)."""
    from huggingface_hub import ResolvedRevision
    from transformers.utils.hub import resolve_revision

    if source.name is None:
        return None
    found = resolve_revision(source.name, source.revision, token=hub_token())
    return str(found.resolved) if isinstance(found, ResolvedRevision) else None


def _model_ref(source: ModelSource) -> str:
    return source.path or source.name or ""


def _load_error(what: str, source: ModelSource, exc: Exception) -> TrainerError:
    """A network, hub, disk or memory failure keeps its retryable class; anything else is the model's. A
    commit the hub no longer has (a history squashed, a repo created again) is said to be the one the
    checkpoints recorded when it may be (base_commit.py), with the way on."""
    from huggingface_hub.errors import RevisionNotFoundError

    what = f"the {what} from {_model_ref(source)}"
    failure = load_failure(exc, what)
    if failure is not None:
        return failure
    reason = f"could not load {what}: {exc}"
    gone = any(isinstance(cause, RevisionNotFoundError) for cause in causes(exc))
    if gone and source.revision is not None and COMMIT.fullmatch(source.revision):
        reason += (
            f" (commit {source.revision}: unless model.revision names it, the commit the job's checkpoints"
            " were trained on, gone from the hub since; to go on from those checkpoints on another base, set"
            " model.revision to a commit or tag the repo has)"
        )
    return TrainerError(ExitCode.MODEL_LOAD_ERROR, reason)


def load_model_config(source: ModelSource) -> Any:
    """The model's transformers config (its ``config.json``), read before the weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(_model_ref(source), **_hub_kwargs(source))
    except Exception as exc:
        raise _load_error("model config", source, exc) from exc


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(_model_ref(source), **_hub_kwargs(source))
    except Exception as exc:
        raise _load_error("tokenizer", source, exc) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def load_model(config: TrainerConfig, device: torch.device, attention: str) -> Any:
    """The base model from the hub or a local folder, on ``device`` unless FSDP will place it.

    Under FSDP only rank 0 calls it, on the CPU, for :func:`pretrained_weights`.
    """
    from transformers import AutoModelForCausalLM

    plan = precision_plan(config.method, config.training.precision)
    kwargs = _hub_kwargs(config.model) | {"dtype": plan.load_dtype, "attn_implementation": attention}
    if config.method == "qlora":
        kwargs |= {"quantization_config": qlora_quantization(plan), "device_map": {"": device}}
    elif device.type == "cuda" and config.distributed.sharding not in ("fsdp", "hsdp"):
        kwargs["device_map"] = {"": device}
    try:
        return AutoModelForCausalLM.from_pretrained(_model_ref(config.model), **kwargs)
    except Exception as exc:
        raise _load_error("model", config.model, exc) from exc


def build_model(config: TrainerConfig, attention: str) -> Any:
    """The base model as :func:`load_model` returns it, but without its weights: the parameters on the meta
    device (no memory), the buffers (RoPE frequencies, computed from the config as from_pretrained computes
    them) on the CPU. Under FSDP every rank shards this and fills the shards from rank 0's weights (and a
    checkpoint), so a rank other than 0 never holds the whole model (distributed.py)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    source = config.model
    model_config = load_model_config(source)
    dtype = precision_plan(config.method, config.training.precision).load_dtype
    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(
                model_config,
                dtype=dtype,
                attn_implementation=attention,
                trust_remote_code=source.trust_remote_code,
                **_code_revision(source, model_config),
            )
    except Exception as exc:
        raise _load_error("model", source, exc) from exc
    model.tie_weights()  # init_empty_weights re-creates each parameter it registers, untying a tied head
    # from_pretrained also reads the sampling defaults, which the saved output keeps; without a
    # generation_config.json the one from_config derived from the model config stands.
    if model.can_generate():
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(
                _model_ref(source), revision=source.revision or "main", token=hub_token()
            )
    return model.eval()  # from_pretrained's mode


def _code_revision(source: ModelSource, model_config: Any) -> dict[str, Any]:
    """The revision of a remote-code model's own code, as rank 0's from_pretrained reads it (from_config
    would fetch the code of ``main``); nothing for a built-in class, which takes no such argument, nor for
    code in another repo (``auto_map`` naming ``org/repo--module.Class``, an MPT fine-tune's), which
    from_pretrained reads at that repo's ``main``: the model's revision does not exist there."""
    entry = (getattr(model_config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    elsewhere = isinstance(entry, str) and "--" in entry and entry.partition("--")[0] != source.name
    pinned = source.trust_remote_code and entry is not None and not elsewhere and source.revision
    return {"code_revision": source.revision} if pinned else {}


def pretrained_weights(config: TrainerConfig, attention: str) -> dict[str, torch.Tensor]:
    """The whole model's initial state dict, in CPU memory: rank 0's under FSDP. The base model (fp32
    for full fine-tuning), or for LoRA the peft model with the base in the compute dtype and its fresh
    adapters (:func:`add_adapters`), under the names of the model every rank built."""
    model = load_model(config, torch.device("cpu"), attention)
    if config.method == "lora":
        model = add_adapters(model, config.lora, config.training.seed, config.model.revision)
    return dict(model.state_dict())


def qlora_quantization(plan: PrecisionPlan) -> Any:
    from transformers import BitsAndBytesConfig
    from transformers.utils import is_bitsandbytes_available

    if not torch.cuda.is_available() or not is_bitsandbytes_available():
        raise TrainerError(
            ExitCode.CONFIG_ERROR, "method qlora needs a CUDA GPU and the bitsandbytes package"
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=plan.compute_dtype,
    )


def prepare_for_training(
    model: Any,
    method: Method,
    lora: LoraSettings,
    training: TrainingSettings,
    device: torch.device,
    *,
    revision: str | None = None,
) -> Any:
    """Liger kernels, gradient checkpointing and LoRA adapters, in the order they must be applied.

    The model's config stays the base's, ``use_cache`` included (the training step passes
    ``use_cache=False`` itself), so a fully fine-tuned output generates with a KV cache as its base did.
    ``revision``, the base's (``model.revision``: for a hub model the commit it was loaded at, which
    base_commit.py put there), goes into the adapter's ``adapter_config.json``, so that loading the adapter
    fetches the base it was trained on rather than the hub's ``main`` of the day. Its
    ``base_model_name_or_path`` is where the base was loaded from: the hub name, or for ``model.path`` the
    folder as the trainer pod sees it (``/model/<path>``).

    A multimodal model's towers (:func:`sftjob_trainer.adapters.outside_language_model`) get no adapters;
    full fine-tuning leaves them trainable (:func:`sftjob_trainer.adapters.towers_in_training`).
    """
    if training.gradient_checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"{type(model).__name__} does not support gradient checkpointing: set"
            " spec.training.gradientCheckpointing: false (with LoRA, more GPUs or larger ones should it"
            " then not fit)",
        )
    if training.liger_kernels:
        apply_liger(model, device)
    checkpointing = {"use_reentrant": False}
    if method == "qlora":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=training.gradient_checkpointing,
            gradient_checkpointing_kwargs=checkpointing,
        )
    elif training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if method in ("lora", "qlora"):
        model = add_adapters(model, lora, training.seed, revision)
    # Loaded models come in eval mode, in which transformers never recomputes a checkpointed layer (it
    # checks ``self.training``) and dropout is off: training mode, for both.
    return model.train()


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    non_embedding: int  # what MFU counts: every weight except the input embedding table
    trainable: int


def count_parameters(model: Any) -> ParameterCounts:
    """Counts of the base model's weights (4-bit weights counted as the numbers they stand for)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding_ids = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and any(id(p) in embedding_ids for p in head.parameters())
    total = trainable = 0
    # A tied output head still does its matmul: count it once as a non-embedding weight.
    non_embedding = sum(p.numel() for p in head.parameters()) if tied and head is not None else 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            trainable += p.numel()
        if "lora_" in name:
            continue
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        n = math.prod(shape) if shape is not None else p.numel()
        total += n
        if id(p) not in embedding_ids:
            non_embedding += n
    return ParameterCounts(total, non_embedding, trainable)
