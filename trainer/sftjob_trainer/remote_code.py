"""Models whose modelling code is their own (``model.trustRemoteCode``): which class loads, and what the
trainer cannot take for granted from it.

transformers loads such a model with the class that ``config.auto_map["AutoModelForCausalLM"]`` names,
from the model's own files; :func:`causal_lm_class` finds it the same way, before the data is read
(``model.resolve_model_class``; the code is cached for the load that follows). Unlike transformers' own
classes, that code

- may have no SDPA attention: the trainer loads it with eager attention (``model.resolve_attention``);
- keeps packed examples apart only when its layers take transformers' attention functions
  (``is_backend_compatible()``), which get the examples' boundaries as ``sftjob_varlen``'s arguments;
  with attention of its own it would run eager, whose masks no one checked to keep them apart, so a
  packed run of it is a ConfigError (``attention.packed_eager_problem``), as is one that runs eager
  for any other reason (no SDPA attention);
- usually returns the mean loss of its micro-batch, ignoring ``num_items_in_batch``: loss and gradients
  would be scaled by the accumulation steps times the ranks, and the evaluation loss would depend on the
  micro-batch size. The trainer computes the loss of such a model itself, from its logits
  (:func:`computes_own_loss`, ``loop.micro_batch_loss``).
"""

from __future__ import annotations

from typing import Any

AUTO_CLASS = "AutoModelForCausalLM"


def causal_lm_class(model_config: Any, repo: str | None = None, **hub: Any) -> Any:
    """The class from_pretrained instantiates for ``model_config``: with ``trust_remote_code`` (in ``hub``,
    the hub arguments the load takes) and an ``auto_map`` entry, the model's own, fetched from ``repo`` as
    from_pretrained fetches it; else transformers' class for the config's type. None without a config or
    for a class neither names."""
    if model_config is None:
        return None
    reference = (getattr(model_config, "auto_map", None) or {}).get(AUTO_CLASS)
    if reference and repo is not None and hub.pop("trust_remote_code", False):
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(reference, repo, **hub)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        return None


def is_remote(model_class: type) -> bool:
    """Whether the class is the model's own code rather than one of transformers' (``transformers.models``;
    remote code is imported as ``transformers_modules``)."""
    return not model_class.__module__.startswith("transformers.")


def computes_own_loss(base_model: Any) -> bool:
    """Whether the trainer computes the loss from the logits: for every model but transformers' own
    classes, whose loss is summed over the target tokens and divided by ``num_items_in_batch``. Decided
    on the loaded model, before LoRA and the DDP/FSDP wrappers change its type."""
    return is_remote(type(base_model))
