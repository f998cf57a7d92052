"""A mixture of experts whose config asks for its routers' load-balancing loss (``output_router_logits``)
trains on it at its configured weight once a step, whatever the accumulation and the number of GPUs, and
reports (in training and in evaluation) its cross-entropy alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.evaluation import eval_set, evaluate
from sftjob_trainer.loop import router_balancing, train_step
from sftjob_trainer.model import precision_plan

pytestmark = pytest.mark.trainer

VOCAB = 96
WEIGHT = 0.5  # far above Mixtral's 0.02, so that a wrong weighting shows in the gradient
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,  # of 4
    "output_router_logits": True,
    "router_aux_loss_coef": WEIGHT,
}
FP32 = precision_plan("full", "fp32")
LAYOUT = Layout(packing=False, flatten=False, pad_id=0)


@dataclass(frozen=True)
class MirroredRanks(DistContext):
    """``world_size`` ranks that all hold this rank's micro-batches: a sum over them is this rank's times
    their number, and DDP's mean of their (identical) gradients is this rank's own."""

    def sum(self, values: list[float]) -> list[float]:
        return [v * self.world_size for v in values]


def _mixtral() -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4))


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **SHAPE,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
    )
    return Qwen2MoeForCausalLM(config)


MIXTURES = [_mixtral, _qwen2_moe]


def _model(family: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return family().train()


def _examples(count: int, seed: int = 0) -> list[Example]:
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        ids = [rng.randrange(1, VOCAB) for _ in range(12)]
        examples.append(Example(ids, [IGNORE_INDEX] * 4 + ids[4:]))
    return examples


def _micro_batches(examples: list[Example], count: int) -> list[dict[str, torch.Tensor]]:
    units = make_units(examples, None)
    size = len(units) // count
    return [collate(units[i * size : (i + 1) * size], LAYOUT) for i in range(count)]


def _step(
    model: Any, micro_batches: list[dict[str, torch.Tensor]], ctx: DistContext
) -> tuple[float, list[Any]]:
    """One step's reported loss and the gradients its optimizer was handed (the weights left as they were)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    handed: list[Any] = []
    optimizer.register_step_pre_hook(
        lambda *_: handed.extend(p.grad.clone() for p in model.parameters() if p.grad is not None)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    result = train_step(Trainables(model, optimizer, scheduler, None), micro_batches, FP32, 1e9, ctx)
    assert result.skipped is None
    return result.loss, handed


def _cross_entropy(model: Any, examples: list[Example]) -> float:
    """The mean cross-entropy per target token of ``examples`` in one forward pass, without balancing."""
    batch = collate(make_units(examples, None), LAYOUT)
    inputs = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")}
    with torch.no_grad():
        return float(model(**inputs, output_router_logits=False).loss)


def _assert_same(first: list[Any], second: list[Any]) -> None:
    assert len(first) == len(second) > 0
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", MIXTURES, ids=lambda f: f.__name__.strip("_"))
def test_a_mixture_s_balancing_weighs_the_same_whatever_the_accumulation_and_the_gpus(
    family: Callable[[], Any],
) -> None:
    # Four copies of one example: every forward pass routes the same tokens, so its balancing loss is the
    # whole batch's, and only the weight it is trained at could change with the layout.
    model = _model(family)
    assert router_balancing(model) == WEIGHT
    examples = _examples(1) * 4
    layouts = [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)]  # (micro-batches a rank, ranks)
    steps = [
        _step(
            model,
            _micro_batches(examples[: 4 // ranks], count),
            MirroredRanks(0, ranks, 0, ranks, torch.device("cpu")),
        )
        for count, ranks in layouts
    ]
    losses = [loss for loss, _ in steps]
    assert losses == pytest.approx([_cross_entropy(model, examples)] * len(layouts), rel=1e-5)
    for _, gradients in steps[1:]:
        _assert_same(gradients, steps[0][1])


@pytest.mark.parametrize("family", MIXTURES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("count", [1, 2, 4])
def test_a_mixture_trains_on_its_cross_entropy_and_the_mean_balancing_loss_of_its_forward_passes(
    family: Callable[[], Any], count: int
) -> None:
    model = _model(family)
    examples = _examples(4)
    micro_batches = _micro_batches(examples, count)
    loss, gradients = _step(model, micro_batches, MirroredRanks(0, 1, 0, 1, torch.device("cpu")))

    targets = sum(int(mb["num_targets"]) for mb in micro_batches)
    model.zero_grad()
    for mb in micro_batches:
        inputs = {k: mb[k] for k in ("input_ids", "labels", "attention_mask")}
        cross_entropy = model(**inputs, output_router_logits=False, num_items_in_batch=targets).loss
        balancing = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).aux_loss
        (cross_entropy + WEIGHT * balancing / count).backward()
    expected = [p.grad for p in model.parameters() if p.grad is not None]

    assert loss == pytest.approx(_cross_entropy(model, examples), rel=1e-5)
    _assert_same(gradients, expected)


@pytest.mark.parametrize("family", MIXTURES, ids=lambda f: f.__name__.strip("_"))
def test_a_mixture_s_eval_loss_is_its_cross_entropy_whatever_the_micro_batch_size(
    family: Callable[[], Any],
) -> None:
    model = _model(family)
    examples = _examples(4)
    one_process = DistContext(0, 1, 0, 1, torch.device("cpu"))
    losses = [
        evaluate(model, eval_set(examples, None, size, LAYOUT), FP32, one_process)[0] for size in (1, 2, 4)
    ]
    model.eval()  # the reference without dropout, as evaluate runs
    assert losses == pytest.approx([_cross_entropy(model, examples)] * 3, rel=1e-5)


def test_a_mixture_s_balancing_weight_is_found_inside_peft_s_wrapper() -> None:
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(_model(_mixtral), LoraConfig(r=4, target_modules=["q_proj"]))
    assert router_balancing(adapted) == WEIGHT


def test_a_dense_model_or_a_mixture_that_does_not_ask_for_balancing_adds_none() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **(SHAPE | {"output_router_logits": False}), intermediate_size=48, num_local_experts=4
    )
    assert router_balancing(MixtralForCausalLM(config)) is None
    assert router_balancing(torch.nn.Linear(2, 2)) is None


def test_a_mixture_whose_forward_lacks_the_balancing_its_config_asks_for_trains_on_cross_entropy() -> None:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = (
        Llama4TextConfig(  # Llama 4 has router_aux_loss_coef in its config and no aux_loss in its outputs
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            intermediate_size_mlp=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=1,
            output_router_logits=True,
            max_position_embeddings=64,
        )
    )
    torch.manual_seed(0)
    model = Llama4ForCausalLM(config).train()
    examples = _examples(4)
    loss, handed = _step(model, _micro_batches(examples, 2), DistContext(0, 1, 0, 1, torch.device("cpu")))
    assert handed
    assert loss == pytest.approx(_cross_entropy(model, examples), rel=1e-4)
