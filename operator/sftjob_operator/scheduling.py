"""Where trainer pods may run: the GPU-type-to-product mapping, the node affinity built from it, and the
pod affinity that keeps a multi-node job's ranks on one GPU product, one rank per node.

Nodes are matched on the ``nvidia.com/gpu.product`` label GPU Feature Discovery sets. A single GPU type
becomes a required affinity on that type's products; ``Any`` or an ordered list becomes a required
affinity on every candidate's products plus preferred terms weighted in the user's order, so the
scheduler picks the first preference with free GPUs and still lands the job elsewhere when it has none.
Nodes that failed the job before are a preferred term too, weighted above any GPU-type preference: the
scheduler scores a retry against them (a preference, one score among its others, not a rule), yet a job
on a small pool is not held Pending forever by a node that was lost once and came back (what keeps pods
off a node that is still broken is the cluster's own state: its NotReady taint, a cordon, the device
plugin withdrawing unhealthy GPUs).

The ranks of a multi-node attempt require the product of the attempt's other pods and a node none of
them is on. Each rank loads the plan of the card it finds, and ranks planned for different cards run
different batch shapes or sharding (FSDP then waits for a collective that never comes); two ranks on one
node would talk over TCP instead of NVLink. The first pod goes wherever the node affinity allows
(kube-scheduler's InterPodAffinity filter passes a pod that matches its own required term while no pod
in the cluster does) and the others follow its product; when that product has no other free node, they
wait Pending, as the scheduler never moves a bound pod.

The mapping is operator configuration (``--gpu-products``, parsed here); the default and the cards it
leads to are ``sftjob.gpu_products``, shared with ``sftjob plan``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sftjob import constants as c
from sftjob.gpu_products import ProductMap, default_products
from sftjob.gpus import GPU_TYPES
from sftjob.kube_names import LABEL_VALUE, LABEL_VALUE_RULE

HOSTNAME_FIELD = "metadata.name"
HOSTNAME_LABEL = "kubernetes.io/hostname"  # the kubelet's label: one value per node
# The weight of "not a node that failed the job before": at least the top GPU-type preference (100), so
# a healthy node of any candidate type outscores a failed node of the most preferred one (100 + 25 > 100).
AVOID_WEIGHT = 100


def parse_products(text: str) -> dict[str, list[str]]:
    """``{"A800": ["NVIDIA-A800-SXM4-80GB", ...], ...}`` from operator configuration, checked: the types
    it names replace the default's; every product is a label value, of one GPU type only (the type of a
    node is looked up from its product)."""
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise ValueError(f"the GPU product mapping is not JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError("the GPU product mapping must be a JSON object of GPU type -> product labels")
    mapping = default_products()
    for gpu_type, products in raw.items():
        if gpu_type not in GPU_TYPES:
            raise ValueError(
                f"unknown GPU type {gpu_type!r} in the product mapping; known: {', '.join(GPU_TYPES)}"
            )
        if (
            not isinstance(products, list)
            or not products
            or not all(isinstance(p, str) and p for p in products)
        ):
            raise ValueError(f"products for {gpu_type} must be a non-empty list of labels")
        bad = [p for p in products if not re.fullmatch(LABEL_VALUE, p)]
        if bad:
            raise ValueError(
                f"products for {gpu_type} must be {c.GFD_PRODUCT} label values ({LABEL_VALUE_RULE}),"
                f" got {', '.join(map(repr, bad))}"
            )
        mapping[gpu_type] = list(dict.fromkeys(products))
    owners: dict[str, str] = {}
    for gpu_type, products in mapping.items():
        for product in products:
            other = owners.setdefault(product, gpu_type)
            if other != gpu_type:
                default = [t for t in (other, gpu_type) if t not in raw]
                given = f" ({default[0]} has it by default: name {default[0]} too)" if default else ""
                raise ValueError(
                    f"product {product!r} is listed under both {other} and {gpu_type}{given}:"
                    " a product belongs to one GPU type"
                )
    return mapping


def type_of(product: str, products: ProductMap) -> str | None:
    """The GPU type a product label belongs to under the mapping."""
    return next((t for t, labels in products.items() if product in labels), None)


def node_affinity(
    preferences: Sequence[str],
    products: ProductMap,
    *,
    allowed_products: Sequence[str] | None = None,
    avoid_nodes: Sequence[str] = (),
    min_driver_major: int | None = None,
) -> dict[str, Any]:
    """The pod's ``affinity.nodeAffinity`` for GPU types in preference order.

    ``allowed_products`` narrows the candidates (products whose plan does not fit are left out);
    ``avoid_nodes`` (nodes that failed the job before) are preferred against;
    ``min_driver_major`` keeps the pods off nodes whose NVIDIA driver (GPU Feature Discovery's label)
    is too old for the image.
    """
    by_type = [
        [p for p in products[t] if allowed_products is None or p in allowed_products] for t in preferences
    ]
    every = [p for labels in by_type for p in labels]
    term: dict[str, Any] = {"matchExpressions": [{"key": c.GFD_PRODUCT, "operator": "In", "values": every}]}
    if min_driver_major:
        driver = {"key": c.GFD_DRIVER_MAJOR, "operator": "Gt", "values": [str(min_driver_major - 1)]}
        term["matchExpressions"].append(driver)
    affinity: dict[str, Any] = {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
    }
    preferred = [
        {
            "weight": max(1, 100 // (2**rank)),
            "preference": {"matchExpressions": [{"key": c.GFD_PRODUCT, "operator": "In", "values": labels}]},
        }
        for rank, labels in enumerate(by_type)
        if labels
    ]
    if len(preferred) == 1:  # a single type: every allowed node matches it, the term ranks nothing
        preferred = []
    if avoid_nodes:
        # One requirement per node (ANDed): the API server takes one value in a field selector's NotIn.
        not_failed = [{"key": HOSTNAME_FIELD, "operator": "NotIn", "values": [node]} for node in avoid_nodes]
        preferred.append({"weight": AVOID_WEIGHT, "preference": {"matchFields": not_failed}})
    if preferred:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return affinity


def gpu_tolerations() -> list[dict[str, Any]]:
    """GPU node pools carry a ``nvidia.com/gpu`` taint; trainer pods always tolerate it."""
    return [{"key": c.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]


def gang_affinity(selector: Mapping[str, str]) -> dict[str, Any]:
    """``podAffinity`` and ``podAntiAffinity`` for the pods of one multi-node attempt (``selector`` picks
    them out): every pod on the GPU product of the others, no two on one node."""
    term = {"labelSelector": {"matchLabels": dict(selector)}}
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term | {"topologyKey": c.GFD_PRODUCT}]
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [term | {"topologyKey": HOSTNAME_LABEL}]
        },
    }
