"""Model architectures the memory estimator and planner reason about: :class:`Architecture`, and the
shape a HF config.json describes.

The operator never reads the model's files: where a job's shape comes from is
:mod:`sftjob.model_shapes`. Only the trainer, which loads the model, reads its config.json
(:func:`architecture_from_hf_config`, for FLOPs accounting).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from sftjob.experts import Experts, experts_from_hf_config

# The model families (HF model_type) the planner knows: the built-in table's, each one whose HF
# modelling code Liger kernels patch (RMSNorm, RoPE, SwiGLU/GeGLU, fused linear CE).
ModelFamily = Literal["llama", "mistral", "qwen2", "gemma2"]
LIGER_FAMILIES: frozenset[str] = frozenset(get_args(ModelFamily))
# Families whose attention soft-caps its logits, which PyTorch's SDPA and varlen kernels cannot: the
# trainer runs them with eager attention, whose score matrix grows with the square of the row length.
EAGER_ATTENTION_FAMILIES = frozenset({"gemma2"})


class Architecture(BaseModel):
    """A decoder-only transformer's shape (Llama/Qwen/Mistral/Gemma style: GQA attention, gated MLP, or
    a mixture of gated MLP experts in every layer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tied_embeddings: bool = False
    # Per-head width when it is not hidden_size / heads (Gemma 2).
    head_dim: int | None = Field(default=None, ge=1)
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    # Every layer attends within this many tokens (Mistral 7B v0.1); from the table or config.json.
    sliding_window: int | None = Field(default=None, ge=1)
    family: str | None = None  # HF model_type ("llama", "qwen2", ...); None when unknown
    experts: Experts | None = None  # a mixture-of-experts MLP in every layer; None: a dense one
    name: str | None = None  # where the shape came from, for the plan's reasons

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers config fields of this shape (for building random-initialised models of a
        known family in tests and benchmarks); :func:`architecture_from_hf_config` reads them back."""
        config: dict[str, Any] = {
            "model_type": self.family or "llama",
            "num_hidden_layers": self.layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tied_embeddings,
            "attention_bias": self.attention_bias,
        }
        if self.head_dim is not None:
            config["head_dim"] = self.head_dim
        if self.experts is not None:
            config |= self.experts.to_hf_config()
        return config

    @property
    def head_dimension(self) -> int:
        return self.head_dim or self.hidden_size // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dimension

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dimension

    @property
    def attention_parameters(self) -> int:
        h = self.hidden_size
        bias = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + bias

    @property
    def mlp_parameters(self) -> int:
        """One layer's MLP as held in memory (a mixture: every expert)."""
        if self.experts is None:
            return 3 * self.hidden_size * self.intermediate_size
        return self.experts.mlp_parameters(self.hidden_size, self.experts.count)

    @property
    def active_mlp_parameters(self) -> int:
        """The MLP weights one token multiplies through (a mixture: the router, its experts, the shared)."""
        if self.experts is None:
            return self.mlp_parameters
        return self.experts.mlp_parameters(self.hidden_size, self.experts.per_token)

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width one token's activations have (a mixture: its experts' and the shared one's)."""
        e = self.experts
        return (
            self.intermediate_size
            if e is None
            else e.per_token * e.intermediate_size + e.shared_intermediate_size
        )

    @property
    def layer_parameters(self) -> int:
        """One decoder layer: attention, gated MLP and its RMSNorm weights."""
        return self.attention_parameters + self.mlp_parameters + 2 * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_parameters(self) -> int:
        """Parameters of an untied output projection (0 when it shares the embedding table)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def parameters(self) -> int:
        """Total parameters including embeddings (and the output head when untied)."""
        return (
            self.embedding_parameters
            + self.lm_head_parameters
            + self.layers * self.layer_parameters
            + self.hidden_size
        )

    @property
    def non_embedding_parameters(self) -> int:
        """Total minus the input embedding table (HF's ``num_parameters(exclude_embeddings=True)``)."""
        return self.parameters - self.embedding_parameters

    @property
    def matmul_parameters(self) -> int:
        """Weights every token multiplies through: the decoder layers (of a mixture, the experts the token
        is routed to) plus the output projection."""
        return (
            self.layers * (self.attention_parameters + self.active_mlp_parameters) + self.embedding_parameters
        )

    @property
    def linear_parameters(self) -> int:
        """Decoder-layer ``nn.Linear`` weights: what 4-bit quantisation (QLoRA) compresses. A mixture's
        routed experts are fused 3-D tensors in transformers 5, not linears: they stay unquantised."""
        if self.experts is None:
            return self.layers * (self.attention_parameters + self.mlp_parameters)
        return self.layers * (self.attention_parameters + self.experts.shared_parameters(self.hidden_size))

    @property
    def liger_supported(self) -> bool:
        return self.family in LIGER_FAMILIES

    def eager_attention_reason(self, packed_length: int | None) -> str | None:
        """Why the trainer runs this model with eager attention (``sftjob_trainer.attention.sdpa_gap``):
        soft-capped logits, or a sliding window its packed attention lacks, once packed rows
        (``packed_length`` tokens; None without packing) may hold an example longer than the window."""
        if self.family in EAGER_ATTENTION_FAMILIES:
            return "the model soft-caps its attention logits, which SDPA cannot"
        if self.sliding_window and packed_length is not None and packed_length > self.sliding_window:
            return (
                f"the model attends within a sliding window of {self.sliding_window} tokens, which packed"
                f" attention lacks, and packed examples may be up to {packed_length} tokens long"
            )
        return None

    def lora_widths(self, target_modules: list[str] | str = "all-linear") -> tuple[int, int]:
        """Summed (input, output) widths of the targeted projections: the per-token traffic of the
        adapter paths, and what LoRA dropout copies (the inputs)."""
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        # A mixture's gate/up/down linears are its shared expert's (none in Mixtral), with the shared
        # expert's one-output gate (Qwen2-MoE); the routed experts are fused tensors the trainer's
        # adapters leave alone (model.linear_layer_names).
        i = self.intermediate_size if self.experts is None else self.experts.shared_intermediate_size
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if i:
            shapes |= {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
            if self.experts is not None:
                shapes["shared_expert_gate"] = (h, 1)
        everything = target_modules == "all-linear" or "all-linear" in target_modules
        names = list(shapes) if everything else [m for m in target_modules if m in shapes]
        return sum(shapes[m][0] for m in names), sum(shapes[m][1] for m in names)

    def lora_parameters(self, r: int, target_modules: list[str] | str = "all-linear") -> int:
        """Trainable LoRA parameters: r x (in + out) for every targeted projection in every layer."""
        return self.layers * r * sum(self.lora_widths(target_modules))


# Families whose config.json omits tie_word_embeddings because their class default ties them.
_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3_text"})
# Families whose q/k/v projections have biases without config.json saying so (attention_bias, qkv_bias).
_QKV_BIAS_BY_DEFAULT = frozenset({"qwen2", "qwen2_moe"})


def architecture_from_hf_config(config: dict[str, Any]) -> Architecture:
    """The shape from a HF ``config.json`` dict (multimodal configs: their ``text_config``; mixtures of
    experts: :func:`~sftjob.experts.experts_from_hf_config`). No I/O."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings")}
    missing = [
        k
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if not isinstance(config.get(k), int)
    ]
    if missing:
        raise ValueError(f"config.json lacks integer field(s) {', '.join(missing)}")
    family = config.get("model_type")
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = family in _TIED_BY_DEFAULT
    heads = config["num_attention_heads"]
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    layer_types = config.get("layer_types")  # None: every layer has the window (Mistral)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None
    return Architecture(
        layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(tied),
        head_dim=config.get("head_dim"),
        attention_bias=bool(
            config.get("attention_bias", config.get("qkv_bias", family in _QKV_BIAS_BY_DEFAULT))
        ),
        family=family if isinstance(family, str) else None,
        experts=experts_from_hf_config(config),
        sliding_window=window if isinstance(window, int) and window > 0 else None,
        name="config.json",
    )
