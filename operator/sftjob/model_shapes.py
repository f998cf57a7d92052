"""Where a job's model shape comes from, since the operator never reads the model's files.

The SFTJob's ``spec.model.architecture`` block when the spec has one, else the built-in table of common
models below (matched by hub id), else a Llama-shaped guess sized to ``spec.model.parameters``
(:func:`resolve_architecture`); :func:`parameters_problem` refuses a block and a count that cannot be one
model (a mixture of experts described by its dense layers).
"""

from __future__ import annotations

import math
import re

from sftjob.architectures import Architecture
from sftjob.experts import Experts


def _arch(
    family: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    inter: int,
    vocab: int,
    tied: bool,
    head_dim: int | None = None,
    sliding_window: int | None = None,
) -> Architecture:
    return Architecture(
        layers=layers,
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tied_embeddings=tied,
        head_dim=head_dim,
        attention_bias=family == "qwen2",
        sliding_window=sliding_window,
        family=family,
    )


def _moe(
    family: str,
    shape: tuple[int, int, int, int, int],  # layers, hidden, heads, KV heads, vocabulary
    experts: tuple[int, int, int, int],  # count, per token, expert width, shared expert width
    *,
    head_dim: int | None = None,
    bias: bool = False,
) -> Architecture:
    layers, hidden, heads, kv, vocab = shape
    count, per_token, width, shared = experts
    mixture = Experts(
        count=count, per_token=per_token, intermediate_size=width, shared_intermediate_size=shared
    )
    return Architecture(
        layers=layers,
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv,
        intermediate_size=width,
        vocab_size=vocab,
        tied_embeddings=False,
        head_dim=head_dim,
        attention_bias=bias,
        family=family,
        experts=mixture,
    )


MISTRAL_V0_1_WINDOW = 4096  # Mistral 7B v0.1's sliding_window

