"""Raising a trainer pod's memory request after its node ran out of host memory (HostOOM): by how much,
up to what, and when there is no room left. Pure, like the restart policy that asks (``restarts``): every
raise is re-derived from the attempt history and the nodes on each pass."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from sftjob import constants as c
from sftjob.attempts import AttemptRecord
from sftjob.plan import Plan
from sftjob_operator.planning import CandidatePlans

NodeObj = Mapping[str, Any]
# Each host OOM raises the pod's memory request (and limit) by this factor, up to this share of the
# allocatable memory of the smallest node with the plan's GPU: the node's DaemonSet pods request some of it
# too, and a pod that asks for all of it is never scheduled (Pending without end), nor is a rank that lands
# on a smaller node of the same product. When the cap leaves less than this fraction more than the failed
# attempt had, that card is skipped, and the job fails with HostMemoryExhausted once no card is left.
HOST_OOM_MEMORY_FACTOR = 1.5
HOST_OOM_MEMORY_CAP = 0.9
HOST_OOM_MIN_RAISE = 0.1


def raise_host_memory(
    adjusted: dict[str, Plan],
    plans: CandidatePlans,
    host_ooms: Sequence[AttemptRecord],
    nodes: Mapping[str, NodeObj],
    changes: list[str],
) -> str | None:
    """Raise every fitting card's memory request in ``adjusted`` once per host OOM; a card whose nodes
    leave no room for a raise is skipped (said in ``changes``). Why the job ends once no card is left."""
    caps: list[str] = []
    for key, plan in adjusted.items():
        if not plan.fits:
            continue
        allocatable = host_memory_cap(key, plans, nodes, host_ooms[-1])
        memory = raised_memory(plan.resources.memory, len(host_ooms), allocatable)
        if memory is None:
            caps.append(f"{key}: {allocatable}")
            adjusted[key] = plan.model_copy(update={"fits": False})
            changes.append(f"{key}: skipped, no room to raise the memory request within {allocatable}")
        else:
            worker = (
                plan.resources.worker_memory
            )  # raised too: the pod that ran out is not known to be rank 0's
            if worker is not None:
                worker = min(
                    raised_memory(worker, len(host_ooms), allocatable) or memory, memory, key=parse_quantity
                )
            resources = plan.resources.model_copy(update={"memory": memory, "worker_memory": worker})
            adjusted[key] = plan.model_copy(update={"resources": resources})
    first = next((p for p in adjusted.values() if p.fits), None)
    if first is None:
        return (
            f"the trainer ran out of host memory {len(host_ooms)} time(s) and its memory request cannot be"
            f" raised {HOST_OOM_MIN_RAISE:.0%} more within {HOST_OOM_MEMORY_CAP:.0%} of the smallest"
            f" allocatable of the nodes with its GPU ({', '.join(caps)})"
        )
    changes.append(
        f"memory {plans.plans[first.gpu].resources.memory} -> {first.resources.memory} after host OOM"
    )
    return None


def host_memory_cap(
    key: str, plans: CandidatePlans, nodes: Mapping[str, NodeObj], oom: AttemptRecord
) -> str | None:
    """The allocatable memory a raised request for card ``key`` must fit in: the smallest among the nodes
    labelled with one of its GPU products (every rank must fit on whichever of them it lands), else the
    allocatable of the node that ran out (``oom``) when it had this card; None when neither is known."""
    products = {product for product, card in plans.profile_by_product.items() if card == key}
    sizes = [
        memory
        for node in nodes.values()
        if ((node.get("metadata") or {}).get("labels") or {}).get(c.GFD_PRODUCT) in products
        and (memory := _allocatable_memory(node)) is not None
    ]
    if sizes:
        return min(sizes, key=parse_quantity)
    return _allocatable_memory(nodes.get(oom.node or "")) if oom.gpu in (key, None) else None


def raised_memory(base: str, host_ooms: int, allocatable: str | None) -> str | None:
    """``base`` raised once per host OOM, capped at :data:`HOST_OOM_MEMORY_CAP` of ``allocatable``; None
    when that is not :data:`HOST_OOM_MIN_RAISE` more than the failed attempt (the ``host_ooms``-th) ran
    with."""
    mib = 2**20
    base_bytes = int(parse_quantity(base))
    cap = int(int(parse_quantity(allocatable)) * HOST_OOM_MEMORY_CAP) // mib * mib if allocatable else None

    def request(ooms: int) -> int:
        if ooms == 0:
            return base_bytes
        wanted = math.ceil(base_bytes * HOST_OOM_MEMORY_FACTOR**ooms / mib) * mib
        return wanted if cap is None else min(wanted, cap)

    raised = request(host_ooms)
    if raised < request(host_ooms - 1) * (1 + HOST_OOM_MIN_RAISE):
        return None
    return f"{raised // mib}Mi"


def _allocatable_memory(node: NodeObj | None) -> str | None:
    if node is None:
        return None
    memory = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
    return str(memory) if memory else None
