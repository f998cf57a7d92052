"""``spec.output.mergeAdapter``: beside the adapter, one standalone model with the adapter merged into its
base, which computes what the base with the adapter computes and loads without peft; an earlier output's
merged model never outlives it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sftjob.config import JobRef, LoraSettings, TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import merging, output
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.durable import TMP_PREFIX
from sftjob_trainer.model import prepare_for_training
from sftjob_trainer.tiny import make_tokenizer, tiny_llama
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


def _adapter(
    tmp_path: Path, tiny_model: Path, fill: float | None = None, targets: list[str] | None = None
) -> Path:
    from transformers import AutoModelForCausalLM

    lora = LoraSettings(r=4, alpha=8, target_modules=targets or "all-linear")
    model = prepare_for_training(
        AutoModelForCausalLM.from_pretrained(tiny_model),
        "lora",
        lora,
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
    assert "makes" in str(failure.value) and "weights not finite" in str(failure.value)


def test_an_adapter_on_a_tied_head_is_merged_into_a_head_of_its_own_leaving_the_embeddings_as_they_were(
    tmp_path: Path,
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tied"
    tokenizer = make_tokenizer()
    tiny_llama(tokenizer, tied=True).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    adapter = _adapter(tmp_path, folder, fill=0.05, targets=["q_proj", "lm_head"])

    merged = merging.merged_model(_config(folder, "lora", "fp32"), adapter)
    out = tmp_path / "merged"
    output.save_output(merged, tokenizer, out, None, torch.float32)
    standalone = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), adapter)
    assert torch.allclose(_logits(standalone), _logits(adapted), atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(folder)
    embeddings = standalone.get_input_embeddings().weight
    assert torch.equal(embeddings, base.get_input_embeddings().weight)
    assert not torch.equal(standalone.get_output_embeddings().weight, embeddings)


def _write(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        for name, content in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(content)

    return write


def _volume_root(tmp_path: Path, merge: bool) -> TrainerConfig:
    """A job whose output is the checkpoint volume's root: not its own folder, so outputs move in file by
    file beside what else is there."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(exist_ok=True)
    return TrainerConfig(
        job=JobRef(name="job"),
        model={"path": "/model"},
        dataset={"path": "/data"},
        training={"globalBatchSize": 1},
        checkpoints={"dir": str(checkpoints)},
        output_dir=str(checkpoints),
        merge_adapter=merge,
    )


MERGED_SUMMARY = {"steps": 1, "mergedModel": merging.MERGED_FOLDER}


@pytest.mark.parametrize("merges_again", [True, False])
def test_an_earlier_outputs_merged_model_is_replaced_or_removed_by_the_next_output(
    tmp_path: Path, merges_again: bool
) -> None:
    earlier = {
        "adapter_model.safetensors": b"old",
        "merged/model.safetensors": b"old",
        "merged/x.json": b"old",
    }
    output.save(_volume_root(tmp_path, True), ONE_PROCESS, MERGED_SUMMARY, _write(earlier))
    out = tmp_path / "checkpoints"
    assert (out / "merged" / "x.json").read_bytes() == b"old"

    new = {"adapter_model.safetensors": b"new"}
    if merges_again:
        new["merged/model.safetensors"] = b"new"
    summary = MERGED_SUMMARY if merges_again else {"steps": 2}
    output.save(_volume_root(tmp_path, merges_again), ONE_PROCESS, summary, _write(new))
    if merges_again:
        assert sorted(p.name for p in (out / "merged").iterdir()) == ["model.safetensors"]
        assert (out / "merged" / "model.safetensors").read_bytes() == b"new"
    else:
        assert not (out / "merged").exists()
    assert (out / "adapter_model.safetensors").read_bytes() == b"new"


@pytest.mark.parametrize("what", ["a folder", "a file", "a link"])
def test_a_merged_entry_of_the_users_own_fails_a_merging_job_and_is_kept_by_one_that_does_not_merge(
    tmp_path: Path, what: str
) -> None:
    out = tmp_path / "checkpoints"
    out.mkdir()
    mine = out / "merged"
    if what == "a folder":
        mine.mkdir()
        (mine / "model.safetensors").write_bytes(b"mine")
    elif what == "a file":
        mine.write_bytes(b"mine")
    else:
        (tmp_path / "elsewhere").mkdir()
        mine.symlink_to(tmp_path / "elsewhere")

    new = {"adapter_model.safetensors": b"new", "merged/model.safetensors": b"new"}
    with pytest.raises(TrainerError) as refused:
        output.save(_volume_root(tmp_path, True), ONE_PROCESS, MERGED_SUMMARY, _write(new))
    assert refused.value.code == ExitCode.CONFIG_ERROR
    assert "is in the way of the merged model" in refused.value.reason
    assert not (out / output.SUMMARY_FILE).exists() and not (out / "adapter_model.safetensors").exists()

    output.save(
        _volume_root(tmp_path, False), ONE_PROCESS, {"steps": 1}, _write({"adapter_model.safetensors": b"a"})
    )
    output.save(
        _volume_root(tmp_path, False), ONE_PROCESS, {"steps": 2}, _write({"adapter_model.safetensors": b"b"})
    )
    assert os.path.lexists(mine)  # an earlier output without a merged model: the user's stays
    if what == "a folder":
        assert (mine / "model.safetensors").read_bytes() == b"mine"


def test_a_killed_attempts_unfinished_output_is_removed_before_the_next_one_is_written(
    tmp_path: Path,
) -> None:
    config = _volume_root(tmp_path, True)
    out = tmp_path / "checkpoints"
    unfinished = out / f"{TMP_PREFIX}checkpoints-attempt-1" / "merged"
    unfinished.mkdir(parents=True)
    (unfinished / "model.safetensors").write_bytes(b"half")
    seen: list[str] = []

    def write(folder: Path) -> None:
        seen.extend(p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX) and p != folder)
        _write({"adapter_model.safetensors": b"new"})(folder)

    output.save(
        config.model_copy(update={"job": JobRef(name="job", attempt=2)}), ONE_PROCESS, {"steps": 1}, write
    )
    assert seen == []
    assert not [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