# Shapes from each model's published config.json. Patterns match the lower-cased hub id anywhere,
# so "meta-llama/Llama-3.1-8B-Instruct" and "unsloth/llama-3.1-8b" both find the 8B row.
KNOWN_ARCHITECTURES: tuple[tuple[str, str, Architecture], ...] = (
    ("Llama 3.2 1B", r"llama-?3\.2-1b\b", _arch("llama", 16, 2048, 32, 8, 8192, 128256, True)),
    ("Llama 3.2 3B", r"llama-?3\.2-3b\b", _arch("llama", 28, 3072, 24, 8, 8192, 128256, True)),
    ("Llama 3.x 8B", r"llama-?3(\.1)?-8b\b", _arch("llama", 32, 4096, 32, 8, 14336, 128256, False)),
    ("Llama 3.x 70B", r"llama-?3(\.[13])?-70b\b", _arch("llama", 80, 8192, 64, 8, 28672, 128256, False)),
    ("Llama 2 7B", r"llama-?2-7b\b", _arch("llama", 32, 4096, 32, 32, 11008, 32000, False)),
    ("Llama 2 13B", r"llama-?2-13b\b", _arch("llama", 40, 5120, 40, 40, 13824, 32000, False)),
    ("Llama 2 70B", r"llama-?2-70b\b", _arch("llama", 80, 8192, 64, 8, 28672, 32000, False)),
    ("TinyLlama 1.1B", r"tinyllama", _arch("llama", 22, 2048, 32, 4, 5632, 32000, False)),
    ("Qwen2.5 0.5B", r"qwen2\.5-([a-z]+-)?0\.5b\b", _arch("qwen2", 24, 896, 14, 2, 4864, 151936, True)),
    ("Qwen2.5 1.5B", r"qwen2\.5-([a-z]+-)?1\.5b\b", _arch("qwen2", 28, 1536, 12, 2, 8960, 151936, True)),
    ("Qwen2.5 3B", r"qwen2\.5-([a-z]+-)?3b\b", _arch("qwen2", 36, 2048, 16, 2, 11008, 151936, True)),
    ("Qwen2.5 7B", r"qwen2\.5-([a-z]+-)?7b\b", _arch("qwen2", 28, 3584, 28, 4, 18944, 152064, False)),
    ("Qwen2.5 14B", r"qwen2\.5-([a-z]+-)?14b\b", _arch("qwen2", 48, 5120, 40, 8, 13824, 152064, False)),
    ("Qwen2.5 32B", r"qwen2\.5-([a-z]+-)?32b\b", _arch("qwen2", 64, 5120, 40, 8, 27648, 152064, False)),
    ("Qwen2.5 72B", r"qwen2\.5-([a-z]+-)?72b\b", _arch("qwen2", 80, 8192, 64, 8, 29568, 152064, False)),
    # v0.1 attends within a 4096-token window, v0.2 and v0.3 (32k vocabulary) over the whole row. An id
    # naming no version (a fine-tune: "teknium/OpenHermes-2.5-Mistral-7B" is v0.1) gets v0.1's window,
    # which only matters past 4096-token rows (eager attention, its scores counted), and v0.3's vocabulary.
    (
        "Mistral 7B v0.1",
        r"mistral-7b(-instruct)?-v0\.1\b",
        _arch("mistral", 32, 4096, 32, 8, 14336, 32000, False, sliding_window=MISTRAL_V0_1_WINDOW),
    ),
    (
        "Mistral 7B v0.2",
        r"mistral-7b(-instruct)?-v0\.2\b",
        _arch("mistral", 32, 4096, 32, 8, 14336, 32000, False),
    ),
    (
        "Mistral 7B v0.3",
        r"mistral-7b(-instruct)?-v0\.3\b",
        _arch("mistral", 32, 4096, 32, 8, 14336, 32768, False),
    ),
    (
        "Mistral 7B, version not named (v0.1's window assumed)",
        r"mistral-7b\b",
        _arch("mistral", 32, 4096, 32, 8, 14336, 32768, False, sliding_window=MISTRAL_V0_1_WINDOW),
    ),
    ("Gemma 2 2B", r"gemma-2-2b\b", _arch("gemma2", 26, 2304, 8, 4, 9216, 256000, True, 256)),
    ("Gemma 2 9B", r"gemma-2-9b\b", _arch("gemma2", 42, 3584, 16, 8, 14336, 256000, True, 256)),
    ("Gemma 2 27B", r"gemma-2-27b\b", _arch("gemma2", 46, 4608, 32, 16, 36864, 256000, True, 128)),
    # Mixtures of experts: every expert counted for memory (QLoRA leaves the fused experts unquantised),
    # the routed ones for FLOPs. spec.model.architecture cannot describe these; spec.model.parameters
    # alone would size them as a dense model.
    ("Mixtral 8x7B", r"mixtral-8x7b\b", _moe("mixtral", (32, 4096, 32, 8, 32000), (8, 2, 14336, 0))),
    ("Mixtral 8x22B", r"mixtral-8x22b\b", _moe("mixtral", (56, 6144, 48, 8, 32768), (8, 2, 16384, 0))),
    (
        "Qwen1.5 MoE A2.7B",
        r"qwen1\.5-moe-a2\.7b\b",
        _moe("qwen2_moe", (24, 2048, 16, 16, 151936), (60, 4, 1408, 5632), bias=True),
    ),
    (
        "Qwen2 57B A14B",
        r"qwen2-57b-a14b\b",
        _moe("qwen2_moe", (28, 3584, 28, 4, 151936), (64, 8, 2560, 20480), bias=True),
    ),
    (
        "Qwen3 30B A3B",
        r"qwen3-30b-a3b\b",
        _moe("qwen3_moe", (48, 2048, 32, 4, 151936), (128, 8, 768, 0), head_dim=128),
    ),
    (
        "Qwen3 235B A22B",
        r"qwen3-235b-a22b\b",
        _moe("qwen3_moe", (94, 4096, 64, 4, 151936), (128, 8, 1536, 0), head_dim=128),
    ),
    ("OLMoE 1B-7B", r"olmoe-1b-7b\b", _moe("olmoe", (16, 2048, 16, 16, 50304), (64, 8, 1024, 0))),
)


def known_architecture(model_name: str) -> Architecture | None:
    """The built-in shape for a hub id (case-insensitive; -Instruct/-it/-chat variants included)."""
    lowered = model_name.casefold()
    for label, pattern, arch in KNOWN_ARCHITECTURES:
        if re.search(pattern, lowered):
            return arch.model_copy(update={"name": label})
    return None


