"""The ``sftjob`` command, called in-process: plan tables, JSON, exit codes, the GPU list."""

import json

import pytest

from sftjob.cli import main

JOB = """
apiVersion: sftjob.io/v1alpha1
kind: SFTJob
metadata: {name: demo}
spec:
  model: {name: meta-llama/Llama-3.1-8B-Instruct}
  dataset: {name: HuggingFaceH4/ultrachat_200k, maxSeqLength: 4096}
  method: lora
  lora: {r: 16, alpha: 32, targetModules: [all-linear]}
  gpu: {type: L40S, count: 1}
  training: {globalBatchSize: 16, learningRate: 0.0001}
"""

JSON_KEYS = {
    "gpu",
    "fits",
    "estimatedPeakGiB",
    "capacityGiB",
    "microBatchSize",
    "gradientAccumulationSteps",
    "globalBatchSize",
    "gradientCheckpointing",
    "precision",
    "method",
    "reason",
}


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_from_flags_prints_every_gpu_type_side_by_side(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--method", "lora", "--seq", "4096"
    )
    assert code == 0
    header = next(line for line in out.splitlines() if "A800-SXM4-80GB" in line and "L40S" in line)
    assert "A40" in header
    for row in ("fits", "peak / usable GiB", "micro x accum x GPUs", "activations GiB", "weights GiB"):
        assert row in out


def test_plan_from_yaml_uses_the_jobs_gpu_type_and_overrides(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, out, _ = run(capsys, "plan", "-f", str(job), "-o", "json")
    assert code == 0
    plans = json.loads(out)
    assert [p["gpu"] for p in plans] == ["L40S"]
    assert set(plans[0]) >= JSON_KEYS
    assert plans[0]["globalBatchSize"] == 16
    assert plans[0]["method"] == "lora"
    assert plans[0]["capacityGiB"] == pytest.approx(44.42)


def test_gpu_flag_overrides_the_jobs_gpu_type(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, out, _ = run(capsys, "plan", "-f", str(job), "--gpu", "A800,A40", "-o", "json")
    assert code == 0
    assert [p["gpu"] for p in json.loads(out)] == ["A800-SXM4-80GB", "A40"]


def test_json_lists_one_object_per_gpu_type_with_the_documented_keys(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "TinyLlama/TinyLlama-1.1B", "--method", "full", "-o", "json"
    )
    assert code == 0
    plans = json.loads(out)
    assert len(plans) == 3
    for p in plans:
        assert set(p) >= JSON_KEYS
        assert p["microBatchSize"] * p["gradientAccumulationSteps"] == p["globalBatchSize"]


def test_nothing_fits_exits_1_with_the_reason_and_suggestions(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "meta-llama/Llama-3.1-70B", "--method", "full", "--gpu", "A40"
    )
    assert code == 1
    assert "NO" in out
    assert "needs ~" in out
    assert "try:" in out


def test_nothing_fits_in_json_too(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "meta-llama/Llama-3.1-70B", "--method", "full", "-o", "json"
    )
    assert code == 1
    assert not any(p["fits"] for p in json.loads(out))
    assert all(p["reason"] for p in json.loads(out))


def test_exit_0_when_at_least_one_gpu_type_fits(capsys):
    code, _, _ = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-70B", "--method", "qlora")
    assert code == 0


def test_unknown_model_without_size_is_a_clear_input_error(capsys):
    code, _, err = run(capsys, "plan", "--model", "acme/mystery")
    assert code == 2
    assert "spec.model.parameters" in err


def test_unknown_model_with_parameters_is_planned(capsys):
    code, out, _ = run(capsys, "plan", "--model", "acme/mystery", "--parameters", "3000000000", "-o", "json")
    assert code == 0
    assert json.loads(out)[0]["fits"]


def test_unknown_gpu_type_is_an_input_error(capsys):
    code, _, err = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "V100")
    assert code == 2
    assert "V100" in err


def test_missing_file_is_an_input_error(tmp_path, capsys):
    code, _, err = run(capsys, "plan", "-f", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "cannot read" in err


def test_bad_training_override_names_the_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("globalBatchSize: 16", "globalBatchSize: -1"))
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 2
    assert "globalBatchSize" in err or "global_batch_size" in err


def test_gpus_lists_the_profile_table_with_dense_numbers(capsys):
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    assert "NVIDIA-A800-SXM4-80GB" in out
    line = next(line for line in out.splitlines() if line.startswith("A800-SXM4-80GB"))
    assert " 312 " in line and "624" not in line


def test_gpus_json_is_machine_readable(capsys):
    code, out, _ = run(capsys, "gpus", "-o", "json")
    assert code == 0
    keys = {p["key"] for p in json.loads(out)}
    assert {"A800-SXM4-80GB", "A40", "L40S"} <= keys


def test_a_jobs_preferred_gpu_types_are_the_ones_planned(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("gpu: {type: L40S, count: 1}", "gpu: {types: [L40S, A40], count: 1}"))
    code, out, _ = run(capsys, "plan", "-f", str(job), "-o", "json")
    assert code == 0 and [p["gpu"] for p in json.loads(out)] == ["L40S", "A40"]


def test_a_jobs_packing_length_and_resources_plan_as_the_operator_would(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    training = "training: {globalBatchSize: 16, learningRate: 0.0001, packingLength: 1024}"
    job.write_text(JOB.replace("training: {globalBatchSize: 16, learningRate: 0.0001}", training))
    code, out, _ = run(capsys, "plan", "-f", str(job), "-o", "json")
    assert code == 0 and json.loads(out)[0]["packingLength"] == 1024


def test_a_spec_admission_would_refuse_is_an_input_error_naming_the_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("name: HuggingFaceH4/ultrachat_200k", "path: /etc/passwd"))
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 2 and "spec.dataset.path" in err


def test_a_checkpoint_claim_too_small_for_the_run_exits_1_with_the_size_to_ask_for(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    full = "spec: {model: {name: Qwen/Qwen2.5-7B-Instruct}, dataset: {name: org/chats}, method: full,"
    job.write_text(full + " gpu: {type: A800, count: 8}}")
    code, out, err = run(capsys, "plan", "-f", str(job))
    assert code == 1 and "checkpoint GiB (one)" in out
    assert "spec.checkpoints.size 100Gi cannot hold the run" in err and "Gi or more" in err
