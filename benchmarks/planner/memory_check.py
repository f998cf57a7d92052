"""Measure peak GPU memory and tokens/s of planner-chosen configs (random-init Llama shapes, packed rows).

Run on a CUDA machine: ``python3 memory_check.py`` prints one JSON line per config. Each config runs in
its own process so peaks do not mix. Emulates HF Trainer: bf16 autocast, fused AdamW, set_to_none zero_grad.
"""

import json
import os
import subprocess
import sys
import time

SHAPES = {
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
CONFIGS = [
    dict(name="7b-lora-d0-m1", shape="llama2-7b", method="lora", micro=1, seq=4096, dropout=0.0),
    dict(name="7b-lora-d005-m1", shape="llama2-7b", method="lora", micro=1, seq=4096, dropout=0.05),
    dict(
        name="8b-lora-d005-m1-liger",
        shape="llama3-8b",
        method="lora",
        micro=1,
        seq=4096,
        dropout=0.05,
        liger=True,
    ),
    dict(name="8b-lora-d005-m1", shape="llama3-8b", method="lora", micro=1, seq=4096, dropout=0.05),
    dict(
        name="8b-lora-d005-m8-ckpt-liger",
        shape="llama3-8b",
        method="lora",
        micro=8,
        seq=4096,
        dropout=0.05,
        liger=True,
        ckpt=True,
    ),
    dict(
        name="8b-qlora-d005-m1-liger",
        shape="llama3-8b",
        method="qlora",
        micro=1,
        seq=4096,
        dropout=0.05,
        liger=True,
    ),
    dict(name="1b-full-m8-liger", shape="llama3.2-1b", method="full", micro=8, seq=2048, liger=True, ga=2),
]


def run(c):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if c.get("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    cfg = LlamaConfig(**SHAPES[c["shape"]], max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    full = c["method"] == "full"
    torch.set_default_dtype(torch.float32 if full else torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    if c["method"] == "qlora":
        import bitsandbytes as bnb

        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, mod in list(parent.named_children()):
                    if isinstance(mod, torch.nn.Linear):
                        q = bnb.nn.Linear4bit(
                            mod.in_features,
                            mod.out_features,
                            bias=False,
                            compute_dtype=torch.bfloat16,
                            quant_type="nf4",
                            compress_statistics=True,
                            device="meta",
                        )
                        q.weight = bnb.nn.Params4bit(
                            mod.weight.data.cpu(),
                            requires_grad=False,
                            quant_type="nf4",
                            compress_statistics=True,
                        ).to("cuda")
                        setattr(parent, name, q)
                        del mod
        torch.cuda.empty_cache()
    if not full:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=16,
                lora_alpha=32,
                lora_dropout=c.get("dropout", 0.0),
                target_modules="all-linear",
                task_type="CAUSAL_LM",
            ),
        )
    model.config.use_cache = False
    if c.get("ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    g = torch.Generator().manual_seed(0)

    def batch():
        ids = torch.randint(0, cfg.vocab_size, (c["micro"], c["seq"]), generator=g)
        pos = torch.empty_like(ids)
        for r in range(c["micro"]):
            i = 0
            while i < c["seq"]:
                n = int(min(2048, max(32, torch.empty(1).log_normal_(5.7, 0.8).item())))
                n = min(n, c["seq"] - i)
                pos[r, i : i + n] = torch.arange(n)
                i += n
        return ids.cuda(), pos.cuda()

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ga, times = c.get("ga", 1), []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _micro in range(ga):
            ids, pos = batch()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
            (loss / ga).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = c["micro"] * c["seq"] * ga
    gib = 1024**3
    return dict(
        name=c["name"],
        peak_alloc_gib=round(torch.cuda.max_memory_allocated() / gib, 2),
        peak_reserved_gib=round(torch.cuda.max_memory_reserved() / gib, 2),
        model_gib=round(base / gib, 2),
        tokens_per_s=round(tokens / (sum(times[2:]) / 2)),
        loss=round(float(loss), 3),
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
        sys.exit(0)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    for c in CONFIGS:
        t0 = time.time()
        try:
            p = subprocess.run(
                [sys.executable, __file__, json.dumps(c)],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            print(line[7:] if line else json.dumps(dict(name=c["name"], error=p.stderr[-600:])), flush=True)
        except subprocess.TimeoutExpired:
            print(json.dumps(dict(name=c["name"], error="timeout")), flush=True)
        print(f"# {c['name']} took {time.time() - t0:.0f}s", flush=True)
