"""``spec.output.mergeAdapter``: beside the adapter, one standalone model with the adapter merged into its
base, which computes what the base with the adapter computes and loads without peft; an earlier output's
merged model never outlives it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sftjob.config import JobRef, LoraSettings, TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import merging, output
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.model import prepare_for_training
from sftjob_trainer.train import run
from tests.trainer.runs import MakeConfig

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 8, 64]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def test_a_lora_run_that_merges_writes_a_model_computing_what_the_base_with_its_adapter_computes(
    trainer_config: MakeConfig, tiny_model: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = trainer_config("messages", training={"maxSteps": 4}, mergeAdapter=True)
    assert run(str(config)) == ExitCode.OK
    out = Path(json.loads(config.read_text())["outputDir"])
    merged = out / merging.MERGED_FOLDER

    assert (out / "adapter_model.safetensors").is_file()  # the adapter stays, for serving beside the base
    assert (merged / "model.safetensors").is_file() and (merged / "tokenizer.json").is_file()
    assert not (merged / "adapter_config.json").exists()
    assert json.loads((merged / "config.json").read_text())["dtype"] == "float32"  # as it trained (fp32)
    assert json.loads((out / output.SUMMARY_FILE).read_text())["mergedModel"] == merging.MERGED_FOLDER

    standalone = AutoModelForCausalLM.from_pretrained(merged)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not torch.allclose(_logits(adapted), _logits(base), atol=1e-4)  # the adapter learned something
    assert torch.allclose(_logits(standalone), _logits(adapted), atol=1e-5)
    assert AutoTokenizer.from_pretrained(merged).vocab == AutoTokenizer.from_pretrained(out).vocab


def _adapter(tmp_path: Path, tiny_model: Path, fill: float | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    model = prepare_for_training(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        "lora",
        LoraSettings(r=4, alpha=8),
        TrainingSettings(),
        torch.device("cpu"),
    )
    if fill is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(fill)
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    return folder


def _config(tiny_model: Path, method: str, precision: str = "bf16") -> TrainerConfig:
    return TrainerConfig(
        job=JobRef(name="job"),
        model={"path": str(tiny_model)},
        dataset={"path": "/data"},
        method=method,
        training={"globalBatchSize": 1, "precision": precision},
        merge_adapter=True,
    )


def test_a_qlora_adapter_is_merged_into_the_base_in_bf16_not_into_its_four_bit_copy(
    tmp_path: Path, tiny_model: Path
) -> None:
    merged = merging.merged_model(_config(tiny_model, "qlora"), _adapter(tmp_path, tiny_model, fill=0.01))
    weights = dict(merged.named_parameters())
    assert {p.dtype for p in weights.values()} == {torch.bfloat16}
    assert not [name for name in weights if "lora_" in name]
    assert type(weights["model.layers.0.self_attn.q_proj.weight"]) is torch.nn.Parameter  # no Params4bit


def test_an_adapter_whose_merged_weights_are_not_finite_fails_as_diverged(
    tmp_path: Path, tiny_model: Path
) -> None:
    adapter = _adapter(tmp_path, tiny_model, fill=float("nan"))
    with pytest.raises(TrainerError) as failure:
        merging.merged_model(_config(tiny_model, "lora", "fp32"), adapter)
    assert failure.value.code == ExitCode.DIVERGED
    assert "could not be merged into its base" in str(failure.value)


def _write(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        for name, content in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(content)

    return write


@pytest.mark.parametrize("merges_again", [True, False])
def test_an_output_in_a_folder_not_the_jobs_own_replaces_an_earlier_outputs_merged_model(
    tmp_path: Path, merges_again: bool
) -> None:
    checkpoints = tmp_path / "checkpoints"
    config = TrainerConfig(
        job=JobRef(name="job"),
        model={"path": "/model"},
        dataset={"path": "/data"},
        training={"globalBatchSize": 1},
        checkpoints={"dir": str(checkpoints)},
        output_dir=str(checkpoints),  # the checkpoint volume's root: outputs move in file by file
    )
    checkpoints.mkdir()
    earlier = {
        "adapter_model.safetensors": b"old",
        "merged/model.safetensors": b"old",
        "merged/x.json": b"old",
    }
    output.save(config, ONE_PROCESS, {"steps": 1}, _write(earlier))
    assert (checkpoints / "merged" / "x.json").read_bytes() == b"old"

    new = {"adapter_model.safetensors": b"new"}
    if merges_again:
        new["merged/model.safetensors"] = b"new"
    output.save(config, ONE_PROCESS, {"steps": 2}, _write(new))
    merged = checkpoints / "merged"
    if merges_again:
        assert sorted(p.name for p in merged.iterdir()) == ["model.safetensors"]
        assert (merged / "model.safetensors").read_bytes() == b"new"
    else:
        assert not merged.exists()
    assert (checkpoints / "adapter_model.safetensors").read_bytes() == b"new"
