"""What the trainer throughput benchmark trains on, and the measured peak it divides by.

Synthetic SFT samples (no downloads), NF4 quantisation of a random-initialised model (what
``from_pretrained`` with a 4-bit BitsAndBytesConfig produces from real weights), and the bf16 matmul
peak MFU is measured against.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from sftjob_trainer.data import IGNORE_INDEX, Example


def synthetic_examples(samples: int, median: int, longest: int, vocab: int, seed: int = 0) -> list[Example]:
    """Log-normal lengths (sigma 0.8) around the median; the first third of each sample is prompt."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, samples), 8, longest).astype(int)
    tokens = rng.integers(3, vocab, int(lengths.sum())).tolist()
    examples, start = [], 0
    for n in lengths.tolist():
        ids = tokens[start : start + n]
        start += n
        prompt = n // 3
        examples.append(Example(ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return examples


def quantize_linears(model: Any, compute_dtype: torch.dtype) -> None:
    """NF4 decoder linears, as from_pretrained with BitsAndBytesConfig would load them."""
    bnb = __import__("bitsandbytes")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if isinstance(linear, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(
                        linear.in_features,
                        linear.out_features,
                        bias=False,
                        compute_dtype=compute_dtype,
                        quant_type="nf4",
                        compress_statistics=True,
                        device="meta",
                    )
                    q.weight = bnb.nn.Params4bit(
                        linear.weight.data.cpu(),
                        requires_grad=False,
                        quant_type="nf4",
                        compress_statistics=True,
                    ).to(linear.weight.device)
                    setattr(parent, name, q)
    torch.cuda.empty_cache()


def matmul_peak(device: torch.device) -> float | None:
    """Measured dense bf16 FLOP/s: an 8192^3 product, 3 warm-ups, mean of 10."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
        torch.randn(n, n, device=device, dtype=torch.bfloat16),
    )
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - started)


def missing(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return True
    return False
