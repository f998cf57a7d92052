"""What the trainer throughput benchmark trains on, the measured peak it divides by, and a check.

Synthetic SFT samples (no downloads), NF4 quantisation of a random-initialised model (what
``from_pretrained`` with a 4-bit BitsAndBytesConfig produces from real weights), the bf16 matmul
peak MFU is measured against, a self-check of the packed-row attention against masked SDPA, and a
profiler table of one step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sftjob_trainer import attention
from sftjob_trainer.data import IGNORE_INDEX, Example

CHECK_LENGTHS = (100, 37, 250, 1, 124)  # examples in the self-check's packed row


def synthetic_examples(
    samples: int, median: int, shortest: int, longest: int, vocab: int, seed: int = 0
) -> list[Example]:
    """Log-normal lengths (sigma 0.8) around the median, clipped to ``shortest..longest``; the first
    third of each sample is prompt."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, samples), shortest, longest).astype(int)
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


def attention_check(device: torch.device) -> dict[str, Any]:
    """Packed-row attention (``sftjob_varlen``) against SDPA with a block-diagonal causal mask.

    One random bf16 row (fp32 on a CPU) of five examples, 8 query heads over 2 key/value heads (GQA),
    head dim 64: the largest absolute difference of the outputs and of the query gradients.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result: dict[str, Any] = {"backend": attention.kernel_backend(device), "dtype": str(dtype)}
    try:
        generator = torch.Generator(device).manual_seed(0)
        total = sum(CHECK_LENGTHS)
        q, k, v = (
            torch.randn(1, heads, total, 64, device=device, dtype=dtype, generator=generator)
            for heads in (8, 2, 2)
        )
        cu = torch.tensor([0, *np.cumsum(CHECK_LENGTHS)], dtype=torch.int32, device=device)
        example = torch.repeat_interleave(torch.arange(len(CHECK_LENGTHS), device=device), cu.diff())
        position = torch.arange(total, device=device)
        mask = (example[:, None] == example[None, :]) & (position[:, None] >= position[None, :])
        outputs, grads = [], []
        for packed in (True, False):
            qq = q.clone().requires_grad_()
            if packed:
                out, _ = attention.varlen_attention_forward(
                    torch.nn.Module(), qq, k, v, None, cu_seq_lens_q=cu, max_length_q=max(CHECK_LENGTHS)
                )
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    qq, k, v, attn_mask=mask, enable_gqa=True
                ).transpose(1, 2)
            out.float().square().sum().backward()
            outputs.append(out.detach().float())
            assert qq.grad is not None
            grads.append(qq.grad.float())
        result["maxAbsDiffOutput"] = (outputs[0] - outputs[1]).abs().max().item()
        result["maxAbsDiffGrad"] = (grads[0] - grads[1]).abs().max().item()
    except Exception as exc:  # recorded in the results, the benchmark goes on
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return result


def profiled_step(path: Path, step: Any) -> Any:
    """Run one step under the torch profiler; write its top kernels and ops by device time to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        result = step()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=80) + "\n")
    return result
