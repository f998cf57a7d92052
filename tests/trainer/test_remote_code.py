"""Models of their own code (model.trustRemoteCode), built here as tiny folders with their modeling file:
one with attention of its own, no SDPA support and a mean loss, as most such models are written, and one
that subclasses transformers' Llama (its attention functions, its loss)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sftjob.config import ModelSource
from sftjob.failures import ExitCode
from sftjob_trainer import train
from sftjob_trainer.attention import VARLEN
from sftjob_trainer.batching import Layout, collate, make_units
from sftjob_trainer.data import Example
from sftjob_trainer.loop import micro_batch_loss, model_inputs
from sftjob_trainer.model import load_model_config, resolve_attention, resolve_model_class
from sftjob_trainer.observer import TRAIN_LOG_FILE
from sftjob_trainer.remote_code import computes_own_loss
from sftjob_trainer.tiny import make_tiny_model, make_tokenizer
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer
CPU = torch.device("cpu")

OWN_ATTENTION = """
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class OwnAttentionConfig(PretrainedConfig):
    model_type = "own_attention"

    def __init__(self, vocab_size=320, hidden_size=32, max_position_embeddings=512, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)


class OwnAttentionForCausalLM(PreTrainedModel):
    config_class = OwnAttentionConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        h = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).chunk(3, -1)
        h = h + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        logits = self.lm_head(h)
        loss = None
        if labels is not None:  # the mean over the micro-batch: num_items_in_batch ignored
            loss = nn.CrossEntropyLoss()(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits)
"""

LLAMA_SUBCLASS = """
from transformers import LlamaConfig, LlamaForCausalLM


class SubLlamaConfig(LlamaConfig):
    model_type = "sub_llama"


class SubLlamaForCausalLM(LlamaForCausalLM):
    config_class = SubLlamaConfig
"""


def _save_remote(folder: Path, module: str, source: str, config: str, model: str, **settings: Any) -> Path:
    """A model folder whose config.json maps AutoConfig/AutoModelForCausalLM to ``module``.py, saved in it."""
    code = folder.parent / f"{module}.py"
    code.parent.mkdir(parents=True, exist_ok=True)
    code.write_text(source)
    spec = importlib.util.spec_from_file_location(module, code)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded  # save_pretrained copies the file of the class's module
    spec.loader.exec_module(loaded)
    config_class, model_class = getattr(loaded, config), getattr(loaded, model)
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModelForCausalLM")
    tokenizer = make_tokenizer()
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    torch.manual_seed(0)
    model_class(config_class(vocab_size=len(tokenizer), **ids, **settings)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def own_attention_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The folder's name is the module's package in transformers' module cache: unique per model.
    folder = tmp_path_factory.mktemp("remote") / "sftjob_test_own_attention"
    return _save_remote(
        folder, "modeling_own_attention", OWN_ATTENTION, "OwnAttentionConfig", "OwnAttentionForCausalLM"
    )


@pytest.fixture(scope="session")
def llama_subclass_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("remote") / "sftjob_test_sub_llama"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    return _save_remote(
        folder, "modeling_sub_llama", LLAMA_SUBCLASS, "SubLlamaConfig", "SubLlamaForCausalLM", **shape
    )


def _source(folder: Path) -> ModelSource:
    return ModelSource(path=str(folder), trust_remote_code=True)


def _attention(folder: Path, requested: str, packing: bool) -> str:
    source = _source(folder)
    model_config = load_model_config(source)
    loads_as, packing = resolve_model_class(model_config, packing, source)
    return resolve_attention(requested, CPU, packing, model_config, 64, loads_as)


def _load(folder: Path, attention: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation=attention)


@pytest.mark.parametrize("requested", ["sdpa", "eager"])
def test_a_packed_run_of_remote_code_with_attention_of_its_own_trains_on_padded_batches_saying_why(
    own_attention_model: Path, requested: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert _attention(own_attention_model, requested, packing=True) == "eager"
    assert "packing off: OwnAttentionForCausalLM is the model's own code" in caplog.text
    assert "training on padded batches instead" in caplog.text


def test_unpacked_remote_code_without_sdpa_attention_loads_with_eager(own_attention_model: Path) -> None:
    assert _attention(own_attention_model, "sdpa", packing=False) == "eager"
    _load(own_attention_model, "eager")  # sdpa: "does not support an attention implementation through SDPA"


def test_packed_remote_code_on_transformers_attention_functions_keeps_the_examples_apart(
    llama_subclass_model: Path,
) -> None:
    assert _attention(llama_subclass_model, "sdpa", packing=True) == VARLEN
    model = _load(llama_subclass_model, VARLEN).eval()
    first, second = Example(list(range(3, 23)), [1] * 20), Example(list(range(40, 55)), [1] * 15)
    layout = Layout(packing=True, flatten=True, pad_id=0)
    with torch.no_grad():
        packed = model(**model_inputs(collate(make_units([first, second], 64), layout), CPU)).logits[0]
        alone = model(**model_inputs(collate(make_units([second], 64), layout), CPU)).logits[0]
    torch.testing.assert_close(packed[20:35], alone, rtol=1e-5, atol=1e-5)


def test_the_trainer_computes_the_loss_of_remote_code_as_transformers_computes_its_own(
    tiny_model: Path, llama_subclass_model: Path
) -> None:
    from transformers import AutoModelForCausalLM

    native = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not computes_own_loss(native) and computes_own_loss(_load(llama_subclass_model, "sdpa"))
    examples = [Example(list(range(3, 3 + n)), [-100] * 4 + [1] * (n - 4)) for n in (20, 13, 9)]
    for layout in (Layout(False, False, 0), Layout(True, False, 0), Layout(True, True, 0)):
        inputs = model_inputs(collate(make_units(examples, 64 if layout.packing else None), layout), CPU)
        with torch.no_grad():
            theirs = micro_batch_loss(native, inputs, 7, own_loss=False)
            ours = micro_batch_loss(native, inputs, 7, own_loss=True)
        torch.testing.assert_close(ours, theirs)


class _Logits(torch.nn.Module):
    """A model whose float32 logits, of every row of the micro-batch, are kept to compare with the loss's."""

    def __init__(self, vocabulary: int) -> None:
        super().__init__()
        self.head = torch.nn.Embedding(vocabulary, vocabulary)
        self.logits: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        self.logits = self.head(input_ids)
        return SimpleNamespace(logits=self.logits)


