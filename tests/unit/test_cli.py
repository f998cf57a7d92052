"""The ``sftjob`` command, called in-process: plan tables, JSON, exit codes, the GPU list."""

import json

import pytest
import yaml

from sftjob.cli import main
from sftjob.gpu_products import default_products
from sftjob.gpus import profile_for_key
from sftjob.plan_table import plan_json
from sftjob.spec import SFTJobSpec
from sftjob_operator.planning import plan_candidates

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
    "podMemory",
    "podMemoryOtherNodes",
    "fits",
    "estimatedPeakGiB",
    "capacityGiB",
    "cardGiB",
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
    assert plans[0]["cardGiB"] == pytest.approx(44.42)


def test_gpu_flag_overrides_the_jobs_gpu_type(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, out, _ = run(capsys, "plan", "-f", str(job), "--gpu", "A800,A40", "-o", "json")
    assert code == 0
    # A GPU type is every card of it, each planned on its own as the operator plans it.
    assert [p["gpu"] for p in json.loads(out)] == [
        *["A800-SXM4-80GB", "A800-PCIE-80GB", "A800-PCIE-40GB"],
        "A40",
    ]


def test_json_lists_one_object_per_gpu_type_with_the_documented_keys(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "TinyLlama/TinyLlama-1.1B", "--method", "full", "-o", "json"
    )
    assert code == 0
    plans = json.loads(out)
    assert len(plans) == 5  # the three A800 cards, L40S and A40
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


def test_unknown_model_without_size_is_a_clear_input_error_naming_the_flag(capsys):
    code, _, err = run(capsys, "plan", "--model", "acme/mystery")
    assert code == 2
    assert "set --parameters" in err and "spec.model.parameters" not in err


def test_unknown_model_in_a_file_names_the_spec_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("meta-llama/Llama-3.1-8B-Instruct", "acme/mystery"))
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 2 and "spec.model.parameters" in err


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
    training = "training: {globalBatchSize: 16, learningRate: 0.0001, packingLength: 1024}"
    document = JOB.replace("training: {globalBatchSize: 16, learningRate: 0.0001}", training)
    document += "  resources: {cpu: 6, memory: 40Gi}\n"
    code, out, err = _plan_file(tmp_path, capsys, document)
    (cli,) = json.loads(out)
    spec = SFTJobSpec.model_validate(yaml.safe_load(document)["spec"])
    operators = plan_candidates(spec, default_products()).plans["L40S"]
    assert code == 0 and (cli["packingLength"], cli["podMemory"]) == (1024, "40Gi"), err
    assert cli == json.loads(
        json.dumps(plan_json(operators, spec.method, profile_for_key("L40S").memory_gib))
    )


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
    assert "the built-in default checkpoint claim 100Gi (the operator's may differ: its" in err
    assert "--checkpoint-size flag, the Helm value defaults.checkpoints.size)" in err
    assert "status.effective" not in err  # there is no status before the job exists
    assert "cannot hold the run" in err
    assert "Gi or more" in err
    job.write_text(full + " gpu: {type: A800, count: 8}, checkpoints: {size: 200Gi}}")
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 1 and "spec.checkpoints.size 200Gi cannot hold the run" in err


def test_a_blank_gpu_type_is_an_input_error(capsys):
    code, _, err = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu", " , ")
    assert code == 2 and "--gpu: give a GPU type" in err


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ("kind: List\napiVersion: v1\nitems: []\n", "expected kind SFTJob, apiVersion sftjob.io/v1alpha1"),
        (JOB.replace("kind: SFTJob", "kind: SFTjob"), "expected kind SFTJob"),
        (JOB.replace("name: demo", "name: " + "a" * 41), "metadata.name"),
        (JOB.replace("globalBatchSize: 16", "globalBatchSize: 16, microBatchSize: 3"), "microBatchSize 3"),
        (JOB + "  nodeSelector: {nvidia.com/gpu.product: NVIDIA-A40}\n", "no node could take the pods"),
    ],
)
def test_a_file_admission_would_refuse_is_an_input_error_saying_why(tmp_path, capsys, document, words):
    job = tmp_path / "job.yaml"
    job.write_text(document)
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 2 and words in err


def test_a_memory_below_the_plans_is_planned_with_a_warning_and_a_smaller_shm(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "  resources: {memory: 8Gi}\n")
    code, _, err = run(capsys, "plan", "-f", str(job), "-o", "json")
    assert code == 0 and "spec.resources.memory 8Gi is below the planned" in err
    assert "/dev/shm gets 2048Mi" in err


