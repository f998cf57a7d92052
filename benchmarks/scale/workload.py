"""What the benchmark creates: fake node pools, one SFTJob per job, and the batch/v1 Job floor.

Jobs cycle through the three GPU types so every pool is used and each job plans for one card. The pools
split the nodes 1 : 2 : 2 (A800 : A40 : L40S), which gives each type the same number of GPUs (an A800
node has 8, an A40 or L40S node 4): 1.6 GPUs of each type per node, 4.8 single-GPU jobs per node.
The floor's Job has the trainer pod's scheduling shape (one GPU, the GPU toleration, the same required
node affinity, the same shared checkpoint volume) and nothing else. Everything here is pure.
"""

from __future__ import annotations

from typing import Any

from sftjob import constants as c
from sftjob.gpus import GPU_TYPES
from sftjob_dev.nodes import NODE_TYPES
from sftjob_operator.scheduling import default_products, node_affinity

Manifest = dict[str, Any]

POOL_OF_TYPE = {"A800": "a800", "A40": "a40", "L40S": "l40s"}
POOL_WEIGHTS = {"a800": 1, "a40": 2, "l40s": 2}
# A small model that plans in milliseconds and fits one GPU of every type.
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DATASET = "HuggingFaceH4/ultrachat_200k"
# Checkpoints on one shared volume: no PersistentVolumeClaim (and no provisioner) per job, so the
# measurement is the operator's and the scheduler's, not the host-path provisioner's.
CHECKPOINT_VOLUME = {"hostPath": {"path": "/mnt/sftjob-bench"}}
FLOOR_IMAGE = "ghcr.io/sftjob/trainer:0.1.0"
FLOOR_REQUESTS = {"cpu": "4", "memory": "32Gi"}


def pools(nodes: int) -> dict[str, int]:
    """``nodes`` fake GPU nodes split 1 : 2 : 2 over A800, A40 and L40S (at least one of each)."""
    total = sum(POOL_WEIGHTS.values())
    counts = {pool: max(1, nodes * weight // total) for pool, weight in POOL_WEIGHTS.items()}
    counts["l40s"] += max(0, nodes - sum(counts.values()))
    return counts


def gpu_capacity(node_pools: dict[str, int]) -> dict[str, int]:
    """GPUs per GPU type in the given pools."""
    return {gpu: node_pools.get(pool, 0) * NODE_TYPES[pool].gpus for gpu, pool in POOL_OF_TYPE.items()}


def gpu_type_for(index: int) -> str:
    return GPU_TYPES[index % len(GPU_TYPES)]


def demand(first: int, last: int) -> dict[str, int]:
    """Single-GPU jobs per GPU type among job indexes ``[first, last)``."""
    counts = dict.fromkeys(GPU_TYPES, 0)
    for index in range(first, last):
        counts[gpu_type_for(index)] += 1
    return counts


def job_name(index: int) -> str:
    return f"bench-{index:05d}"


def sftjob(name: str, gpu_type: str) -> Manifest:
    """A LoRA of a 0.5B model on one GPU of ``gpu_type``, checkpoints on the shared volume."""
    return {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
        "kind": c.KIND,
        "metadata": {"name": name},
        "spec": {
            "model": {"name": MODEL},
            "dataset": {"name": DATASET},
            "method": "lora",
            "gpu": {"type": gpu_type, "count": 1},
            "checkpoints": {"volume": CHECKPOINT_VOLUME},
        },
    }


def batch_job(name: str, gpu_type: str) -> Manifest:
    """The floor: a plain batch/v1 Job whose one pod is scheduled like a trainer pod."""
    affinity = node_affinity([gpu_type], default_products(), min_driver_major=c.MIN_DRIVER_MAJOR)
    container = {
        "name": "trainer",
        "image": FLOOR_IMAGE,
        "resources": {
            "requests": {**FLOOR_REQUESTS, c.GPU_RESOURCE: "1"},
            "limits": {"memory": FLOOR_REQUESTS["memory"], c.GPU_RESOURCE: "1"},
        },
        "volumeMounts": [{"name": "checkpoints", "mountPath": c.CHECKPOINT_MOUNT}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {c.LABEL_JOB: name}},
                "spec": {
                    "restartPolicy": "Never",
                    "affinity": {"nodeAffinity": affinity},
                    "tolerations": [{"key": c.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container],
                    "volumes": [{"name": "checkpoints", **CHECKPOINT_VOLUME}],
                },
            },
        },
    }
