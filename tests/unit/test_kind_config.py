"""kind-config.yaml: a valid kind v1alpha4 cluster whose GPU workers look like the KWOK nodes."""

from __future__ import annotations

from typing import Any

import jsonschema
import yaml
from helmchart import ROOT

from sftjob import constants as c
from sftjob_dev.nodes import NODE_TYPES


def _kind_schema() -> dict[str, Any]:
    """kind's v1alpha4 Cluster and Node types (sigs.k8s.io/kind pkg/apis/config/v1alpha4), which kind
    decodes strictly: an unknown field is an error there too."""
    strings = {"type": "array", "items": {"type": "string"}}
    node = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "role": {"enum": ["control-plane", "worker"]},
            "image": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "extraMounts": {"type": "array"},
            "extraPortMappings": {"type": "array"},
            "gpus": {"type": "string"},
            "kubeadmConfigPatches": strings,
            "kubeadmConfigPatchesJSON6902": {"type": "array"},
        },
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "apiVersion"],
        "properties": {
            "kind": {"const": "Cluster"},
            "apiVersion": {"const": "kind.x-k8s.io/v1alpha4"},
            "name": {"type": "string"},
            "nodes": {"type": "array", "items": node, "minItems": 1},
            "networking": {"type": "object"},
            "featureGates": {"type": "object", "additionalProperties": {"type": "boolean"}},
            "runtimeConfig": {"type": "object", "additionalProperties": {"type": "string"}},
            "kubeadmConfigPatches": strings,
            "kubeadmConfigPatchesJSON6902": {"type": "array"},
            "containerdConfigPatches": strings,
            "containerdConfigPatchesJSON6902": strings,
        },
    }


def kind_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "kind-config.yaml").read_text())
    return config


def test_kind_config_is_a_valid_kind_v1alpha4_cluster() -> None:
    config = kind_config()
    jsonschema.validate(config, _kind_schema())
    roles = [n["role"] for n in config["nodes"]]
    assert roles.count("control-plane") == 1
    assert any(n["role"] == "worker" and not n.get("labels") for n in config["nodes"]), (
        "a worker for the operator"
    )


def test_kind_gpu_workers_carry_the_same_labels_and_taint_as_the_kwok_nodes() -> None:
    gpu_types = {t.product: t for t in NODE_TYPES.values() if t.gpus}
    gpu_workers = {
        n["labels"][c.GFD_PRODUCT]: n for n in kind_config()["nodes"] if c.GFD_PRODUCT in n.get("labels", {})
    }
    assert gpu_workers.keys() == gpu_types.keys()
    for product, node in gpu_workers.items():
        kwok_labels = gpu_types[product].labels("x")
        assert node["labels"] == {k: v for k, v in kwok_labels.items() if k.startswith("nvidia.com/")}
        (patch,) = node["kubeadmConfigPatches"]
        join = yaml.safe_load(patch)
        assert join["kind"] == "JoinConfiguration"
        assert join["nodeRegistration"]["taints"] == gpu_types[product].taints()
