"""Fake nodes for the local cluster: what an A800, A40 or L40S node looks like to the scheduler.

KWOK plays the kubelet for these nodes. GPU nodes carry the labels NVIDIA GPU Feature Discovery puts on
real nodes, the device plugin's `nvidia.com/gpu` capacity and the usual GPU taint, so the operator sees
the same objects it would see on a real GPU pool. An optional untainted `cpu` pool (none by default)
gives pods without GPUs, such as an operator Deployment installed by Helm, somewhere to run.
Everything here is pure: it builds manifests, it does not talk to the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sftjob import constants as c
from sftjob_dev.errors import ClusterError

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_NODE_VALUE = "fake"
FAKE_NODE_LABEL = "type"
FAKE_NODE_LABEL_VALUE = "kwok"
FAKE_DRIVER_MAJOR = 580  # the NVIDIA driver GPU Feature Discovery would report (CUDA 13)


# What the NVIDIA Network Operator's shared RDMA device plugin offers (examples/a800-full-multinode.yaml).
FAKE_RDMA_RESOURCE = "rdma/rdma_shared_device_a"


@dataclass(frozen=True)
class NodeType:
    """One kind of server, described by the labels and capacity its node would have."""

    pool: str
    product: str
    memory_mib: int
    gpus: int
    compute: tuple[int, int]
    family: str
    cpu: int
    memory: str
    ephemeral_storage: str
    rdma_devices: int = 0  # the shared RDMA device plugin's count (RoCE on the A800 servers)

    def labels(self, name: str) -> dict[str, str]:
        labels = {
            FAKE_NODE_LABEL: FAKE_NODE_LABEL_VALUE,
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": f"gpu-{self.pool}-{self.gpus}x" if self.gpus else "cpu",
        }
        if not self.gpus:
            return labels
        return labels | {
            "nvidia.com/gpu.present": "true",
            c.GFD_PRODUCT: self.product,
            c.GFD_MEMORY: str(self.memory_mib),
            c.GFD_COUNT: str(self.gpus),
            c.GFD_COMPUTE_MAJOR: str(self.compute[0]),
            c.GFD_COMPUTE_MINOR: str(self.compute[1]),
            c.GFD_FAMILY: self.family,
            c.GFD_DRIVER_MAJOR: str(FAKE_DRIVER_MAJOR),
        }

    def resources(self) -> dict[str, str]:
        resources = {
            "cpu": str(self.cpu),
            "memory": self.memory,
            "ephemeral-storage": self.ephemeral_storage,
            "pods": "110",
        }
        if self.rdma_devices:
            resources[FAKE_RDMA_RESOURCE] = str(self.rdma_devices)
        return resources | ({c.GPU_RESOURCE: str(self.gpus)} if self.gpus else {})

    def taints(self) -> list[dict[str, str]]:
        return [{"key": c.GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"}] if self.gpus else []


NODE_TYPES: dict[str, NodeType] = {
    t.pool: t
    for t in (
        NodeType("a800", "NVIDIA-A800-SXM4-80GB", 81920, 8, (8, 0), "ampere", 128, "2Ti", "7Ti", 64),
        NodeType("a40", "NVIDIA-A40", 46068, 4, (8, 6), "ampere", 64, "512Gi", "3Ti"),
        NodeType("l40s", "NVIDIA-L40S", 46068, 4, (8, 9), "ada-lovelace", 64, "512Gi", "3Ti"),
        NodeType("cpu", "", 0, 0, (0, 0), "", 16, "64Gi", "500Gi"),
    )
}
DEFAULT_POOLS: dict[str, int] = {"a800": 2, "a40": 2, "l40s": 2, "cpu": 0}


def validate_pools(pools: Mapping[str, int]) -> dict[str, int]:
    """Return the pools with known names and non-negative counts, or raise ClusterError naming the bad one."""
    for pool, count in pools.items():
        if pool not in NODE_TYPES:
            raise ClusterError(f"unknown node pool {pool!r}; known pools: {', '.join(NODE_TYPES)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ClusterError(f"node count for pool {pool!r} must be a whole number >= 0, got {count!r}")
    return dict(pools)


def next_names(pool: str, count: int, existing: Iterable[str]) -> list[str]:
    """Names for `count` new nodes of `pool` that continue after the highest index already present."""
    pattern = re.compile(rf"^{re.escape(pool)}-(\d+)$")
    taken = [int(m.group(1)) for name in existing if (m := pattern.match(name))]
    start = max(taken, default=-1) + 1
    return [f"{pool}-{i}" for i in range(start, start + count)]


def node_manifest(node_type: NodeType, name: str) -> dict[str, Any]:
    """A Node object with its status; the API server keeps the status given at creation."""
    resources = node_type.resources()
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": node_type.labels(name),
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": node_type.taints()},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def nodes_list(pools: Mapping[str, int], existing: Iterable[str] = ()) -> dict[str, Any]:
    """One v1 List holding every new node, so a single `kubectl create` adds hundreds at once."""
    existing = list(existing)
    items = [
        node_manifest(NODE_TYPES[pool], name)
        for pool, count in validate_pools(pools).items()
        for name in next_names(pool, count, existing)
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}