def test_a_size_given_for_a_model_of_the_built_in_table_is_said_to_be_ignored(capsys):
    code, out, _ = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--parameters", "70000000000")
    assert code == 0 and "spec.model.parameters ignored, 8.03B params" in out


def test_a_size_the_planner_ignores_is_warned_about_on_stderr_in_json_too(capsys):
    flags = ("--model", "meta-llama/Llama-3.1-8B", "--parameters", "70000000000", "-o", "json")
    code, out, err = run(capsys, "plan", *flags)
    assert code == 0 and json.loads(out)
    assert (
        "sftjob: warning: --parameters 70000000000 is ignored: meta-llama/Llama-3.1-8B is planned as the"
        " built-in Llama 3.x 8B (8.03B params)"
    ) in err


def test_capacity_is_the_usable_budget_as_in_the_status_and_card_is_the_cards_memory(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "A800-SXM4-80GB", "-o", "json"
    )
    (a800,) = json.loads(out)
    assert code == 0 and a800["cardGiB"] == pytest.approx(79.15)
    assert a800["capacityGiB"] == pytest.approx(round(79.15 * 0.9, 2))
    assert a800["estimatedPeakGiB"] <= a800["capacityGiB"]


def test_flags_override_the_fields_of_the_file(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    flags = ("--gpus", "2", "--method", "full", "--seq", "512", "--global-batch", "8")
    code, out, _ = run(capsys, "plan", "-f", str(job), *flags, "-o", "json")
    (l40s,) = json.loads(out)
    assert code in (0, 1) and l40s["gpu"] == "L40S"
    assert (l40s["method"], l40s["worldSize"], l40s["globalBatchSize"]) == ("full", 2, 8)
    assert l40s["packingLength"] <= 512


def test_a_model_flag_replaces_the_files_model(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.replace(
            "model: {name: meta-llama/Llama-3.1-8B-Instruct}",
            "model: {name: acme/x, parameters: 70000000000}",
        )
    )
    code, out, _ = run(capsys, "plan", "-f", str(job), "--model", "TinyLlama/TinyLlama-1.1B")
    assert code == 0 and out.startswith("TinyLlama/TinyLlama-1.1B (TinyLlama 1.1B")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ("--method", "qlora", "--gpus", "2"),
            "--method qlora runs on exactly one GPU: set --gpus 1 and --nodes 1",
        ),
        (("--method", "qlora", "--nodes", "2"), "--method qlora runs on exactly one GPU"),
        (("--gpus", "0"), "--gpus: "),
        (("--gpus", "9"), "--gpus: "),
        (("--nodes", "0"), "--nodes: "),
        (("--seq", "5"), "--seq: "),
        (("--global-batch", "0"), "--global-batch: "),
        (("--parameters", "5"), "--parameters: "),
    ],
)
def test_flags_get_the_specs_checks_and_errors_name_the_flag(capsys, flags, named):
    code, _, err = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", *flags)
    assert code == 2 and named in err
    assert "spec." not in err and "gpus_per_node" not in err and "max_seq_length" not in err


def test_a_flag_leaves_a_malformed_block_of_the_file_for_validation_to_refuse(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("gpu: {type: L40S, count: 1}", "gpu: L40S"))
    code, out, err = run(capsys, "plan", "-f", str(job), "--gpus", "2")
    assert code == 2 and out == "" and "job.yaml: spec.gpu: Input should be an object" in err


def test_a_batch_the_gpus_cannot_split_names_the_flag_that_set_their_count(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    code, _, err = run(capsys, "plan", "-f", str(job), "--gpus", "3")
    assert code == 2
    assert (
        "spec.training.globalBatchSize 16 is not divisible by the job's 3 GPUs (--gpus x spec.gpu.nodes)"
        in err
    )


def test_an_unexpected_error_exits_2_in_one_line_not_1_which_says_nothing_fits(monkeypatch, capsys):
    def broken(*_):
        raise RuntimeError("planner\nbroke")

    monkeypatch.setattr("sftjob.cli.plan_job", broken)
    code, out, err = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B")
    assert (code, out, err) == (2, "", "sftjob: error: unexpected RuntimeError: planner broke\n")


def test_a_flag_that_breaks_the_file_is_named_beside_the_files_field(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("learningRate: 0.0001", "learningRate: 0.0001, packingLength: 4096"))
    code, _, err = run(capsys, "plan", "-f", str(job), "--seq", "1024")
    assert code == 2 and "spec.training.packingLength 4096 exceeds --seq 1024" in err


def test_any_is_every_gpu_type_in_the_order_any_prefers(capsys):
    code, out, _ = run(capsys, "plan", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "Any", "-o", "json")
    assert code == 0 and [p["gpu"] for p in json.loads(out)] == [
        *["A800-SXM4-80GB", "A800-PCIE-80GB", "A800-PCIE-40GB"],
        "L40S",
        "A40",
    ]


@pytest.mark.parametrize(
    "training", ["{learningRate: 2}", "{seed: -1}", "{seed: 2147483648}", "{epochs: 1001}"]
)
def test_a_file_admission_would_refuse_for_a_bound_is_an_input_error(tmp_path, capsys, training):
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.replace("training: {globalBatchSize: 16, learningRate: 0.0001}", f"training: {training}")
    )
    code, out, err = run(capsys, "plan", "-f", str(job))
    assert code == 2 and out == "" and "spec.training." in err


