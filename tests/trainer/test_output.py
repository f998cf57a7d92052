"""The trained model as users take it away: whole or not at all, written only by the attempt that owns the
job, readable by any user, never mixed with an earlier output's files, and loading as its base does (the
precision it trained in, its KV cache, its sampling defaults, the base revision it was trained on)."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sftjob.config import JobRef, LoraSettings, ModelSource, TrainerConfig, TrainingSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import output, ownership
from sftjob_trainer.chat import ensure_chat_template
from sftjob_trainer.checkpoints import checkpoint_dirs
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.failures import classify
from sftjob_trainer.model import prepare_for_training
from sftjob_trainer.observer import TRAIN_LOG_FILE
from sftjob_trainer.output import save_output
from sftjob_trainer.preflight import check_model_files
from sftjob_trainer.tiny import make_tokenizer, tiny_llama
from tests.trainer.runs import tiny_glm_moe_config

pytestmark = pytest.mark.trainer

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
CPU = torch.device("cpu")
SUMMARY = {"steps": 12, "finalLoss": 1.5}


def _config(
    tmp_path: Path, attempt: int = 1, output_dir: Path | None = None, uid: str = "uid-1"
) -> TrainerConfig:
    return TrainerConfig(
        job=JobRef(name="job", uid=uid, attempt=attempt),
        model={"path": "/model"},
        dataset={"path": "/data"},
        training={"globalBatchSize": 1},
        checkpoints={"dir": str(tmp_path / "checkpoints")},
        output_dir=str(output_dir or tmp_path / "final"),
    )


def _writes(files: dict[str, bytes]) -> Callable[[Path], None]:
    def write(folder: Path) -> None:
        for name, content in files.items():
            (folder / name).write_bytes(content)

    return write


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_full_fine_tune_is_written_in_bf16_with_a_config_that_says_so_and_its_head_still_tied(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer, tied=True)
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}

    save_output(model, tokenizer, tmp_path, None, torch.bfloat16)

    files = load_file(tmp_path / "model.safetensors")
    assert {t.dtype for t in files.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.float32  # the live model is left as it was
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name].to(torch.bfloat16)), name


def test_a_full_fine_tune_writes_in_fp32_what_its_model_keeps_in_fp32_as_from_pretrained_loads_it(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM, Glm4MoeForCausalLM

    tokenizer = make_tokenizer()
    shape = tiny_glm_moe_config(len(tokenizer))
    model = Glm4MoeForCausalLM(shape)  # _keep_in_fp32_modules_strict: its router's correction bias
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    routing = torch.tensor([0.1234567, -2.3456789, 3.4567891, 1e-4])  # digits bf16 would round away
    with torch.no_grad():
        model.get_buffer(bias).copy_(routing)

    save_output(model, tokenizer, tmp_path, None, torch.bfloat16)

    files = load_file(tmp_path / "model.safetensors")
    assert files[bias].dtype == torch.float32 and torch.equal(files[bias], routing)
    assert {t.dtype for name, t in files.items() if name != bias} == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.get_buffer(bias), routing)


def test_a_fully_fine_tuned_model_keeps_the_kv_cache_setting_of_its_base(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    model = prepare_for_training(
        tiny_llama(tokenizer), "full", LoraSettings(), TrainingSettings(gradient_checkpointing=True), CPU
    )
    save_output(model, tokenizer, tmp_path, None, torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_prepared_model_trains_with_its_checkpointed_layers_recomputed(method: str) -> None:
    tokenizer = make_tokenizer()
    model = prepare_for_training(
        tiny_llama(tokenizer), method, LoraSettings(), TrainingSettings(gradient_checkpointing=True), CPU
    )
    assert model.training
    attention = next(m for name, m in model.named_modules() if name.endswith("layers.0.self_attn"))
    calls = []
    attention.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(calls) == 2  # the forward, and its recomputation in the backward


def test_a_base_with_sampling_values_but_no_do_sample_saves_its_fine_tune_stopping_at_the_turn_end(
    tmp_path: Path,
) -> None:
    from transformers import GenerationConfig

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    ensure_chat_template(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    base = tmp_path / "base"
    base.mkdir()  # as lmsys/vicuna-7b-v1.5 ships it: strict validation refuses to save it once changed
    (base / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.7, "top_p": 0.8}')
    model = tiny_llama(tokenizer)
    model.generation_config = GenerationConfig.from_pretrained(base)

    save_output(model, tokenizer, tmp_path / "final", None, torch.bfloat16)

    saved = GenerationConfig.from_pretrained(tmp_path / "final")
    assert (saved.eos_token_id, saved.temperature, saved.top_p) == ([2, im_end], 0.7, 0.8)
    assert model.generation_config.eos_token_id == 2  # the live model's is left as loaded


def test_a_full_disk_under_safetensors_is_a_storage_error_that_leaves_no_partial_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import SafetensorError

    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer)
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def disk_full(folder: Path, **kwargs: object) -> None:
        (folder / "model.safetensors").write_bytes(b"cut off")
        raise full

    monkeypatch.setattr(model, "save_pretrained", disk_full)
    with pytest.raises(TrainerError) as saving:
        output.save(
            _config(tmp_path),
            ONE_PROCESS,
            SUMMARY,
            lambda f: save_output(model, tokenizer, f, None, torch.bfloat16),
        )
    assert saving.value.code == ExitCode.STORAGE_ERROR
    assert "could not save the output to" in saving.value.reason
    assert "[Errno 28] Error while serializing" in saving.value.reason
    assert _names(tmp_path) == []  # the restart gets the space back
    assert classify(full)[0] == ExitCode.STORAGE_ERROR  # wherever else it is raised
    unreadable = SafetensorError("Error while deserializing header: HeaderTooLarge")
    assert classify(unreadable)[0] == ExitCode.UNKNOWN


def test_an_adapter_names_the_revision_of_the_base_it_was_trained_on(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    model = prepare_for_training(
        tiny_llama(tokenizer), "lora", LoraSettings(), TrainingSettings(), CPU, revision="0123abcd"
    )
    save_output(model, tokenizer, tmp_path, None, None)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["revision"] == "0123abcd"


def test_the_output_files_are_readable_by_a_serving_pod_of_another_user(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    model = tiny_llama(tokenizer)
    config = _config(tmp_path)

    def write(folder: Path) -> None:
        save_output(model, tokenizer, folder, None, torch.bfloat16)

    out = output.save(config, ONE_PROCESS, SUMMARY, write)

    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes  # safetensors writes 0600


def test_the_output_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    config = _config(tmp_path)
    out = Path(config.output_dir)
    out.mkdir()
    (out / TRAIN_LOG_FILE).write_text('{"step": 1}\n')  # what the run wrote there while training

    def killed_half_way(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"cut off")
        raise KeyboardInterrupt  # stands in for the kill

    with pytest.raises(KeyboardInterrupt):
        output.save(config, ONE_PROCESS, SUMMARY, killed_half_way)
    assert _names(out) == [TRAIN_LOG_FILE]

    output.save(config, ONE_PROCESS, SUMMARY, _writes({"config.json": b"{}", "model.safetensors": b"whole"}))
    assert _names(out) == ["config.json", "model.safetensors", output.SUMMARY_FILE, TRAIN_LOG_FILE]
    assert (out / TRAIN_LOG_FILE).read_text() == '{"step": 1}\n'
    summary = json.loads((out / output.SUMMARY_FILE).read_text())
    assert summary == SUMMARY | {"job": {"namespace": "default", "name": "job", "uid": "uid-1"}}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # the unfinished one too


def test_an_attempt_superseded_before_or_while_writing_its_output_writes_none(tmp_path: Path) -> None:
    old, new = _config(tmp_path, attempt=1), _config(tmp_path, attempt=2)
    root = Path(old.checkpoints.dir)
    ownership.take_over(root, old.job, ONE_PROCESS)
    ownership.take_over(root, new.job, ONE_PROCESS)  # the restart began while attempt 1 still ran

    with pytest.raises(TrainerError) as before:
        output.check_owner(old, ONE_PROCESS)
    assert before.value.code == ExitCode.PREEMPTED
    with pytest.raises(TrainerError) as committing:
        output.save(old, ONE_PROCESS, SUMMARY, _writes({"adapter_model.safetensors": b"old"}))
    assert committing.value.code == ExitCode.PREEMPTED
    assert "superseded by attempt 2" in committing.value.reason
    assert not Path(old.output_dir).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_restart_replaces_its_jobs_earlier_output_whole(tmp_path: Path) -> None:
    first = _config(tmp_path, attempt=1)
    output.save(first, ONE_PROCESS, SUMMARY, _writes({"model.safetensors": b"full"}))
    out = Path(first.output_dir)
    (out / TRAIN_LOG_FILE).write_text('{"step": 1}\n{"step": 2}\n')

    (tmp_path / ".tmp-final-attempt-1-replaced").mkdir()  # attempt 1 killed between its two renames
    (tmp_path / ".tmp-final-2-attempt-1").mkdir()  # another output's, in the same folder

    second = _config(tmp_path, attempt=2)
    output.save(second, ONE_PROCESS, SUMMARY, _writes({"adapter_model.safetensors": b"lora"}))
    assert _names(out) == ["adapter_model.safetensors", output.SUMMARY_FILE, TRAIN_LOG_FILE]
    assert len((out / TRAIN_LOG_FILE).read_text().splitlines()) == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == [".tmp-final-2-attempt-1"]


def test_a_job_created_again_under_its_name_replaces_its_predecessors_output_whole(tmp_path: Path) -> None:
    earlier, again = _config(tmp_path, uid="uid-1"), _config(tmp_path, uid="uid-2")
    adapter = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"lora"}
    output.save(earlier, ONE_PROCESS, SUMMARY, _writes(adapter))

    out = output.save(
        again, ONE_PROCESS, SUMMARY, _writes({"config.json": b"{}", "model.safetensors": b"full"})
    )
    assert _names(out) == ["config.json", "model.safetensors", output.SUMMARY_FILE]  # no stale adapter
    assert json.loads((out / output.SUMMARY_FILE).read_text())["job"]["uid"] == "uid-2"


EARLIER_OUTPUT = [
    "adapter_config.json",
    "adapter_model.safetensors",
    "model.safetensors",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
]


@pytest.mark.parametrize("killed", [False, True], ids=["complete", "set aside by a killed attempt"])
def test_an_output_moved_into_a_folder_not_the_jobs_own_leaves_no_file_of_an_earlier_output_beside_it(
    tmp_path: Path, killed: bool
) -> None:
    config = _config(tmp_path, output_dir=tmp_path / "checkpoints")  # an earlier output in the same place
    out = Path(config.output_dir)
    out.mkdir()
    for name in [*EARLIER_OUTPUT, "notes.txt", "my_config.json", "tokenizer_notes.txt"]:
        (out / name).write_text("earlier")
    # A kill after the earlier summary.json was set aside leaves it under its temporary name.
    (out / (output.EARLIER_SUMMARY_FILE if killed else output.SUMMARY_FILE)).write_text("{}")

    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    new = [*shards, "model.safetensors.index.json", "config.json", "tokenizer.json"]
    output.save(config, ONE_PROCESS, SUMMARY, _writes(dict.fromkeys(new, b"new")))
    kept = ["notes.txt", "my_config.json", "tokenizer_notes.txt"]
    assert _names(out) == sorted([*new, *kept, output.SUMMARY_FILE])
    assert {(out / name).read_text() for name in new} == {"new"}


def test_a_folder_without_an_earlier_output_keeps_the_users_files_of_model_and_tokenizer_names(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, output_dir=tmp_path / "checkpoints")  # a shared volume's root, say
    out = Path(config.output_dir)
    out.mkdir()
    users = ["config.json", "tokenizer_config.json", "vocab.json", "merges.txt", "adapter_notes.txt"]
    for name in users:
        (out / name).write_text("mine")

    output.save(config, ONE_PROCESS, SUMMARY, _writes({"adapter_model.safetensors": b"lora"}))
    assert _names(out) == sorted([*users, "adapter_model.safetensors", output.SUMMARY_FILE])
    assert {(out / name).read_text() for name in users} == {"mine"}


@pytest.mark.parametrize("where", ["a folder with other files", "the checkpoint folder"])
def test_an_output_folder_that_is_not_the_jobs_own_keeps_what_it_holds(tmp_path: Path, where: str) -> None:
    if where == "the checkpoint folder":
        config = _config(tmp_path, output_dir=tmp_path / "checkpoints")
        root = Path(config.checkpoints.dir)
        ownership.take_over(root, config.job, ONE_PROCESS)
        (root / "checkpoint-4").mkdir()
    else:
        config = _config(tmp_path)
        Path(config.output_dir).mkdir()
    out = Path(config.output_dir)
    (out / "notes.txt").write_text("mine")
    (out / output.SUMMARY_FILE).write_text("{}")  # someone else's, or a previous version's

    assert not output.replaceable(out, Path(config.checkpoints.dir), config.job)
    output.save(config, ONE_PROCESS, SUMMARY, _writes({"model.safetensors": b"whole"}))
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").read_bytes() == b"whole"
    assert json.loads((out / output.SUMMARY_FILE).read_text())["steps"] == SUMMARY["steps"]
    assert not [p for p in (*tmp_path.iterdir(), *out.iterdir()) if p.name.startswith(".tmp-")]
    if where == "the checkpoint folder":
        assert [step for step, _ in checkpoint_dirs(out)] == [4]


def test_a_nan_final_loss_is_written_to_summary_json_as_null(tmp_path: Path) -> None:
    config = _config(tmp_path)
    ownership.take_over(Path(config.checkpoints.dir), config.job, ONE_PROCESS)
    out = output.save(config, ONE_PROCESS, {"steps": 12, "finalLoss": float("nan")}, _writes({}))

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert (summary["steps"], summary["finalLoss"]) == (12, None)


def test_an_adapter_given_as_model_path_is_refused_with_the_way_to_merge_it(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"lora")
    with pytest.raises(TrainerError, match=r"holds a LoRA adapter .* merge it into its base") as refused:
        check_model_files(ModelSource(path=str(tmp_path)))
    assert refused.value.code == ExitCode.MODEL_LOAD_ERROR
    assert "docs/output.md" in refused.value.reason
