"""A tiny random Llama and a tokenizer trained on the fly, plus a learnable synthetic SFT dataset.

For tests, the local demo and CPU smoke runs: nothing is downloaded. The task is copying a few
random words (``repeat: qzx abw`` -> ``qzx abw``), which a 2-layer model learns within tens of
steps, so falling loss shows that training is real. Rows come in each of the trainer's formats.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
_LETTERS = "abcdefghij"


def copy_task(rows: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: repeat 2-4 random three-letter words."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(rows):
        words = " ".join("".join(rng.choice(_LETTERS) for _ in range(3)) for _ in range(rng.randint(2, 4)))
        pairs.append((f"repeat: {words}", words))
    return pairs


def format_row(prompt: str, answer: str, fmt: str) -> dict[str, Any]:
    if fmt == "messages":
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
    if fmt == "alpaca":
        return {"instruction": prompt, "input": "", "output": answer}
    return {"text": f"{prompt}\n{answer}"}


def write_dataset(path: Path, fmt: str, rows: int = 256, seed: int = 0) -> Path:
    """A JSONL file of the copy task in ``fmt`` (messages, alpaca or text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for prompt, answer in copy_task(rows, seed):
            fh.write(json.dumps(format_row(prompt, answer, fmt)) + "\n")
    return path


def make_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer (no unknown tokens) trained in-process on the task's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"{p}\n{a}" for p, a in copy_task(512, seed=1)] + ["<|user|>\n<|assistant|>\n<|system|>\n"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos)


def make_tiny_model(folder: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """Save a random-initialised tiny Llama and its tokenizer to ``folder`` (a ``model.path``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_llama(tokenizer: Any, tied: bool = False, **config: Any) -> Any:
    """A one-layer random Llama for ``tokenizer``, in memory (fp32, as full fine-tuning keeps it);
    ``config`` adds LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        **config,
    )
    return LlamaForCausalLM(shape)
