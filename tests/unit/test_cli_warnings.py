"""``sftjob plan``'s warnings about a spec admission takes but the trainer would ignore or fail on."""

import pytest

from tests.unit.test_cli import JOB, _plan_file


def test_a_lora_block_on_a_full_fine_tune_is_said_to_be_ignored(tmp_path, capsys):
    code, _, err = _plan_file(tmp_path, capsys, JOB.replace("method: lora", "method: full"))
    assert code in (0, 1) and "warning: spec.lora is ignored: method full" in err


def test_a_full_fine_tune_without_a_lora_block_gets_no_such_warning(tmp_path, capsys):
    document = JOB.replace("method: lora", "method: full").replace(
        "  lora: {r: 16, alpha: 32, targetModules: [all-linear]}\n", ""
    )
    _, _, err = _plan_file(tmp_path, capsys, document)
    assert "spec.lora" not in err


def test_target_modules_that_name_no_layer_of_a_known_model_are_warned_about(tmp_path, capsys):
    code, _, err = _plan_file(tmp_path, capsys, JOB.replace("[all-linear]", "[qproj, vproj]"))
    assert code == 0
    assert (
        "warning: spec.lora.targetModules ['qproj', 'vproj']: none is an attention or MLP projection" in err
    )
    assert "ConfigError" in err


@pytest.mark.parametrize("targets", ["[q_proj, vproj]", "[self_attn.q_proj]", "[all-linear]"])
def test_target_modules_naming_a_projection_get_no_warning(tmp_path, capsys, targets):
    _, _, err = _plan_file(tmp_path, capsys, JOB.replace("[all-linear]", targets))
    assert "targetModules" not in err


def test_target_modules_of_a_model_sized_by_its_parameters_are_not_second_guessed(tmp_path, capsys):
    document = JOB.replace(
        "model: {name: meta-llama/Llama-3.1-8B-Instruct}",
        "model: {name: org/gpt-like, parameters: 1000000000}",
    )
    code, _, err = _plan_file(tmp_path, capsys, document.replace("[all-linear]", "[c_attn]"))
    assert code == 0 and "targetModules" not in err