def test_the_trainers_loss_of_several_rows_reads_their_logits_in_place_without_copying_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cross_entropy = torch.nn.functional.cross_entropy
    read: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        read.append(logits)
        return cross_entropy(logits, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", recording)
    model, ids = _Logits(11), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 1, 2]])
    labels = ids.clone()
    labels[:, :2] = -100
    loss = micro_batch_loss(model, {"input_ids": ids, "labels": labels}, 1, own_loss=True)

    assert model.logits is not None and read[0].data_ptr() == model.logits.data_ptr()
    by_hand = cross_entropy(model.logits[:, 1:-1].flatten(0, 1), ids[:, 2:].flatten(), reduction="sum")
    torch.testing.assert_close(loss, by_hand)  # each position predicts the next label, as before


def _steps(config: Path) -> dict[int, tuple[float, float]]:
    out = Path(json.loads(config.read_text())["outputDir"])
    records = [json.loads(line) for line in (out / TRAIN_LOG_FILE).read_text().splitlines()]
    return {r["step"]: (r["loss"], r["gradNorm"]) for r in records if "gradNorm" in r}


def test_the_loss_gradient_norm_and_eval_loss_of_remote_code_do_not_depend_on_the_micro_batches(
    trainer_config: MakeConfig, own_attention_model: Path
) -> None:
    runs = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        config = trainer_config(
            name=f"micro{micro}",
            model={"path": str(own_attention_model), "trustRemoteCode": True},
            method="full",
            training={
                "maxSteps": 2,
                "microBatchSize": micro,
                "gradientAccumulationSteps": accumulation,
                "learningRate": 1e-9,  # the same weights in both runs' second step
                "packing": False,
                "packingLength": None,
            },
            evaluation={"fraction": 0.2, "maxSamples": 100},
            checkpoints={"everySteps": 100},
        )
        assert run(str(config)) == ExitCode.OK
        summary = json.loads((Path(json.loads(config.read_text())["outputDir"]) / "summary.json").read_text())
        runs[micro] = (_steps(config), summary["evalLoss"])
    (one, eval_one), (four, eval_four) = runs[8], runs[2]
    assert sorted(one) == sorted(four) == [1, 2]
    for step in one:
        assert one[step] == pytest.approx(four[step], rel=1e-4), (one, four)
    assert eval_one == pytest.approx(eval_four, rel=1e-5)
    assert 3 < one[1][0] < 8  # about ln(vocabulary), not 4 x it


def _data_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def read(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dataset was read before the model's code was checked")

    monkeypatch.setattr(train, "load_examples", read)


def test_a_packed_run_of_remote_code_with_attention_of_its_own_trains_padded_to_the_end(
    trainer_config: MakeConfig, own_attention_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = {"path": str(own_attention_model), "trustRemoteCode": True}
    with caplog.at_level(logging.INFO):
        config = trainer_config(model=model, method="full", training={"packing": True, "maxSteps": 1})
        assert run(str(config)) == ExitCode.OK
    assert "packing off: OwnAttentionForCausalLM" in caplog.text
    assert "training units (one example each)" in caplog.text


def test_remote_code_importing_a_package_the_image_lacks_ends_the_job_with_a_config_error_naming_it(
    trainer_config: MakeConfig, termination_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sftjob_operator.termination import read_message

    _data_never_read(monkeypatch)  # a package no restart brings fails in seconds, not after the data

    folder = make_tiny_model(tmp_path / "sftjob_test_missing_package", layers=1, hidden=32)
    (folder / "modeling_missing.py").write_text(
        "import sftjob_test_package_not_installed\n"
        "from transformers import LlamaForCausalLM\n\n\n"
        "class MissingForCausalLM(LlamaForCausalLM):\n    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_missing.MissingForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))

    model = {"path": str(folder), "trustRemoteCode": True}
    assert run(str(trainer_config(model=model, training={"packing": False}))) == ExitCode.CONFIG_ERROR
    said = read_message(termination_log.read_text())
    assert said.exit_code == ExitCode.CONFIG_ERROR  # permanent: no restart brings the package
    assert "sftjob_test_package_not_installed" in said.text and "set spec.image" in said.text
