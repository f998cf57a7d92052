"""The GPU cards a job may land on: its GPU types expanded to product labels, then to GPU profiles.

A GPU type covers several cards (A800: SXM4 80 GB, PCIe 80 GB, PCIe 40 GB), each with its own memory
and interconnect and so its own plan. The operator plans every card here (``sftjob_operator.planning``)
and ``sftjob plan`` shows the same cards, so the two can never disagree on what a job may run on. A
``spec.nodeSelector`` on the GPU Feature Discovery product label names one card: the job can land
nowhere else, so it is planned for that card alone (and fails when that card's plan does not fit,
instead of waiting Pending for nodes its affinity and its selector can never both match).

The product mapping is operator configuration (``--gpu-products``); the default comes from
``sftjob.gpus``. A label the table lacks is planned as a card of its type by the memory size it names
(:func:`_card`); a time-sliced label (``-SHARED``) as its card, marked so the plan says that its budget
assumes the job has the GPU to itself. Pure: no I/O, no cluster.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from sftjob import constants as c
from sftjob.gpus import (
    GPU_TYPES,
    GpuProfile,
    is_time_sliced,
    named_gb,
    normalise_product,
    products_for_type,
    profile_for_product,
    profiles_for_type,
)
from sftjob.spec import SFTJobSpec

ProductMap = Mapping[str, Sequence[str]]  # GPU type ("A800") -> GFD product labels


@dataclass(frozen=True)
class GpuCards:
    """The distinct GPU profiles a job may land on, by key in preference order, and the product
    labels each serves (``selected``: the product a nodeSelector narrowed them to, if any)."""

    profiles: dict[str, GpuProfile]
    profile_by_product: dict[str, str]
    selected: str | None = None


def default_products() -> dict[str, list[str]]:
    return {gpu_type: products_for_type(gpu_type) for gpu_type in GPU_TYPES}


def profile_of(product: str, gpu_type: str | None = None) -> GpuProfile | None:
    """The profile for a node's product label; a configured product the table lacks is one of its type's
    cards (:func:`_card`)."""
    return profile_for_product(product) if gpu_type is None else _card(product, gpu_type)


def selector_problem(
    node_selector: Mapping[str, str], candidates: Sequence[str], products: ProductMap
) -> str | None:
    """A ``spec.nodeSelector`` on the GPU product label naming a product none of the job's GPU types
    has: its pods could never be scheduled, so the job is refused rather than left Pending for good."""
    wanted = node_selector.get(c.GFD_PRODUCT)
    allowed = [p for t in candidates for p in products[t]]
    if wanted is None or wanted in allowed:
        return None
    return (
        f"spec.nodeSelector {c.GFD_PRODUCT}={wanted} is none of the products of {', '.join(candidates)}"
        f" ({', '.join(allowed)}): no node could take the pods"
    )


def cards_for_types(
    gpu_types: Sequence[str], products: ProductMap, node_selector: Mapping[str, str] | None = None
) -> GpuCards:
    """Every card of ``gpu_types`` (in that order) under ``products``; a ``node_selector`` naming one
    of their product labels narrows them to that product's card. A selector naming a product outside
    them narrows nothing: admission refuses it (:func:`selector_problem`), and a job started
    before the operator's mapping changed keeps its cards. A card is time-sliced when any of its labels
    is."""
    cards = {product: _card(product, gpu_type) for gpu_type in gpu_types for product in products[gpu_type]}
    wanted = (node_selector or {}).get(c.GFD_PRODUCT)
    selected = wanted if wanted in cards else None
    if selected is not None:
        cards = {selected: cards[selected]}
    profiles: dict[str, GpuProfile] = {}
    for card in cards.values():
        if card.key not in profiles or card.time_sliced:
            profiles[card.key] = card
    return GpuCards(profiles, {product: card.key for product, card in cards.items()}, selected)


def cards_for_job(spec: SFTJobSpec, products: ProductMap) -> GpuCards:
    """The cards the operator plans ``spec`` for: its GPU types, most preferred first, narrowed by its
    nodeSelector."""
    return cards_for_types(spec.gpu.candidates(), products, spec.node_selector)


def _card(product: str, gpu_type: str) -> GpuProfile:
    """The card of ``gpu_type`` a node labelled ``product`` has: the built-in table's; for a label it
    lacks, the type's card of the memory size the label names ("NVIDIA-A800-40GB-Active": the 40 GB
    card), else the type's least card (least memory, then PCIe before NVLink): a plan for a smaller card
    than the node's leaves memory unused, one for a bigger card runs out of it."""
    card = profile_for_product(product)
    if card is None:
        cards = profiles_for_type(gpu_type)
        size = named_gb(product)
        named = [p for p in cards if size is not None and named_gb(p.key) == size]
        card = min(named or cards, key=lambda p: (p.memory_gib, p.nvlink_gbs or 0))
    return replace(card, time_sliced=True) if is_time_sliced(product) else card


def card_config(files: Collection[str], planned: Mapping[str, str], product: str | None) -> str | None:
    """The trainer config (a key of the job's ConfigMap) for a pod on a GPU whose product label (or CUDA
    device name) is ``product``: ``config.json`` when the operator rendered one plan, or ran without a
    GPU; else the card's ``config-<profile>.json``, its profile found in ``planned`` (the operator's
    product labels, ``products.json``) or the built-in table. None when there are per-card plans and none
    is found for this card (the caller then runs ``config.json``, the most preferred card's plan)."""
    if product is None or not any(name.startswith("config-") for name in files):
        return c.CONFIG_FILE
    labels = {normalise_product(label): key for label, key in planned.items()}
    profile = profile_for_product(product)
    key = labels.get(normalise_product(product)) or (profile.key if profile else None)
    variant = c.CONFIG_VARIANT.format(profile=key) if key else None
    return variant if variant in files else None
