"""A training step on a GPU returns once its optimizer update has run there, so that the step's time (the
step-time histogram, tokens/s, MFU) includes the update; on the CPU nothing waits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sftjob.config import TrainingSettings
from sftjob_trainer import loop, tiny
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.loop import build_optimizer, build_scheduler, train_step
from sftjob_trainer.model import precision_plan

pytestmark = pytest.mark.trainer

SETTINGS = TrainingSettings(global_batch_size=2, micro_batch_size=1, gradient_accumulation_steps=2)


def _micro_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    examples = [
        Example(ids, [IGNORE_INDEX] * 3 + ids[3:]) for ids in ([5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15])
    ]
    assert all(max(e.input_ids) < vocab for e in examples)
    return [collate([unit], Layout(False, False, 0)) for unit in make_units(examples, None)]


def _trainables(model: Any, device: torch.device) -> Trainables:
    optimizer = build_optimizer(model, SETTINGS, device)
    return Trainables(model, optimizer, build_scheduler(optimizer, SETTINGS, 10), None)


def test_a_step_waits_for_its_device_after_the_optimizer_update(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(loop, "_finish", lambda device: events.append(f"wait for {device.type}"))
    cpu = torch.device("cpu")
    parts = _trainables(tiny.tiny_llama(tiny.make_tokenizer()), cpu)
    parts.optimizer.register_step_post_hook(lambda *_: events.append("update"))

    train_step(parts, _micro_batches(320), precision_plan("full", "fp32"), 1.0, DistContext(0, 1, 0, 1, cpu))

    assert events == ["update", "wait for cpu"]


def test_only_a_cuda_device_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    synchronised: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synchronised.append)
    loop._finish(torch.device("cpu"))
    loop._finish(torch.device("cuda", 1))
    assert synchronised == [torch.device("cuda", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_step_leaves_no_optimizer_work_queued_on_the_gpu() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = torch.device("cuda", torch.cuda.current_device())
    # ~100M fp32 parameters: AdamW's update reads and writes 1.6 GB, milliseconds after the step's last sync.
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    model = LlamaForCausalLM(config).to(gpu)
    parts = _trainables(model, gpu)
    context = DistContext(0, 1, 0, 1, gpu)
    plan = precision_plan("full", "bf16")
    for _ in range(2):  # the first step also creates the optimizer's states
        train_step(parts, _micro_batches(config.vocab_size), plan, 1.0, context)
        assert torch.cuda.current_stream(gpu).query()
