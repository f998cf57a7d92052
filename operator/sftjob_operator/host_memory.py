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
from sftjob.plan import Plan, PodResources
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
MIB = 2**20


def raise_host_memory(
    adjusted: dict[str, Plan],
    plans: CandidatePlans,
    host_ooms: Sequence[AttemptRecord],
    nodes: Mapping[str, NodeObj],
    changes: list[str],
) -> str | None:
    """Raise every fitting card's memory requests in ``adjusted`` once per host OOM of their pods, from
    what the pods asked for: the most any card fitting in ``plans`` (the cards when the pods that ran out
    were made) needs (``CandidatePlans.memory_for``). A card whose nodes leave no room for the raise is
    skipped (said in ``changes``). Why the job ends once no card is left."""
    caps: list[str] = []
    asked = _asked(plans)
    for key, plan in adjusted.items():
        if not plan.fits:
            continue
        allocatable = host_memory_cap(key, plans, nodes, host_ooms[-1])
        resources = raised_resources(
            plan.resources.model_copy(update={"memory": asked.memory, "worker_memory": asked.worker_memory}),
            host_ooms,
            allocatable,
        )
        if resources is None:
            caps.append(f"{key}: {allocatable}")
            adjusted[key] = plan.model_copy(update={"fits": False})
            changes.append(f"{key}: skipped, no room to raise the memory request within {allocatable}")
        else:
            adjusted[key] = plan.model_copy(update={"resources": resources})
    first = next((p for p in adjusted.values() if p.fits), None)
    if first is None:
        return (
            f"the trainer ran out of host memory {len(host_ooms)} time(s) and its memory request cannot be"
            f" raised {HOST_OOM_MIN_RAISE:.0%} more within {HOST_OOM_MEMORY_CAP:.0%} of the smallest"
            f" allocatable of the nodes with its GPU ({', '.join(caps)})"
        )
    before, after = asked, _asked(CandidatePlans(adjusted, plans.profile_by_product))
    if before.worker_memory is None or after.worker_memory is None:
        changes.append(f"memory {before.memory} -> {after.memory} after host OOM")
    else:
        changes.append(
            f"memory {before.memory} -> {after.memory} (node rank 0), {before.worker_memory} ->"
            f" {after.worker_memory} (other nodes) after host OOM"
        )
    return None


def _asked(plans: CandidatePlans) -> PodResources:
    """The memory the pods of ``plans`` ask for, node rank 0's and the other nodes' (None: the same)."""
    first, others = plans.memory_for(0), plans.memory_for(1)
    return plans.first.resources.model_copy(
        update={"memory": first, "worker_memory": None if others == first else others}
    )


def raised_resources(
    resources: PodResources, host_ooms: Sequence[AttemptRecord], allocatable: str | None
) -> PodResources | None:
    """``resources`` after ``host_ooms``; None when the pod that ran out last has no room left.

    One pod shape: raised once per host OOM. Two (node rank 0's and the other nodes', ``worker_memory``):
    each raised once per host OOM of its own pods (``AttemptRecord.node_rank``; one not known counts for
    both), and the job goes on while the shape that ran out last can grow (either, when not known).
    """
    if resources.worker_memory is None:
        memory = raised_memory(resources.memory, len(host_ooms), allocatable)
        return None if memory is None else resources.model_copy(update={"memory": memory})
    ranks = [r.node_rank for r in host_ooms]
    first, others = sum(n in (None, 0) for n in ranks), sum(n != 0 for n in ranks)
    first_grows = raised_memory(resources.memory, first, allocatable) is not None
    others_grow = raised_memory(resources.worker_memory, others, allocatable) is not None
    last = ranks[-1]
    if not (first_grows if last == 0 else others_grow if last is not None else first_grows or others_grow):
        return None
    return resources.model_copy(
        update={
            "memory": memory_after(resources.memory, first, allocatable),
            "worker_memory": memory_after(resources.worker_memory, others, allocatable),
        }
    )


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
    if host_ooms == 0:
        return None
    raised = _request(base, host_ooms, allocatable)
    if raised < _request(base, host_ooms - 1, allocatable) * (1 + HOST_OOM_MIN_RAISE):
        return None
    return f"{raised // MIB}Mi"


def memory_after(base: str, host_ooms: int, allocatable: str | None) -> str:
    """``base`` after ``host_ooms`` raises, capped: ``base`` itself when there were none."""
    return base if host_ooms == 0 else f"{_request(base, host_ooms, allocatable) // MIB}Mi"


def _request(base: str, host_ooms: int, allocatable: str | None) -> int:
    base_bytes = int(parse_quantity(base))
    if host_ooms == 0:
        return base_bytes
    wanted = math.ceil(base_bytes * HOST_OOM_MEMORY_FACTOR**host_ooms / MIB) * MIB
    if allocatable is None:
        return wanted
    return min(wanted, int(int(parse_quantity(allocatable)) * HOST_OOM_MEMORY_CAP) // MIB * MIB)


def _allocatable_memory(node: NodeObj | None) -> str | None:
    if node is None:
        return None
    memory = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
    return str(memory) if memory else None
