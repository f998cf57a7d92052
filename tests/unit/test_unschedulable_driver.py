"""Pods of the operator's image only go to nodes whose NVIDIA driver is new enough for it: when that is
what leaves every node with the job's GPUs out, the Unschedulable message says so, and what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sftjob import constants as c
from sftjob_operator.observe import trim_node, unschedulable_message

A40 = "NVIDIA-A40"
L40S = "NVIDIA-L40S"
AFFINITY = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. preemption: 0/3 nodes"
    " are available: 3 Preemption is not helpful for scheduling."
)


def node(name: str, product: str, driver: str | None) -> dict[str, Any]:
    """A node as the operator's index keeps it (``trim_node``), labelled by GPU Feature Discovery."""
    labels = {c.GFD_PRODUCT: product, "nvidia.com/gpu.count": "4"}
    if driver is not None:
        labels[c.GFD_DRIVER_MAJOR] = driver
    return trim_node({"metadata": {"name": name, "labels": labels}, "status": {}})


def pending(message: str) -> list[dict[str, Any]]:
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
    return [{"metadata": {"name": "job-1-0"}, "status": {"phase": "Pending", "conditions": [condition]}}]


def said(
    message: str,
    nodes: list[dict[str, Any]],
    min_driver_major: int | None = 580,
    products: Sequence[str] = (A40,),
) -> str | None:
    return unschedulable_message(
        pending(message), nodes=nodes, products=products, min_driver_major=min_driver_major
    )


def test_nodes_whose_driver_is_too_old_for_the_trainer_image_are_named_with_the_fix() -> None:
    nodes = [node("a40-0", A40, "535"), node("a40-1", A40, "550"), node("l40s-0", "NVIDIA-L40S", "580")]
    assert said(AFFINITY, nodes) == (
        f"{AFFINITY[:-1]}; the trainer image needs NVIDIA driver >= 580 (CUDA 13); nodes with NVIDIA-A40"
        " have 535 or 550: upgrade the driver or set spec.image to a CUDA 12 build"
    )


def test_nodes_without_a_driver_label_are_sent_to_gpu_feature_discovery_not_to_a_driver_upgrade() -> None:
    message = said(AFFINITY, [node("a40-0", A40, None)])
    assert message is not None and "upgrade the driver" not in message and "spec.image" not in message
    assert message.endswith(
        f"needs NVIDIA driver >= 580 (CUDA 13); nodes with NVIDIA-A40 have no {c.GFD_DRIVER_MAJOR} label:"
        " NVIDIA GPU Feature Discovery sets it (install it, or check that it runs on those nodes)"
    )


def test_nodes_with_an_old_driver_and_nodes_without_the_label_are_both_named() -> None:
    message = said(
        AFFINITY, [node("a40-0", A40, "535"), node("l40s-0", "NVIDIA-L40S", None)], products=[A40, L40S]
    )
    assert message is not None
    assert (
        "; nodes with NVIDIA-A40 have 535: upgrade the driver or set spec.image to a CUDA 12 build; "
        in message
    )
    assert message.endswith(
        f"nodes with {L40S} have no {c.GFD_DRIVER_MAJOR} label: NVIDIA GPU Feature"
        " Discovery sets it (install it, or check that it runs on those nodes)"
    )


def test_an_older_cuda_build_is_suggested_only_when_it_is_older_than_the_trainer_images() -> None:
    # An image that needs driver 570 is a CUDA 12 build: a CUDA 12 build is no way out for driver 535.
    message = said(AFFINITY, [node("a40-0", A40, "535")], min_driver_major=570)
    assert message is not None and message.endswith(
        "needs NVIDIA driver >= 570 (CUDA 12); nodes with NVIDIA-A40 have 535: upgrade the driver"
    )
    # A driver that runs no CUDA we know of gets no build to try either.
    ancient = said(AFFINITY, [node("a40-0", A40, "418")])
    assert ancient is not None and ancient.endswith("nodes with NVIDIA-A40 have 418: upgrade the driver")


def test_the_scheduler_alone_speaks_when_the_driver_is_not_what_keeps_the_pods_out() -> None:
    full = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    assert said(full, [node("a40-0", A40, "535")]) == full  # not a node affinity mismatch
    assert said(AFFINITY, [node("a40-0", A40, "535"), node("a40-1", A40, "580")]) == AFFINITY
    assert said(AFFINITY, [node("l40s-0", "NVIDIA-L40S", "535")]) == AFFINITY  # no node with the job's GPU
    assert said(AFFINITY, [node("a40-0", A40, "535")], min_driver_major=None) == AFFINITY  # its own image


def test_the_node_index_keeps_the_driver_label() -> None:
    assert node("a40-0", A40, "535")["metadata"]["labels"] == {c.GFD_PRODUCT: A40, c.GFD_DRIVER_MAJOR: "535"}
