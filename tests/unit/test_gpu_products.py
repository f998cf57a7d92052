"""The GPU cards a job may land on: what the operator plans and ``sftjob plan`` shows, card by card."""

from __future__ import annotations

from typing import Any

import pytest

from sftjob import constants as c
from sftjob.gpu_products import cards_for_job, cards_for_types, default_products, profile_of
from sftjob.spec import SFTJobSpec

PRODUCTS = default_products()
A800_CARDS = ["A800-SXM4-80GB", "A800-PCIE-80GB", "A800-PCIE-40GB"]


def job(gpu: dict[str, Any], node_selector: dict[str, str] | None = None) -> SFTJobSpec:
    return SFTJobSpec.model_validate(
        {
            "model": {"name": "Qwen/Qwen2.5-0.5B-Instruct"},
            "dataset": {"name": "org/chats"},
            "gpu": gpu,
            "nodeSelector": node_selector or {},
        }
    )


def test_a_gpu_type_stands_for_every_card_of_it_each_planned_on_its_own() -> None:
    cards = cards_for_job(job({"type": "A800"}), PRODUCTS)
    assert list(cards.profiles) == A800_CARDS and cards.selected is None
    assert cards.profile_by_product["NVIDIA-A800-PCIE-40GB"] == "A800-PCIE-40GB"


def test_any_stands_for_every_card_of_every_type_in_the_order_any_prefers() -> None:
    cards = cards_for_job(job({"type": "Any"}), PRODUCTS)
    assert list(cards.profiles) == [*A800_CARDS, "L40S", "A40"]


def test_a_node_selector_on_the_gpu_product_narrows_the_job_to_that_card() -> None:
    selector = {c.GFD_PRODUCT: "NVIDIA-A800-PCIE-40GB", "zone": "a"}
    cards = cards_for_job(job({"type": "A800"}, selector), PRODUCTS)
    assert list(cards.profiles) == ["A800-PCIE-40GB"] and cards.selected == "NVIDIA-A800-PCIE-40GB"
    assert cards.profile_by_product == {"NVIDIA-A800-PCIE-40GB": "A800-PCIE-40GB"}


def test_a_node_selector_on_other_labels_or_on_a_product_outside_the_job_narrows_nothing() -> None:
    other_label = cards_for_job(job({"type": "A800"}, {"zone": "a"}), PRODUCTS)
    foreign = cards_for_job(job({"type": "A800"}, {c.GFD_PRODUCT: "NVIDIA-L40S"}), PRODUCTS)
    assert list(other_label.profiles) == list(foreign.profiles) == A800_CARDS
    assert foreign.selected is None


def test_a_configured_product_the_gpu_table_lacks_is_planned_as_its_types_least_card() -> None:
    cards = cards_for_types(["A800"], {"A800": ["NVIDIA-A800-SXM4-80GB", "Vendor-A800-Custom"]})
    assert list(cards.profiles) == ["A800-SXM4-80GB", "A800-PCIE-40GB"]
    assert cards.profile_by_product == {
        "NVIDIA-A800-SXM4-80GB": "A800-SXM4-80GB",
        "Vendor-A800-Custom": "A800-PCIE-40GB",
    }


@pytest.mark.parametrize(
    ("product", "key"),
    [
        ("NVIDIA-A800-40GB-Active", "A800-PCIE-40GB"),
        ("Vendor-A800-80GB", "A800-PCIE-80GB"),  # the size of two cards: the one without NVLink
        ("NVIDIA-A800-64GB", "A800-PCIE-40GB"),  # a size no A800 card has: the least card
        ("NVIDIA-A800-SXM4-80GB-MIG-1g.10gb", "A800-PCIE-40GB"),  # a slice, not its 80 GB card
    ],
)
def test_a_configured_product_naming_a_memory_size_is_planned_as_its_types_card_of_that_size(
    product: str, key: str
) -> None:
    assert cards_for_types(["A800"], {"A800": [product]}).profile_by_product == {product: key}
    assert profile_of(product, "A800").key == key  # status.gpu.profile of a pod that landed there


def test_a_time_sliced_product_is_planned_as_its_card_marked_time_sliced() -> None:
    products = {"L40S": ["NVIDIA-L40S", "NVIDIA-L40S-SHARED"]}
    cards = cards_for_types(["L40S"], products)
    assert cards.profile_by_product == {"NVIDIA-L40S": "L40S", "NVIDIA-L40S-SHARED": "L40S"}
    assert cards.profiles["L40S"].time_sliced
    whole = cards_for_types(["L40S"], products, {c.GFD_PRODUCT: "NVIDIA-L40S"})
    assert not whole.profiles["L40S"].time_sliced
    assert not cards_for_job(job({"type": "L40S"}), PRODUCTS).profiles["L40S"].time_sliced
