"""Model architectures the memory estimator and planner reason about.

An architecture comes from the model's own config.json when the operator can read it, else from the
SFTJob's size hints, else from the built-in table of common families below.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Architecture(BaseModel):
    """A decoder-only transformer's shape (Llama/Qwen/Mistral/Gemma style: GQA attention, gated MLP)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tied_embeddings: bool = False
