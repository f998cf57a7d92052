"""The SFTJob spec model: defaults, cross-field rules, GPU candidates and the planner request."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import ValidationError

from sftjob.architectures import ModelFamily
from sftjob.job_status import SFTJobStatus
from sftjob.model_shapes import KNOWN_ARCHITECTURES
from sftjob.spec import SFTJobSpec, to_plan_request, valid_job_name
from sftjob.spec_rules import batch_problem, packing_problem
from tests.unit.test_crd import ARCHITECTURE

PVC = {"persistentVolumeClaim": {"claimName": "models"}}


def spec(**changes: Any) -> SFTJobSpec:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "dataset": {"name": "org/chats"},
    }
    body.update(changes)
    return SFTJobSpec.model_validate(body)


def test_a_minimal_spec_gets_the_documented_defaults() -> None:
    s = spec()
    assert s.method == "lora" and s.gpu.type == "Any" and (s.gpu.count, s.gpu.nodes) == (1, 1)
    assert s.dataset.format == "auto" and s.dataset.max_seq_length == 2048
    assert s.dataset.max_bad_row_fraction == 0.01
    assert s.checkpoints.size == "100Gi" and s.checkpoints.keep == 3 and not s.checkpoints.keep_on_delete
    assert s.restart_policy.on_oom == "Replan" and not s.suspend
    assert s.checkpoint_every_minutes == 30 and s.lora.target_modules == "all-linear"


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"name": "a/b", "path": "m", "volume": PVC}},
        {"model": {"revision": "main"}},
        {"model": {"path": "m"}},
        {"model": {"path": "/abs", "volume": PVC}},
        {"model": {"path": "../up", "volume": PVC}},
        {"dataset": {"split": "train"}},
        {"dataset": {"path": "d", "volume": PVC, "revision": "v1.0"}},
        {"model": {"path": "m", "volume": PVC, "revision": "v1.0"}},
        {"method": "qlora", "gpu": {"count": 4}},
        {"method": "qlora", "gpu": {"nodes": 2}},
        {"method": "full", "output": {"mergeAdapter": True}},
        {"gpu": {"type": "A800", "types": ["A40"]}},
        {"gpu": {"types": ["A40", "A40"]}},
        {"gpu": {"type": "H100"}},
        {"gpu": {"count": 9}},
        {"checkpoints": {"everySteps": 10, "everyMinutes": 5}},
        {"checkpoints": {"size": "lots"}},
        {"env": [{"name": "SFTJOB_CONFIG", "value": "x"}]},
        {"model": {"path": "m", "volume": {**PVC, "hostPath": {"path": "/m"}}}},
        {"restartPolicy": {"onOOM": "Ignore"}},
        {"image": " trainer:1"},
        {"checkpoints": {"size": "0Gi"}},
        {"checkpoints": {"storageClassName": "fast..ssd"}},
        {"model": {"name": "a/b", "tokenSecretRef": {"name": "hf", "key": ".."}}},
        {"dataset": {"path": "d", "volume": {"hostPath": {"path": "/data/../etc"}}}},
        {"gpus": 2},
        {"dataset": {"name": "org/chats", "maxBadRowFraction": 1.5}},
        {"model": {"name": "Qwen/Qwen2.5 7B"}},
        {"model": {"name": "org/"}},
        {"dataset": {"name": "/data/chats"}},
        {"env": [{"name": "POD_NAME", "value": "mine"}]},
        {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
        {"checkpoints": {"volume": {"persistentVolumeClaim": {"claimName": "c", "readOnly": True}}}},
        {"output": {"volume": {"nfs": {"server": "nfs", "path": "/out", "readOnly": True}}}},
        {"restartPolicy": {"stallTimeoutSeconds": 30}},
        {"output": {"path": "checkpoint-3"}},
        {"output": {"path": "."}},
        {"output": {"path": ".cache/final"}},
        {"model": {"name": "a/b", "architecture": {**ARCHITECTURE, "kvHeads": 3}}},
        {"model": {"name": "a/b", "architecture": {**ARCHITECTURE, "heads": 6, "kvHeads": 6}}},
    ],
)
def test_an_invalid_spec_is_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        spec(**changes)


def test_quantities_may_be_written_as_whole_numbers_as_kubernetes_allows() -> None:
    """``cpu: 16`` unquoted is a YAML integer; the CRD admits it (int-or-string), so the model does too."""
    s = spec(resources={"cpu": 16, "memory": 68719476736}, checkpoints={"size": 200})
    assert (s.resources.cpu, s.resources.memory, s.checkpoints.size) == ("16", "68719476736", "200")


@pytest.mark.parametrize("value", [0, -4, 1.5, True])
def test_a_quantity_number_that_is_not_a_whole_number_above_zero_is_rejected(value: object) -> None:
    with pytest.raises(ValidationError, match=r"resources\.cpu"):
        spec(resources={"cpu": value})


def test_hostpath_checkpoints_are_refused_for_a_multi_node_job_and_accepted_on_one_node() -> None:
    host = {"volume": {"hostPath": {"path": "/mnt/ckpt"}}}
    with pytest.raises(ValidationError, match=r"spec\.checkpoints\.volume\.hostPath.*every node shares"):
        spec(gpu={"type": "A800", "count": 8, "nodes": 2}, checkpoints=host)
    assert spec(gpu={"type": "A800", "count": 8}, checkpoints=host).checkpoints.volume is not None
    shared = {"volume": {"nfs": {"server": "nfs", "path": "/ckpt"}}}
    assert spec(gpu={"type": "A800", "count": 8, "nodes": 2}, checkpoints=shared).gpu.nodes == 2


def test_qlora_on_one_gpu_is_accepted() -> None:
    assert spec(method="qlora", gpu={"type": "L40S", "count": 1}).method == "qlora"


def test_any_prefers_the_biggest_card_and_a_list_keeps_the_users_order() -> None:
    assert spec().gpu.candidates() == ["A800", "L40S", "A40"]
    assert spec(gpu={"types": ["A40", "L40S"]}).gpu.candidates() == ["A40", "L40S"]
    assert spec(gpu={"type": "L40S"}).gpu.candidates() == ["L40S"]


def test_the_gpu_summary_reads_nodes_by_gpus_by_type() -> None:
    assert spec(gpu={"type": "A800", "count": 8}).gpu.describe() == "8xA800"
    assert spec(gpu={"type": "A800", "count": 8, "nodes": 2}).gpu.describe() == "2x8xA800"
    assert spec(gpu={"types": ["L40S", "A40"]}).gpu.describe() == "1xL40S|A40"


def test_on_oom_is_spelled_with_the_acronym_in_capitals() -> None:
    s = spec(restartPolicy={"onOOM": "Fail"})
    assert s.restart_policy.on_oom == "Fail"
    assert s.model_dump(by_alias=True)["restartPolicy"]["onOOM"] == "Fail"


def test_job_names_must_leave_room_for_pod_names() -> None:
    assert valid_job_name("llama-8b-lora")
    assert not valid_job_name("a" * 41) and not valid_job_name("9lives") and not valid_job_name("Upper")


def test_the_plan_request_carries_the_spec_and_the_gpu_shape() -> None:
    s = spec(method="full", training={"globalBatchSize": 64}, dataset={"name": "d/s", "maxSeqLength": 4096})
    request = to_plan_request(s, gpus_per_node=8, nodes=2)
    assert request.method == "full" and request.max_seq_length == 4096
    assert (request.gpus_per_node, request.nodes) == (8, 2)
    assert request.overrides.global_batch_size == 64
    assert request.architecture.layers > 0


def test_a_model_of_unknown_size_cannot_be_planned() -> None:
    with pytest.raises(ValueError, match=r"spec\.model\.parameters"):
        to_plan_request(spec(model={"name": "someone/mystery-model"}), gpus_per_node=1, nodes=1)


def test_the_status_round_trips_through_its_json_patch() -> None:
    raw = {
        "phase": "Running",
        "attempt": 1,
        "conditions": [
            {
                "type": "Running",
                "status": "True",
                "reason": "Training",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
        ],
        "attempts": [{"attempt": 1, "startTime": "2026-01-01T00:00:00Z"}],
    }
    status = SFTJobStatus.model_validate(raw)
    again = SFTJobStatus.model_validate(status.to_patch())
    assert again == status
    conditions = status.to_patch()["conditions"]
    assert isinstance(conditions, list) and conditions[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_a_backoff_above_its_cap_is_rejected_only_when_the_user_set_it() -> None:
    with pytest.raises(ValidationError, match="backoffSeconds 30 exceeds"):
        spec(restartPolicy={"backoffSeconds": 30, "maxBackoffSeconds": 20})
    assert spec(restartPolicy={"maxBackoffSeconds": 5}).restart_policy.max_backoff_seconds == 5


@pytest.mark.parametrize(
    "toleration",
    [
        {"value": "x"},  # an empty key tolerates every taint: only with operator Exists
        {"key": "k", "operator": "Exists", "value": "v"},
        {"key": "k", "tolerationSeconds": 60},
        {"key": "k", "effect": "NoSchedule", "tolerationSeconds": 60},
        {"key": "a b"},
        {"key": "a/b/c"},
        {"key": f"{'a' * 254}/k"},
        {"key": "k", "value": "-v"},
    ],
)
def test_a_toleration_the_api_server_would_refuse_in_a_pod_is_rejected(toleration: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"tolerations\.0"):
        spec(tolerations=[toleration])


def test_tolerations_a_pod_may_carry_are_accepted() -> None:
    tolerations = [
        {"operator": "Exists"},
        {"key": "example.com/pool", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 300},
    ]
    assert len(spec(tolerations=tolerations).tolerations) == 3


@pytest.mark.parametrize(
    ("key", "value", "valid"),
    [
        ("kubernetes.io/hostname", "node-1", True),
        ("example.com/Pool_2", "", True),
        (f"{'a' * 253}/x", "v", True),
        ("a" * 63, "a" * 63, True),
        (f"{'a' * 254}/x", "v", False),
        ("a" * 64, "v", False),
        ("Example.com/x", "v", False),
        ("a..b/x", "v", False),
        ("/x", "v", False),
        ("x/", "v", False),
        ("-x", "v", False),
        ("x", "-v", False),
        ("x", "a b", False),
    ],
)
def test_node_selector_takes_label_keys_and_values_only(key: str, value: str, valid: bool) -> None:
    if valid:
        assert spec(nodeSelector={key: value}).node_selector == {key: value}
    else:
        with pytest.raises(ValidationError, match="nodeSelector"):
            spec(nodeSelector={key: value})


SHAPE = {"layers": 2, "hiddenSize": 64, "heads": 4, "kvHeads": 4, "intermediateSize": 128, "vocabSize": 1000}


def test_an_architecture_of_a_family_the_planner_knows_plans_with_liger_kernels() -> None:
    def liger(architecture: dict[str, Any]) -> bool:
        job = spec(model={"name": "someone/mystery", "architecture": architecture})
        return to_plan_request(job, gpus_per_node=1, nodes=1).architecture.liger_supported

    assert liger({**SHAPE, "family": "qwen2"}) and not liger(SHAPE)
    with pytest.raises(ValidationError, match="family"):
        liger({**SHAPE, "family": "phi3"})


def test_every_family_of_the_built_in_table_is_one_a_spec_can_name() -> None:
    dense = {arch.family for _, _, arch in KNOWN_ARCHITECTURES if arch.experts is None}
    assert dense == set(get_args(ModelFamily))  # mixtures of experts: the table's alone


def test_packed_rows_longer_than_the_sequence_length_are_a_problem_naming_both_fields() -> None:
    too_long = spec(training={"packingLength": 4096})
    assert packing_problem(too_long) == (
        "spec.training.packingLength 4096 exceeds spec.dataset.maxSeqLength 2048: packed rows hold at most"
        " maxSeqLength tokens"
    )
    fits = spec(dataset={"name": "org/chats", "maxSeqLength": 4096}, training={"packingLength": 4096})
    assert packing_problem(fits) is None
    assert to_plan_request(fits, 1, 1).packing_length == 4096


def test_a_job_admitted_before_the_packing_rule_keeps_planning_its_rows_at_the_sequence_length() -> None:
    admitted_earlier = spec(training={"packingLength": 4096})  # the model parses it: no job fails on upgrade
    assert to_plan_request(admitted_earlier, 1, 1).packing_length == 2048


def test_a_stall_timeout_of_zero_or_null_disables_stall_detection() -> None:
    assert spec(restartPolicy={"stallTimeoutSeconds": 0}).restart_policy.stall_timeout is None
    assert spec(restartPolicy={"stallTimeoutSeconds": None}).restart_policy.stall_timeout is None
    assert spec().restart_policy.stall_timeout == 1800


def test_hub_ids_with_and_without_an_owner_are_accepted() -> None:
    for name in ("gpt2", "Qwen/Qwen2.5-7B-Instruct", "HuggingFaceH4/ultrachat_200k", "a/b.c_d-e"):
        assert spec(model={"name": name}, dataset={"name": name}).model.name == name


@pytest.mark.parametrize(
    ("gpu", "training", "words"),
    [
        ({"type": "A800", "count": 8}, {"globalBatchSize": 12}, "not divisible by the job's 8 GPUs"),
        ({"type": "A800", "count": 2, "nodes": 2}, {"globalBatchSize": 8, "microBatchSize": 2}, None),
        ({"type": "A800"}, {"globalBatchSize": 4, "microBatchSize": 8}, "does not divide each GPU's share 4"),
        ({"type": "A800", "count": 4}, {"microBatchSize": 3}, None),
    ],
)
def test_a_batch_the_gpus_cannot_split_is_a_problem_naming_the_field(
    gpu: dict[str, Any], training: dict[str, Any], words: str | None
) -> None:
    problem = batch_problem(spec(gpu=gpu, training=training))
    assert problem == words if words is None else words in (problem or "")