def test_a_file_with_generate_name_is_planned_when_the_generated_name_fits(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("metadata: {name: demo}", "metadata: {generateName: llama-8b-}"))
    assert run(capsys, "plan", "-f", str(job))[0] == 0
    job.write_text(JOB.replace("metadata: {name: demo}", "metadata: {generateName: " + "a" * 36 + "}"))
    assert run(capsys, "plan", "-f", str(job))[0] == 2


def _plan_file(tmp_path, capsys, document):
    job = tmp_path / "job.yaml"
    job.write_text(document)
    return run(capsys, "plan", "-f", str(job), "-o", "json")


def test_a_number_written_as_a_string_is_an_input_error_as_at_admission(tmp_path, capsys):
    code, _, err = _plan_file(tmp_path, capsys, JOB.replace("maxSeqLength: 4096", 'maxSeqLength: "4096"'))
    assert code == 2
    assert "spec.dataset.maxSeqLength: Input should be a valid integer, not the string '4096'" in err


@pytest.mark.parametrize(
    "written", ["learningRate: 2e-4", "learningRate: 1E-5, maxSteps: 1e3", "maxSteps: 100.0"]
)
def test_numbers_are_read_as_kubectl_sends_them(tmp_path, capsys, written):
    """Exponents without a dot are numbers (YAML 1.2) and whole numbers integers, as for the API server."""
    code, _, err = _plan_file(tmp_path, capsys, JOB.replace("learningRate: 0.0001", written))
    assert code == 0, err


def test_a_quantity_written_as_a_number_is_planned(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "  resources: {cpu: 8, memory: 137438953472}\n")
    code, out, err = run(capsys, "plan", "-f", str(job))
    assert code == 0, err
    assert "8 / 137438953472 /" in out


def test_a_rules_message_that_names_its_field_is_not_prefixed_with_it_again(tmp_path, capsys):
    architecture = "{layers: 2, hiddenSize: 64, heads: 4, kvHeads: 3, intermediateSize: 128, vocabSize: 320}"
    document = JOB.replace(
        "model: {name: meta-llama/Llama-3.1-8B-Instruct}",
        f"model: {{name: org/custom, architecture: {architecture}}}",
    )
    code, _, err = _plan_file(tmp_path, capsys, document)
    assert code == 2 and "kvHeads 3 must divide heads 4" in err
    assert err.count("spec.model.architecture") == 1


def test_a_node_selector_on_one_card_plans_that_card_alone(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.replace("gpu: {type: L40S, count: 1}", "gpu: {type: A800, count: 1}")
        + "  nodeSelector: {nvidia.com/gpu.product: NVIDIA-A800-PCIE-40GB}\n"
    )
    code, out, _ = run(capsys, "plan", "-f", str(job), "-o", "json")
    assert code == 0 and [p["gpu"] for p in json.loads(out)] == ["A800-PCIE-40GB"]


def test_a_mixture_of_experts_described_by_its_dense_layers_is_refused_naming_the_architecture(
    tmp_path, capsys
):
    mixtral = (
        "{layers: 32, hiddenSize: 4096, heads: 32, kvHeads: 8, intermediateSize: 14336, vocabSize: 32000}"
    )
    model = f"model: {{name: org/mixtral-ft, parameters: 46700000000, architecture: {mixtral}}}"
    code, out, err = _plan_file(
        tmp_path, capsys, JOB.replace("model: {name: meta-llama/Llama-3.1-8B-Instruct}", model)
    )
    assert code == 2 and out == ""
    assert "spec.model.architecture cannot describe a mixture-of-experts model" in err


def test_memory_and_checkpoint_sizes_in_kibibytes_are_planned_not_a_traceback(tmp_path, capsys):
    sizes = "  resources: {memory: 67108864Ki}\n  checkpoints: {size: 104857600Ki}\n"
    code, out, err = _plan_file(tmp_path, capsys, JOB + sizes)
    assert code == 0 and json.loads(out) and "error" not in err