MIN_GUESSED_LAYERS = 8


def llama_shaped(parameters: int) -> Architecture:
    """A Llama-3-style shape with about ``parameters`` weights (for sizing when nothing else is known).

    Width follows the Llama 3 ladder (2048 wide at 1B ... 8192 at 70B; 896 and 1024 below 1B, as Qwen2.5
    0.5B and SmolLM2), MLP 3.5x wide, head 128 (64 below 1B), 8 KV heads, the 128k vocabulary
    (conservative for the logits buffer), tied to the embeddings below 4B as in Llama 3.2 1B/3B; depth
    makes up the count, at least 8 layers (the vocabulary alone would leave a small model one layer).
    """
    if parameters < 1:
        raise ValueError("spec.model.parameters must be a positive count of weights")
    ladder = ((0.4e9, 896), (1e9, 1024), (2e9, 2048), (5e9, 3072), (11e9, 4096), (20e9, 5120), (45e9, 6656))
    hidden = next((h for limit, h in ladder if parameters < limit), 8192)
    heads = hidden // (64 if hidden < 2048 else 128)
    kv = min(8, heads)
    inter = 256 * math.ceil(3.5 * hidden / 256)
    vocab = 128256
    tied = parameters < 4e9
    probe = Architecture(
        layers=1,
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        tied_embeddings=tied,
    )
    per_layer = probe.layer_parameters
    embeddings = (1 if tied else 2) * vocab * hidden
    layers = max(MIN_GUESSED_LAYERS, round((parameters - embeddings) / per_layer))
    billions = parameters / 1e9
    return probe.model_copy(
        update={"layers": layers, "name": f"Llama-shaped guess for {billions:.1f}B parameters"}
    )


# How far below ``spec.model.parameters`` a shape's own count may fall (a share of the parameters) and still
# be one model (Gemma 2 "2B" has 2.6B). Further below, it is a mixture of experts (46.7B) whose layers and
# one expert's width make a dense 7B shape. Above is allowed: the shape counts a gated MLP (3 matrices),
# so a model with a plain one (StarCoder2, Falcon, GPT-NeoX, Phi-2) counts about 1.4x its size.
PARAMETERS_TOLERANCE = 0.25


def parameters_problem(architecture: Architecture | None, parameters: int | None) -> str | None:
    """Why ``spec.model.architecture`` and ``spec.model.parameters`` cannot both hold, or None (also
    when either is unset)."""
    if architecture is None or parameters is None:
        return None
    counted = architecture.parameters
    if counted >= (1 - PARAMETERS_TOLERANCE) * parameters:
        return None
    return (
        f"spec.model.architecture has {counted / 1e9:.2f}B parameters but"
        f" spec.model.parameters says {parameters / 1e9:.2f}B: spec.model.architecture cannot describe a"
        " mixture-of-experts model (its experts are not part of it), so for one give spec.model.parameters"
        " alone (every expert counted); otherwise correct the one that is wrong"
    )


def resolve_architecture(
    model_name: str | None, architecture: Architecture | None = None, parameters: int | None = None
) -> Architecture:
    """The shape to plan with: the explicit block (which the spec model holds to ``parameters``:
    :func:`parameters_problem`), else the built-in table (over ``parameters``, which the shape's name then
    says were ignored), else a guess from size."""
    if architecture is not None:
        return (
            architecture
            if architecture.name
            else architecture.model_copy(update={"name": "spec.model.architecture"})
        )
    if model_name:
        known = known_architecture(model_name)
        if known is not None and parameters is not None:  # said, so a user's number is not lost quietly
            return known.model_copy(update={"name": f"{known.name}; spec.model.parameters ignored"})
        if known is not None:
            return known
    if parameters is not None:
        return llama_shaped(parameters)
    what = f"model {model_name!r} is not in the built-in table" if model_name else "no model name is given"
    raise ValueError(
        f"cannot size the model: {what}; set spec.model.parameters (e.g. 7000000000) or"
        " spec.model.architecture (layers, hiddenSize, heads, kvHeads, intermediateSize, vocabSize)"
    )
