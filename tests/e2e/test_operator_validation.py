"""The API server itself rejects bad SFTJobs, with a message that names the field the user must fix.

Each case is sent with `kubectl create --dry-run=server`: full admission (schema, CEL rules, strict field
validation), nothing stored.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from operator_harness import Jobs, sftjob

pytestmark = pytest.mark.e2e

PVC = {"persistentVolumeClaim": {"claimName": "models"}}


def architecture(**changes: Any) -> dict[str, Any]:
    """A small model shape the CRD accepts, with ``changes`` applied."""
    shape = {
        "layers": 2,
        "hiddenSize": 64,
        "heads": 4,
        "kvHeads": 4,
        "intermediateSize": 128,
        "vocabSize": 1000,
    }
    return shape | changes


def spec_with(**changes: Any) -> dict[str, Any]:
    """The default test job with dotted-path ``changes`` applied (``gpu__count=9`` sets spec.gpu.count)."""
    job = sftjob("invalid")
    for path, value in changes.items():
        node = job["spec"]
        *parents, leaf = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = copy.deepcopy(value)
    return job


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "zero GPUs": (spec_with(gpu__count=0), "spec.gpu.count"),
    "nine GPUs per node": (spec_with(gpu__count=9), "spec.gpu.count"),
    "zero nodes": (spec_with(gpu__nodes=0), "spec.gpu.nodes"),
    "unknown GPU type": (spec_with(gpu__type="H100"), "spec.gpu.type"),
    "a GPU type listed twice": (spec_with(gpu={"types": ["A40", "A40"]}), "spec.gpu.types"),
    "type and types together": (spec_with(gpu={"type": "A800", "types": ["A40"]}), "spec.gpu.types"),
    "unknown method": (spec_with(method="dpo"), "spec.method"),
    "model name and path": (spec_with(model={"name": "a/b", "path": "m", "volume": PVC}), "spec.model"),
    "model without name or path": (spec_with(model={"revision": "main"}), "spec.model"),
    "model path without volume": (spec_with(model={"path": "llama"}), "spec.model"),
    "model path escaping the volume": (spec_with(model={"path": "../etc", "volume": PVC}), "spec.model.path"),
    "dataset without name or path": (spec_with(dataset={"split": "train"}), "spec.dataset"),
    "qlora on four GPUs": (spec_with(method="qlora", gpu={"type": "A800", "count": 4}), "spec.method"),
    "qlora on two nodes": (spec_with(method="qlora", gpu={"type": "A800", "nodes": 2}), "spec.method"),
    "merging the adapter of a full fine-tune": (
        spec_with(method="full", output={"mergeAdapter": True}),
        "spec.output.mergeAdapter",
    ),
    "huge model name": (spec_with(model={"name": "x" * 5000}), "spec.model.name"),
    "negative sequence length": (spec_with(dataset__maxSeqLength=-1), "spec.dataset.maxSeqLength"),
    "unknown dataset format": (spec_with(dataset__format="csv"), "spec.dataset.format"),
    "LoRA rank zero": (spec_with(lora={"r": 0}), "spec.lora.r"),
    "LoRA dropout of one": (spec_with(lora={"dropout": 1.0}), "spec.lora.dropout"),
    "zero learning rate": (spec_with(training={"learningRate": 0}), "spec.training.learningRate"),
    "learning rate above one": (spec_with(training={"learningRate": 2}), "spec.training.learningRate"),
    "negative seed": (spec_with(training={"seed": -1}), "spec.training.seed"),
    "packed rows longer than maxSeqLength": (
        spec_with(training={"packingLength": 4096}),
        "spec.training.packingLength",
    ),
    "bad-row fraction above one": (
        spec_with(dataset__maxBadRowFraction=1.5),
        "spec.dataset.maxBadRowFraction",
    ),
    "unknown precision": (spec_with(training={"precision": "int4"}), "spec.training.precision"),
    "fp8 (no FP8 training yet)": (spec_with(training={"precision": "fp8"}), "spec.training.precision"),
    "checkpoints by steps and minutes": (
        spec_with(checkpoints={"everySteps": 10, "everyMinutes": 5}),
        "spec.checkpoints",
    ),
    "checkpoint size not a quantity": (spec_with(checkpoints={"size": "lots"}), "spec.checkpoints.size"),
    "output inside a checkpoint's folder": (spec_with(output={"path": "checkpoint-3"}), "spec.output.path"),
    "memory of zero": (spec_with(resources={"memory": "0"}), "must be a quantity above zero such as"),
    "unknown onOOM": (spec_with(restartPolicy={"onOOM": "Ignore"}), "spec.restartPolicy.onOOM"),
    "negative maxRestarts": (spec_with(restartPolicy={"maxRestarts": -1}), "spec.restartPolicy.maxRestarts"),
    "reserved env name": (spec_with(env=[{"name": "SFTJOB_CONFIG", "value": "x"}]), "spec.env[0].name"),
    "volume with two sources": (
        spec_with(model={"path": "m", "volume": {**PVC, "hostPath": {"path": "/m"}}}),
        "spec.model.volume",
    ),
    "hostPath checkpoints on two nodes": (
        spec_with(
            gpu={"type": "A800", "count": 8, "nodes": 2}, checkpoints={"volume": {"hostPath": {"path": "/c"}}}
        ),
        "spec.checkpoints.volume.hostPath",
    ),
    "zero deadline": (spec_with(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds"),
    "unknown field": (spec_with(gpus=2), 'unknown field "spec.gpus"'),
    "unknown toleration operator": (
        spec_with(tolerations=[{"operator": "Maybe"}]),
        "spec.tolerations[0].operator",
    ),
    "too many node selector labels": (
        spec_with(nodeSelector={f"k{i}": "v" for i in range(40)}),
        "spec.nodeSelector",
    ),
    # What the API server would refuse in the pods or the claim, after the job's other children exist.
    "toleration of every key with operator Equal": (
        spec_with(tolerations=[{"value": "x"}]),
        "spec.tolerations[0].operator",
    ),
    "toleration with operator Exists and a value": (
        spec_with(tolerations=[{"key": "pool", "operator": "Exists", "value": "x"}]),
        "spec.tolerations[0].value",
    ),
    "tolerationSeconds without effect NoExecute": (
        spec_with(tolerations=[{"key": "pool", "effect": "NoSchedule", "tolerationSeconds": 60}]),
        "spec.tolerations[0].tolerationSeconds",
    ),
    "toleration key not a label key": (
        spec_with(tolerations=[{"key": "my pool", "operator": "Exists"}]),
        "spec.tolerations[0].key",
    ),
    "node selector key not a label key": (
        spec_with(nodeSelector={"zone": "a", "Example.com/pool": "a"}),
        "key Example.com/pool is not a label key",
    ),
    "node selector value not a label value": (
        spec_with(nodeSelector={"pool": "a b"}),
        "spec.nodeSelector[pool]",
    ),
    "checkpoint claim of zero bytes": (spec_with(checkpoints={"size": "0Gi"}), "spec.checkpoints.size"),
    "model name that is not a hub id": (spec_with(model={"name": "Qwen/Qwen2.5 7B"}), "spec.model.name"),
    "dataset name that is a path": (spec_with(dataset={"name": "/data/chats"}), "spec.dataset.name"),
    "env name the operator sets": (spec_with(env=[{"name": "POD_NAME", "value": "x"}]), "spec.env[0].name"),
    "read-only checkpoint volume": (
        spec_with(checkpoints={"volume": {"persistentVolumeClaim": {"claimName": "c", "readOnly": True}}}),
        "spec.checkpoints.volume",
    ),
    "read-only output volume": (
        spec_with(output={"volume": {"nfs": {"server": "nfs", "path": "/out", "readOnly": True}}}),
        "spec.output.volume",
    ),
    "global batch the GPUs cannot split": (
        spec_with(gpu={"type": "A800", "count": 8}, training={"globalBatchSize": 12}),
        "spec.training.globalBatchSize",
    ),
    "micro-batch larger than a GPU's share": (
        spec_with(training={"globalBatchSize": 4, "microBatchSize": 8}),
        "spec.training.microBatchSize",
    ),
    "stall timeout under a minute": (
        spec_with(restartPolicy={"stallTimeoutSeconds": 30}),
        "spec.restartPolicy.stallTimeoutSeconds",
    ),
    "kvHeads not dividing heads": (
        spec_with(model={"name": "acme/model", "architecture": architecture(kvHeads=3)}),
        "spec.model.architecture.kvHeads",
    ),
    "pod annotation key with a space": (
        spec_with(podAnnotations={"my note": "x"}),
        "key my note is not an annotation key",
    ),
    "pod annotation the operator writes": (
        spec_with(podAnnotations={"sftjob.io/progress": "{}"}),
        "key sftjob.io/progress: annotations under sftjob.io",
    ),
    "RDMA resource without a domain": (
        spec_with(network={"rdma": {"resourceName": "rdma"}}),
        "spec.network.rdma.resourceName",
    ),
    "RDMA resource in kubernetes.io": (
        spec_with(network={"rdma": {"resourceName": "rdma.kubernetes.io/hca"}}),
        "spec.network.rdma.resourceName",
    ),
    "the GPUs as the RDMA resource": (
        spec_with(network={"rdma": {"resourceName": "nvidia.com/gpu"}}),
        "spec.gpu requests",
    ),
    "zero RDMA devices": (
        spec_with(network={"rdma": {"resourceName": "rdma/hca", "count": 0}}),
        "spec.network.rdma.count",
    ),
    "zero network bandwidth": (spec_with(network={"bandwidthGbps": 0}), "spec.network.bandwidthGbps"),
    "the GPUs the device plugin gave the pod": (
        spec_with(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
        "spec.env[0].name",
    ),
    "evaluation with both split and fraction": (
        spec_with(evaluation={"split": "test", "fraction": 0.1}),
        "spec.evaluation",
    ),
    "evaluation with neither split nor fraction": (
        spec_with(evaluation={"maxSamples": 10}),
        "spec.evaluation",
    ),
    "evaluation on the training split": (spec_with(evaluation={"split": "train"}), "spec.evaluation.split"),
    "half the rows and more held out": (spec_with(evaluation={"fraction": 0.6}), "spec.evaluation.fraction"),
    "zero held-out rows": (spec_with(evaluation={"fraction": 0}), "spec.evaluation.fraction"),
    "unknown architecture family": (
        spec_with(model={"name": "acme/model", "architecture": architecture(kvHeads=4, family="phi3")}),
        "spec.model.architecture.family",
    ),
    "sliding window of zero": (
        spec_with(model={"name": "acme/model", "architecture": architecture(slidingWindow=0)}),
        "spec.model.architecture.slidingWindow",
    ),
    "an unconfined AppArmor profile in a pod annotation": (
        spec_with(podAnnotations={"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}),
        "AppArmor and seccomp annotations would set the pods' security profile",
    ),
    "a seccomp profile in a pod annotation": (
        spec_with(podAnnotations={"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}),
        "AppArmor and seccomp annotations would set the pods' security profile",
    ),
    "a host device the NVIDIA runtime mounts": (
        spec_with(env=[{"name": "NVIDIA_MOFED", "value": "enabled"}]),
        "spec.env[0].name",
    ),
    "Kueue's pod-group annotation by hand": (
        spec_with(podAnnotations={"kueue.x-k8s.io/pod-group-total-count": "2"}),
        "Kueue's pod-group annotations are the operator's: set spec.queueName",
    ),
    "a queue name that is no label value": (spec_with(queueName="q" * 64), "spec.queueName"),
    "a torchrun flag in the environment": (
        spec_with(env=[{"name": "PET_MAX_RESTARTS", "value": "100"}]),
        "spec.env[0].name",
    ),
    "torchrun's worker log prefix in the environment": (
        spec_with(env=[{"name": "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "value": "${rank}"}]),
        "spec.env[0].name",
    ),
    "a packed-row length with packing off": (
        spec_with(training={"packing": False, "packingLength": 512}),
        "training.packingLength needs packing",
    ),
    "the checkpoint volume's root as ./": (spec_with(output={"path": "./"}), "spec.output.path"),
    "memory without a unit": (spec_with(resources={"memory": 64}), "must be at least 1Gi"),
    "memory in mebibytes": (spec_with(resources={"memory": "512Mi"}), "spec.resources.memory"),
    "no LoRA target modules": (spec_with(lora={"targetModules": []}), "spec.lora.targetModules"),
    "an MLflow server that is no URL": (
        spec_with(tracking={"mlflow": {"trackingUri": "mlflow.mlops:5000"}}),
        "spec.tracking.mlflow.trackingUri",
    ),
    "an MLflow user name without its password": (
        spec_with(tracking={"mlflow": {"trackingUri": "http://mlflow:5000", "username": "ci"}}),
        "mlflow.username and passwordSecretRef go together",
    ),
    "an MLflow token and a password": (
        spec_with(
            tracking={
                "mlflow": {
                    "trackingUri": "http://mlflow:5000",
                    "username": "ci",
                    "passwordSecretRef": {"name": "m"},
                    "tokenSecretRef": {"name": "t"},
                }
            }
        ),
        "mlflow takes tokenSecretRef or username with passwordSecretRef, not both",
    ),
    # Control characters the API server's RE2 \s does not cover, as the operator's models refuse them too.
    "an image with a vertical tab": (spec_with(image="trainer\x0b:1"), "spec.image"),
    "a W&B project with a vertical tab": (
        spec_with(tracking={"wandb": {"project": "p\x0b"}}),
        "spec.tracking",
    ),
    "a W&B project with a slash": (
        spec_with(tracking={"wandb": {"project": "team/project"}}),
        "spec.tracking.wandb.project",
    ),
    "the output in TensorBoard's folder": (
        spec_with(output={"path": "./tensorboard/final"}, tracking={"tensorboard": True}),
        "spec.output.path",
    ),
    "an MLflow URL with a password in it": (
        spec_with(tracking={"mlflow": {"trackingUri": "https://ci:s3cret@mlflow.example.com"}}),
        "spec.tracking.mlflow.trackingUri",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_spec_is_rejected_at_admission_naming_the_field(jobs: Jobs, case: str) -> None:
    manifest, field = INVALID[case]
    result = jobs.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr


def test_a_multi_node_job_with_rdma_devices_and_pod_annotations_is_admitted(jobs: Jobs) -> None:
    manifest = spec_with(
        gpu={"type": "A800", "count": 8, "nodes": 2},
        network={"rdma": {"resourceName": "rdma/rdma_shared_device_a"}, "bandwidthGbps": 400},
        podAnnotations={"k8s.v1.cni.cncf.io/networks": "roce-a,roce-b"},
    )
    result = jobs.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(manifest))
    admitted = json.loads(result.stdout)["spec"]
    assert admitted["network"]["rdma"] == {"resourceName": "rdma/rdma_shared_device_a", "count": 1}
    assert admitted["podAnnotations"] == {"k8s.v1.cni.cncf.io/networks": "roce-a,roce-b"}


def test_the_edges_of_the_output_memory_env_and_architecture_rules_are_admitted(jobs: Jobs) -> None:
    manifest = spec_with(
        model={"name": "acme/model", "architecture": architecture(slidingWindow=4096)},
        output={"path": "./final", "mergeAdapter": True},  # the default method, lora
        resources={"memory": "1Gi"},
        env=[{"name": "PETNAME", "value": "rex"}, {"name": "NVIDIA_TF32_OVERRIDE", "value": "0"}],
        podAnnotations={"example.com/apparmor": "notes"},
        training={"packing": True, "packingLength": 512},
    )
    result = jobs.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(manifest))
    admitted = json.loads(result.stdout)["spec"]
    assert admitted["output"] == {"path": "./final", "mergeAdapter": True}
    assert admitted["resources"]["memory"] == "1Gi"
    assert admitted["model"]["architecture"]["slidingWindow"] == 4096


def test_a_job_with_every_tracker_is_admitted_with_the_secret_keys_defaulted(jobs: Jobs) -> None:
    mlflow = {"trackingUri": "https://mlflow.example.com/", "experiment": "Chat models / v2",
              "username": "ci", "passwordSecretRef": {"name": "mlflow"}}  # fmt: skip
    wandb = {"project": "support-bot", "entity": "my-team", "apiKeySecretRef": {"name": "wandb"}}
    manifest = spec_with(tracking={"tensorboard": True, "mlflow": mlflow, "wandb": wandb})
    result = jobs.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(manifest))
    admitted = json.loads(result.stdout)["spec"]["tracking"]
    assert admitted["mlflow"]["passwordSecretRef"] == {"name": "mlflow", "key": "token"}
    assert admitted["wandb"]["apiKeySecretRef"] == {"name": "wandb", "key": "token"}
    assert admitted["tensorboard"] is True
    untracked = spec_with(output={"path": "tensorboard"})  # the folder is free without TensorBoard
    result = jobs.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(untracked))
    assert "tracking" not in json.loads(result.stdout)["spec"]  # no default: an older operator reads it


def test_a_name_too_long_for_its_pod_names_is_rejected(jobs: Jobs) -> None:
    manifest = sftjob("a" * 45)
    result = jobs.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0 and "metadata.name: Invalid value" in result.stderr


def test_a_stall_timeout_of_zero_is_admitted_and_kept_through_client_side_apply(jobs: Jobs) -> None:
    # That 0 then turns stall detection off is left to tests/unit/test_spec.py: seeing it here would take
    # a running job watched past the smallest timeout (60 s) and a resync.
    jobs.apply(sftjob("no-stall", restartPolicy={"stallTimeoutSeconds": 0}, suspend=True))
    got = jobs.kubectl("get", "sft", "no-stall", "-o", "jsonpath={.spec.restartPolicy.stallTimeoutSeconds}")
    assert got.stdout == "0"


def test_the_spec_is_immutable_except_suspend_deadline_and_ttl(jobs: Jobs) -> None:
    jobs.apply(sftjob("settled", suspend=True))
    for patch, field in (
        ('{"spec":{"model":{"name":"other/model"}}}', "spec.model"),
        ('{"spec":{"gpu":{"count":2}}}', "spec.gpu"),
        ('{"spec":{"image":"evil:latest"}}', "spec.image"),
        ('{"spec":{"network":{"bandwidthGbps":100}}}', "spec.network"),
        ('{"spec":{"podAnnotations":{"a":"b"}}}', "spec.podAnnotations"),
        ('{"spec":{"evaluation":{"fraction":0.1}}}', "spec.evaluation"),
        ('{"spec":{"queueName":"team-a"}}', "spec.queueName"),
        ('{"spec":{"tracking":{"tensorboard":true}}}', "spec.tracking"),
    ):
        result = jobs.kubectl("patch", "sft", "settled", "--type=merge", "-p", patch, check=False)
        assert result.returncode != 0 and field in result.stderr and "immutable" in result.stderr
    jobs.apply(sftjob("tracked", suspend=True, tracking={"tensorboard": True}))
    off = '{"spec":{"tracking":{"tensorboard":false}}}'
    result = jobs.kubectl("patch", "sft", "tracked", "--type=merge", "-p", off, check=False)
    assert result.returncode != 0 and "tracking is immutable once the job exists" in result.stderr
    for patch in ('{"spec":{"suspend":false}}', '{"spec":{"activeDeadlineSeconds":60}}',
                  '{"spec":{"ttlSecondsAfterFinished":60}}'):  # fmt: skip
        jobs.kubectl("patch", "sft", "settled", "--type=merge", "-p", patch)


def test_the_wide_listing_shows_every_printer_column_with_the_reason(jobs: Jobs) -> None:
    jobs.apply(sftjob("listed", suspend=True))
    jobs.wait_phase("listed", "Suspended")
    header, row = jobs.kubectl("get", "sft", "listed", "-o", "wide").stdout.splitlines()
    assert header.split() == [
        *("NAME", "GPU", "PHASE", "PROGRESS", "LOSS", "TOK/S", "RESTARTS", "AGE", "PLAN", "EVAL", "REASON")
    ]
    assert row.split()[-1] == "SuspendedBySpec"
