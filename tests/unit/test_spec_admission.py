"""What the spec model refuses beside the CRD, so that `sftjob plan -f` and the operator refuse what
`kubectl apply` does: pod settings that would change how the trainer is run or confined, bounds the CRD
holds, and field combinations the trainer cannot honour. tests/e2e/test_operator_validation.py sends the
same specs to a real API server. A few rules have no CEL twin (an architecture its parameter count
contradicts; env names and RDMA resource names the API server refuses only in the pod): the operator
refuses them as InvalidSpec."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob.spec import SFTJobSpec, to_plan_request
from sftjob.spec_rules import packing_problem
from sftjob_operator.builders import trainer_config
from sftjob_operator.planning import plan_candidates
from sftjob_operator.reconcile import reconcile
from sftjob_operator.scheduling import default_products
from tests.unit.reconcile_cases import CTX, SPEC, condition, fake_plan, observed
from tests.unit.test_crd import ARCHITECTURE


def spec(**changes: Any) -> SFTJobSpec:
    return SFTJobSpec.model_validate(
        {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "dataset": {"name": "org/chats"}, **changes}
    )


@pytest.mark.parametrize(
    "key",
    [
        "container.apparmor.security.beta.kubernetes.io/trainer",
        "seccomp.security.alpha.kubernetes.io/pod",
        "container.seccomp.security.alpha.kubernetes.io/trainer",
    ],
)
def test_apparmor_and_seccomp_pod_annotations_are_refused_since_they_would_set_the_security_profile(
    key: str,
) -> None:
    with pytest.raises(
        ValidationError, match="AppArmor and seccomp annotations would set the pods' security"
    ):
        spec(podAnnotations={key: "unconfined"})


def test_other_pod_annotations_are_admitted() -> None:
    keys = {"k8s.v1.cni.cncf.io/networks": "roce-a", "example.com/apparmor": "x", "seccomp-note": "y"}
    assert spec(podAnnotations=keys).pod_annotations == keys


@pytest.mark.parametrize("name", [".", "..", "..SECRET"])
def test_env_names_the_api_server_takes_for_a_path_are_refused_before_any_pod_is_made(name: str) -> None:
    # The CRD's pattern admits them; the API server refuses the pod (hasChDirPrefix): InvalidSpec instead.
    with pytest.raises(ValidationError, match="no environment variable name"):
        spec(env=[{"name": name, "value": "x"}])


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA_MOFED",
        "NVIDIA_NVSWITCH",
        "NVIDIA_GDS",
        "NVIDIA_GDRCOPY",
        "NVIDIA_IMEX_CHANNELS",
        "PET_NNODES",
        "PET_MAX_RESTARTS",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
        "TORCHELASTIC_ERROR_FILE",
    ],
)
def test_the_nvidia_runtimes_device_variables_and_torchruns_flags_are_reserved_env_names(name: str) -> None:
    with pytest.raises(ValidationError, match=f"spec.env: {name} is reserved"):
        spec(env=[{"name": name, "value": "enabled"}])


def test_env_names_that_only_resemble_reserved_ones_are_admitted() -> None:
    env = [{"name": "NVIDIA_TF32_OVERRIDE", "value": "0"}, {"name": "PETNAME", "value": "rex"}]
    assert [e.name for e in spec(env=env).env] == ["NVIDIA_TF32_OVERRIDE", "PETNAME"]


def test_a_packing_length_with_packing_off_is_a_problem_and_the_rows_are_planned_padded() -> None:
    padded = spec(
        dataset={"name": "org/chats", "maxSeqLength": 8192}, training={"packing": False, "packingLength": 512}
    )
    problem = packing_problem(padded)
    assert problem is not None and problem.startswith("spec.training.packingLength 512 needs packing")
    # A job admitted before the rule plans the rows the trainer pads: maxSeqLength long, not packingLength.
    assert to_plan_request(padded, 1, 1).packing_length is None
    packed = spec(dataset={"name": "org/chats", "maxSeqLength": 8192}, training={"packingLength": 512})
    assert packing_problem(packed) is None and to_plan_request(packed, 1, 1).packing_length == 512


@pytest.mark.parametrize(
    "path", [".", "./", ".//", "./.", "./checkpoint-3", ".//checkpoint-3/x", ".cache/x", ".tmp-x"]
)
def test_an_output_path_that_is_the_checkpoint_volumes_root_or_its_own_names_is_refused(path: str) -> None:
    with pytest.raises(ValidationError, match="is the checkpoint volume's own"):
        spec(output={"path": path})


@pytest.mark.parametrize("path", ["./final", "./.x", ".x", "final/.", "OWNERS"])
def test_an_output_path_below_a_leading_dot_slash_is_a_folder_of_its_own(path: str) -> None:
    assert spec(output={"path": path}).output.path == path
    assert not re.match(c.CHECKPOINT_VOLUME_NAMES, path)


@pytest.mark.parametrize("memory", [64, "64", "512Mi", "1000M", "64k", "1048575Ki"])
def test_pod_memory_below_a_gibibyte_is_refused_naming_the_missing_unit(memory: int | str) -> None:
    with pytest.raises(
        ValidationError,
        match=re.escape("is below 1Gi, too little for a trainer pod (a quantity without a unit"),
    ):
        spec(resources={"memory": memory})


@pytest.mark.parametrize("memory", ["1Gi", "1.5Gi", "2G", 68719476736, "67108864Ki", "1048576Ki"])
def test_pod_memory_of_a_gibibyte_and_more_is_admitted(memory: int | str) -> None:
    assert spec(resources={"memory": memory}).resources.memory == str(memory)


@pytest.mark.parametrize("modules", [[], [""], ["x" * 129], [f"m{i}" for i in range(65)]])
def test_lora_target_modules_are_held_to_the_crds_bounds(modules: list[str]) -> None:
    with pytest.raises(ValidationError, match=re.escape("lora.targetModules")):
        spec(lora={"targetModules": modules})


def test_lora_target_modules_within_the_bounds_are_admitted() -> None:
    modules = [f"m{i}" for i in range(64)]
    assert spec(lora={"targetModules": modules}).lora.target_modules == modules


def test_all_linear_written_as_a_list_reaches_the_trainer_as_peft_s_string_shorthand() -> None:
    """peft expands only the string "all-linear"; in a list it is a module name no model has."""
    job = spec(lora={"targetModules": ["all-linear"]})
    assert job.lora.target_modules == "all-linear"
    plan = plan_candidates(job, default_products(), fake_plan).first
    config = trainer_config(JobRef(name="llama"), job, plan)
    assert config.lora.target_modules == "all-linear"
    assert json.loads(config.to_json())["lora"]["target_modules"] == "all-linear"


@pytest.mark.parametrize("modules", [["all-linear", "q_proj"], ["q_proj", "all-linear"]])
def test_all_linear_beside_other_module_names_is_refused_since_it_already_names_them_all(
    modules: list[str],
) -> None:
    with pytest.raises(ValidationError, match="all-linear already adapts every linear layer: give it alone"):
        spec(lora={"targetModules": modules})


@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "llama"), ("experts", {"count": 8, "perToken": 2, "intermediateSize": 14336})],
)
def test_an_architecture_cannot_carry_the_fields_the_crd_does_not_expose(field: str, value: Any) -> None:
    model = {"name": "acme/model", "architecture": {**ARCHITECTURE, field: value}}
    with pytest.raises(ValidationError, match=re.escape(f"spec.model.architecture has no field {field}")):
        spec(model=model)


def test_an_architecture_can_describe_its_sliding_window() -> None:
    model = {"name": "acme/model", "architecture": {**ARCHITECTURE, "slidingWindow": 4096}}
    architecture = spec(model=model).model.architecture
    assert architecture is not None and architecture.sliding_window == 4096


# Mixtral 8x7B's config.json without its experts: 7.24B parameters of a 46.7B model.
MIXTRAL_LAYERS = {"layers": 32, "hiddenSize": 4096, "heads": 32, "kvHeads": 8, "intermediateSize": 14336}
MIXTRAL = {"path": "mixtral", "volume": {"persistentVolumeClaim": {"claimName": "models"}}}


def test_an_architecture_far_from_the_parameter_count_is_refused_as_it_cannot_describe_experts() -> None:
    model = {**MIXTRAL, "parameters": 46_700_000_000, "architecture": {**MIXTRAL_LAYERS, "vocabSize": 32000}}
    with pytest.raises(ValidationError) as refused:
        spec(model=model)
    message = str(refused.value)
    assert "spec.model.architecture has 7.24B parameters but spec.model.parameters says 46.70B" in message
    assert (
        "cannot describe a mixture-of-experts model" in message and "spec.model.parameters alone" in message
    )


def test_the_operator_fails_a_job_whose_architecture_and_parameters_disagree_as_an_invalid_spec() -> None:
    model = {**MIXTRAL, "parameters": 46_700_000_000, "architecture": {**MIXTRAL_LAYERS, "vocabSize": 32000}}
    actions = reconcile(observed(spec={**SPEC, "model": model}), CTX)
    assert actions.status.phase == "Failed" and condition(actions, "Admitted") == ("False", "InvalidSpec")
    admitted = next(x for x in actions.status.conditions if x.type == "Admitted")
    assert "spec.model.architecture cannot describe a mixture-of-experts model" in admitted.message
    assert not actions.children


@pytest.mark.parametrize(
    ("vocab", "parameters"),
    [
        (128256, 8_030_000_000),  # Llama 3.1 8B, its own count
        (128256, 7_000_000_000),  # "7B", 13% below
        (128256, 10_000_000_000),  # 20% above
    ],
)
def test_an_architecture_and_a_parameter_count_within_a_quarter_of_each_other_are_admitted(
    vocab: int, parameters: int
) -> None:
    model = {
        "name": "acme/model",
        "parameters": parameters,
        "architecture": {**MIXTRAL_LAYERS, "vocabSize": vocab},
    }
    assert spec(model=model).model.parameters == parameters


def test_a_mixture_of_experts_sized_by_its_parameters_alone_is_planned_at_its_full_size() -> None:
    job = spec(model={**MIXTRAL, "parameters": 46_700_000_000})
    assert to_plan_request(job, 1, 1).architecture.parameters == pytest.approx(46.7e9, rel=0.05)
