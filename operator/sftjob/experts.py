"""The mixture-of-experts MLP of an :class:`~sftjob.architectures.Architecture` (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE), and how a HF ``config.json`` says a model has one.

Its own module because memory and FLOPs part ways here: every expert is resident on the GPU, so the
planner's memory counts them all, while a token goes through the few the router picks, so the model
FLOPs (MFU, the throughput estimate) count only those.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# config.json's names for a mixture's number of experts, and for how many of them each token is routed to.
_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")
_EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk")


class Experts(BaseModel):
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): ``count`` gated MLPs of
    ``intermediate_size``, of which a router sends each token through ``per_token``; in Qwen2-MoE also a
    shared expert of ``shared_intermediate_size`` that every token goes through, scaled by a one-output
    gate. Every expert is resident (memory counts them all); a token computes its ``per_token`` (FLOPs)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    count: int = Field(ge=1, le=4096)
    per_token: int = Field(ge=1, le=4096)
    intermediate_size: int = Field(ge=1, le=1048576)
    shared_intermediate_size: int = Field(default=0, ge=0, le=1048576)

    @model_validator(mode="after")
    def _routes_to_experts_it_has(self) -> Experts:
        if self.per_token > self.count:
            raise ValueError(f"experts.perToken {self.per_token} exceeds experts.count {self.count}")
        return self

    def to_hf_config(self) -> dict[str, int]:
        """The transformers config fields of this mixture (:func:`experts_from_hf_config` reads them)."""
        return {
            "num_local_experts": self.count,  # Mixtral, Qwen3-MoE
            "num_experts": self.count,  # Qwen2-MoE, OLMoE
            "num_experts_per_tok": self.per_token,
            "moe_intermediate_size": self.intermediate_size,
            "shared_expert_intermediate_size": self.shared_intermediate_size,
        }

    def shared_parameters(self, hidden: int) -> int:
        """The shared expert and its one-output gate (0 without one): linears every token goes through."""
        shared = self.shared_intermediate_size
        return 3 * hidden * shared + hidden if shared else 0

    def mlp_parameters(self, hidden: int, experts: int) -> int:
        """``experts`` routed experts, the shared one, and the router (hidden x count)."""
        routed = experts * 3 * hidden * self.intermediate_size
        return routed + self.shared_parameters(hidden) + hidden * self.count


def experts_from_hf_config(config: dict[str, Any]) -> Experts | None:
    """The mixture of experts of a HF ``config.json`` dict, taken to be in every layer (Qwen2-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``, which can make some layers dense, are not read); None
    for a dense model."""
    count = next((config[k] for k in _EXPERT_COUNT_KEYS if isinstance(config.get(k), int)), 0)
    per_token = next((config[k] for k in _EXPERTS_PER_TOKEN_KEYS if isinstance(config.get(k), int)), 0)
    if count < 1 or per_token < 1:
        return None
    return Experts(
        count=count,
        per_token=per_token,
        intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
        shared_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
    )
