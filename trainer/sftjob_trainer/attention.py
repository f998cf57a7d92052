"""Attention for packed rows: variable-length attention that keeps examples apart without a dense mask,
why a model needs eager attention instead, and whether its eager masks keep them apart.

With ``attn_implementation="sdpa"`` transformers turns the restarting ``position_ids`` of packed rows
into a dense block-diagonal mask, which takes SDPA off its flash kernel and computes the whole
row x row score matrix. ``sftjob_varlen`` (registered with transformers' ``AttentionInterface`` and,
with a mask function that builds nothing, ``AttentionMaskInterface``) instead reads the boundaries the
trainer computed once per micro-batch (``cu_seq_lens_q``/``max_length_q``, transformers'
FlashAttentionKwargs, passed through ``model(**inputs)``) and calls PyTorch's own flash varlen kernel,
``torch.nn.attention.varlen.varlen_attn``, causal within each example. Where that kernel cannot run
(no CUDA, fp32 tensors, an older PyTorch) the same function computes exact causal SDPA per example,
so results mean the same everywhere; attention dropout (GPT-2's ``attn_pdrop``), which the flash kernel
lacks, takes the per-example path too. Neither path has attention logit soft-capping or a sliding window
(Gemma 2 has both): :func:`sdpa_gap` tells the trainer to load such models with eager attention instead,
and the function refuses the arguments rather than drop them.

Eager attention keeps packed examples apart only where the model hands the restarting ``position_ids``
to transformers' mask functions, which then build the block-diagonal mask. Many do; Falcon, MPT, Bloom,
XGLM, BioGPT, OPT and GPT-OSS build their masks without them, or count positions from the mask, so their
packed examples would attend to each other. :data:`PACKED_EAGER` lists the model types checked to keep
them apart (tests/trainer/test_packed_eager.py); :func:`packed_eager_problem` says why any other would not.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.remote_code import is_remote

log = logging.getLogger(__name__)

VARLEN = "sftjob_varlen"
# Implementations that take a micro-batch as one flattened row plus cumulative sequence lengths.
FLATTENED = frozenset({"flash_attention_2", VARLEN})
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_MAX_HEAD_DIM = 256
# Model types (transformers' own classes) whose eager attention keeps packed examples apart: each one's
# packed logits equal its examples' logits alone in tests/trainer/test_packed_eager.py.
PACKED_EAGER = frozenset(
    {
        "codegen",
        "cohere",
        "cohere2",
        "exaone4",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gptj",
        "granite",
        "granitemoe",
        "llama",
        "mistral",
        "mixtral",
        "olmo",
        "olmo2",
        "olmo3",
        "phi",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "stablelm",
        "starcoder2",
    }
)


def register() -> None:
    """Make ``sftjob_varlen`` a valid ``attn_implementation`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, no_mask)


def sdpa_gap(model_config: Any, longest_example: int | None) -> str | None:
    """What of this model's attention SDPA (and so ``sftjob_varlen``) would not compute, if anything.

    Neither has logit soft-capping (transformers refuses SDPA for Gemma 2 for that reason). Only packed
    runs (``longest_example``: the longest example in a row; None without packing) use ``sftjob_varlen``,
    which has no sliding window: exact while no example is longer than the window. A multimodal model
    (Gemma 3, loaded as ``Gemma3ForConditionalGeneration``) keeps these settings in its text config.
    """
    model_config = model_config.get_text_config()
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"{model_config.model_type} soft-caps its attention logits (at {softcap})"
    window: int | None = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None)  # None: every layer has the window (Mistral)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    if longest_example is not None and longest_example > window:
        return (
            f"{model_config.model_type} attends within a sliding window of {window} tokens and packed"
            f" examples are up to {longest_example} tokens long"
        )
    return None


def attention_dropout(model_config: Any) -> float:
    """The dropout on the attention weights the model's config sets (0 for most; GPT-2's 0.1)."""
    text = model_config.get_text_config()
    for name in ("attn_pdrop", "attention_dropout", "attn_dropout"):
        value = getattr(text, name, None)
        if isinstance(value, int | float) and value:
            return float(value)
    return 0.0


def packed_eager_problem(model_config: Any, model_class: Any) -> str | None:
    """Why packed rows of this model under eager attention would attend to each other, if they would:
    ``model_class``, the class it loads as, is the model's own code (whose masks nobody checked), or
    transformers' class for a model type not in :data:`PACKED_EAGER`."""
    if model_class is not None and is_remote(model_class):
        return (
            f"{model_class.__name__} is the model's own code (spec.model.trustRemoteCode), whose eager"
            " masks nobody checked to keep them apart"
        )
    model_type = getattr(model_config, "model_type", None) or "an unknown model type"
    if model_type in PACKED_EAGER:
        return None
    name = f" ({model_class.__name__})" if model_class is not None else ""
    return (
        f"{model_type}{name} is not among the model types whose eager attention is known to keep packed"
        " examples apart (Falcon, MPT, Bloom, XGLM, BioGPT, OPT and GPT-OSS build their masks or positions"
        " without the examples' boundaries)"
    )


def eager_reason(
    model_config: Any, model_class: Any, longest_example: int | None, packing: bool = True
) -> str | None:
    """Why SDPA (or, ``packing``, ``sftjob_varlen``) cannot run this model, if it cannot: what of its
    attention neither computes (:func:`sdpa_gap`; a sliding window only once ``longest_example``
    exceeds it), a class without SDPA attention, or (packed) attention of the class's own code, which
    never gets the examples' boundaries."""
    gap = sdpa_gap(model_config, longest_example) if model_config is not None else None
    if gap is not None:
        return f"{gap}, which {VARLEN if packing else 'sdpa'} does not implement"
    if model_class is None:
        return None
    if not getattr(model_class, "_supports_sdpa", True):
        return f"{model_class.__name__} has no SDPA attention"
    if packing and not model_class.is_backend_compatible():
        return (
            f"{model_class.__name__} takes no attention function of transformers' registry, so"
            f" {VARLEN} would never see where packed examples start"
        )
    return None


def check_packed_eager(model_config: Any, model_class: Any, why: str) -> None:
    """Refuses packed rows that eager attention (which the model runs with: ``why``) would let attend to
    each other."""
    problem = packed_eager_problem(model_config, model_class)
    if problem is not None:
        raise TrainerError(
            ExitCode.CONFIG_ERROR,
            f"packed examples would attend to each other (set spec.training.packing: false): {problem},"
            f" and this model runs with eager attention ({why})",
        )


def no_mask(attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """The mask function: packed rows need no mask (the boundaries come as cu_seq_lens)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(f"attention {VARLEN} takes packed rows without padding; use sdpa for padded batches")
    return None


@cache
def _kernel() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """PyTorch's varlen flash attention and the keyword arguments this version accepts, if present."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def kernel_backend(device: torch.device, dropout: float = 0.0) -> str:
    """What a packed attention call will run on ``device`` (for logs and benchmark rows); in training,
    with the model's attention ``dropout``."""
    kernel = _kernel()
    if device.type != "cuda":
        return "per-example sdpa (no CUDA)"
    if dropout:
        return f"per-example sdpa (attention dropout {dropout:g}, which varlen_attn lacks)"
    if kernel is None:
        return "per-example sdpa (torch.nn.attention.varlen missing)"
    if not ({"window_size", "is_causal"} & kernel[1]):
        return "per-example sdpa (varlen_attn has no causal option)"
    return "varlen_attn"


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out.

    ``cu_seq_lens_q`` indexes the tokens of all rows in order (keys = queries: self-attention, no
    cache); without it every row is one causal sequence. ``dropout``, the attention dropout transformers
    passes in training mode (0 in eval), is applied as SDPA applies it, example by example.
    """
    if softcap is not None:
        raise ValueError(f"attention {VARLEN} has no logit soft-capping; load the model with eager")
    batch, heads, length, dim = query.shape
    longest = int(max_length_q) if cu_seq_lens_q is not None and max_length_q is not None else length
    if sliding_window is not None and longest > sliding_window:
        raise ValueError(
            f"attention {VARLEN} has no sliding window and a sequence of {longest} tokens is longer than the"
            f" model's {sliding_window}; load the model with eager"
        )
    scale = scaling if scaling is not None else dim**-0.5
    if cu_seq_lens_q is None:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout,
            is_causal=True,
            scale=scale,
            enable_gqa=key.shape[1] != heads,
        )
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    if _kernel_applies(q, dropout):
        out = _flash_varlen(q, k, v, cu_seq_lens_q, longest, scale)
    else:
        out = _per_example(q, k, v, cu_seq_lens_q, scale, dropout)
    return out.view(batch, length, heads, dim), None


def _kernel_applies(q: torch.Tensor, dropout: float) -> bool:
    if not q.is_cuda:
        return False
    backend = kernel_backend(q.device, dropout)
    if backend == "varlen_attn" and q.shape[-1] > _KERNEL_MAX_HEAD_DIM:
        backend = f"per-example sdpa (head dim {q.shape[-1]} > {_KERNEL_MAX_HEAD_DIM})"
    if backend != "varlen_attn":
        _log_once(f"attention {VARLEN} on {q.device}: {backend}")
        return False
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in _KERNEL_DTYPES
    if autocast or q.dtype in _KERNEL_DTYPES:
        return True
    _log_once(f"attention {VARLEN}: {q.dtype} tensors, the flash kernel needs fp16/bf16: per-example sdpa")
    return False


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None
    varlen_attn, accepts = kernel
    # A custom op, so autocast does not cast its inputs: do what autocast does for SDPA.
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if dtype not in _KERNEL_DTYPES:
        dtype = torch.bfloat16
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    options: dict[str, Any] = {}
    if "window_size" in accepts:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if "scale" in accepts:
        options["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5):
        q = q * (scale * math.sqrt(q.shape[-1]))
    if "enable_gqa" in accepts:
        options["enable_gqa"] = k.shape[1] != q.shape[1]
    cu = cu_seq_lens.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **options)
    return out[0] if isinstance(out, tuple) else out


def _per_example(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, scale: float, dropout: float
) -> torch.Tensor:
    """Exact causal attention example by example, with ``dropout`` on its weights: (tokens, heads, dim) in
    and out."""
    bounds = cu_seq_lens.tolist()
    gqa = k.shape[1] != q.shape[1]
    pieces = []
    for start, end in itertools.pairwise(bounds):
        if end > start:
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out = F.scaled_dot_product_attention(
                qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
            )
            pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)
