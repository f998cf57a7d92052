"""The adapter merged into its base (``spec.output.mergeAdapter``): one standalone model, in a ``merged``
folder beside the adapter, that serves like any other (vLLM, TGI, ``from_pretrained``) without peft.

Rank 0 merges while it writes the output (``output.write_model``), once the adapter is in the output's
temporary folder: it loads the base again on the CPU, in the precision the run computed in (bf16 in every
plan), the adapter onto it from that folder, and folds each ``B @ A`` into its layer's weight (peft's
``merge_and_unload``, which refuses weights made non-finite); output.py writes the merged model as it writes
a fully fine-tuned one. The base is loaded unquantised for QLoRA too:
its adapter was trained against the 4-bit NF4 copy, and merged into the 4-bit weights it would be rounded
back to 4 bits; the full-precision base is what every serving engine loads a QLoRA adapter onto as well.

The host memory this takes, the base in that precision once more, is in the pod's request
(``sftjob.resources.pod_resources``); the GPUs hold the trained model meanwhile and take no part in it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.model import load_model, precision_plan

log = logging.getLogger(__name__)

MERGED_FOLDER = "merged"
# An attention implementation every model class has; what a model serves with is the serving engine's choice.
MERGE_ATTENTION = "eager"


def merge_dtype(config: TrainerConfig) -> torch.dtype:
    """The precision the merged model is written in: the one the adapter's base computed in."""
    return precision_plan(config.method, config.training.precision).compute_dtype


def merged_model(config: TrainerConfig, adapter: Path) -> Any:
    """The base, loaded on the CPU in :func:`merge_dtype` and not quantised, with the adapter saved in
    ``adapter`` merged into its weights. Raises DIVERGED when a merged weight is not finite."""
    from peft import PeftModel

    unquantised = config.model_copy(update={"method": "lora"})  # QLoRA's base in the compute dtype
    base = load_model(unquantised, torch.device("cpu"), MERGE_ATTENTION)
    log.info("merging the adapter into %s (%s, on the CPU)", type(base).__name__, merge_dtype(config))
    adapted = PeftModel.from_pretrained(base, adapter)
    _untie_adapted(adapted)
    merged = adapted.merge_and_unload()  # each weight rounded once (safe_merge rounds B @ A first)
    broken = [name for name, p in merged.named_parameters() if not torch.isfinite(p).all()]
    if broken:
        raise TrainerError(
            ExitCode.DIVERGED,
            f"the adapter merged into its base makes {len(broken)} weights not finite ({broken[0]}, ...):"
            " the adapter in the output folder is broken",
        )
    return merged


def _untie_adapted(adapted: Any) -> None:
    """Give the output head its own weight when the base ties it to the input embeddings and the adapter
    adapts either (``targetModules`` naming ``lm_head`` or ``embed_tokens``): merged into the one shared
    tensor, the head's ``B @ A`` would change the embeddings too. The config then says they are untied, so
    that loading the merged model does not tie them again."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = adapted.get_base_model()
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None:
        return
    weight: Any = (
        embeddings.get_base_layer().weight if isinstance(embeddings, BaseTunerLayer) else embeddings.weight
    )
    head_layer: Any = head.get_base_layer() if isinstance(head, BaseTunerLayer) else head
    adapted_either = isinstance(head, BaseTunerLayer) or isinstance(embeddings, BaseTunerLayer)
    if head_layer.weight is not weight or not adapted_either:
        return
    log.info("untying the output head from the input embeddings: the adapter adapts one of them")
    head_layer.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    for settings in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        settings.tie_word_embeddings = False
