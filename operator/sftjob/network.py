"""``spec.network``: how the trainer pods of a multi-node job reach each other, and what the planner assumes.

NCCL moves gradients and parameters between nodes over RDMA (InfiniBand or RoCE) only when the pod holds
the node's RDMA devices, which a device plugin offers as an extended resource (the NVIDIA Network
Operator's shared RDMA plugin, ``rdma/rdma_shared_device_a``; an SR-IOV plugin's VF pool) and, on many
clusters, a secondary network that Multus attaches from a pod annotation (``spec.podAnnotations``).
Without them NCCL falls back to TCP sockets over the pod network, several times slower: the planner's
throughput model (:mod:`sftjob.throughput`) must know which one it plans for. Single-node jobs talk over
NVLink or PCIe and request no RDMA devices whatever the spec says.

No capability is added: RDMA memory registration pins pages up to RLIMIT_MEMLOCK, and an IPC_LOCK the
device plugins' examples add would never reach the trainer, which runs as a non-root user (Kubernetes
puts added capabilities in no ambient set, kubernetes/kubernetes#56374). The nodes' container runtime
must give containers an unlimited memlock limit: a systemd drop-in with LimitMEMLOCK=infinity for containerd
or CRI-O on the RDMA nodes (neither ships one; docs/api.md).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from sftjob.constants import GPU_RESOURCE
from sftjob.kube_names import SpecModel, valid_label_key

# What one node's trainer pod moves between nodes, in Gb/s, when the spec does not say.
DEFAULT_RDMA_GBPS = 200  # one HDR InfiniBand or 200 GbE RoCE NIC
DEFAULT_TCP_GBPS = 25  # NCCL's socket transport over the pod network
# An extended resource: a domain prefix (not kubernetes.io, which is the API server's), '/', a name.
EXTENDED_RESOURCE_RULE = (
    "an extended resource name: a DNS subdomain outside kubernetes.io, '/', then a name of at most 63"
    " letters, digits, '-', '_' or '.', e.g. rdma/rdma_shared_device_a"
)


QUOTA_PREFIX = "requests."
MAX_DOMAIN = 253


class RdmaSpec(SpecModel):
    resource_name: Annotated[str, StringConstraints(min_length=3, max_length=317)]
    count: int = Field(default=1, ge=1, le=64)

    @field_validator("resource_name")
    @classmethod
    def _extended_resource(cls, name: str) -> str:
        prefix = name.partition("/")[0]
        if "/" not in name or not valid_label_key(name) or prefix.endswith("kubernetes.io"):
            raise ValueError(f"resourceName {name!r} is not {EXTENDED_RESOURCE_RULE}")
        # The API server also names each extended resource's quota "requests.<name>": that must be a
        # qualified name too, and a name already starting so is refused.
        if name.startswith(QUOTA_PREFIX) or len(QUOTA_PREFIX + prefix) > MAX_DOMAIN:
            raise ValueError(
                f"resourceName {name!r}: the API server refuses extended resources starting {QUOTA_PREFIX!r}"
                f" or whose domain is longer than {MAX_DOMAIN - len(QUOTA_PREFIX)} characters"
            )
        if name == GPU_RESOURCE:
            raise ValueError(f"resourceName {GPU_RESOURCE} is the GPUs, which spec.gpu requests")
        return name


class NetworkSpec(SpecModel):
    rdma: RdmaSpec | None = None
    bandwidth_gbps: int | None = Field(default=None, ge=1, le=6400)


def inter_node_gbs(network: NetworkSpec) -> float:
    """What the planner assumes one node moves to the others, in GB/s."""
    gbps = network.bandwidth_gbps or (DEFAULT_RDMA_GBPS if network.rdma else DEFAULT_TCP_GBPS)
    return gbps / 8
