"""The GPU profile table and its lookups."""

import pytest

from sftjob.gpus import GPU_TYPES, PROFILES, products_for_type, profile_for_product, profile_for_type


def test_a800_bf16_is_the_dense_number_not_the_sparse_one():
    assert profile_for_type("A800").bf16_tflops == 312


@pytest.mark.parametrize(("family", "dense"), [("A40", 149.7), ("L40S", 362), ("H100", 989), ("H200", 989)])
def test_every_family_reports_dense_bf16_tflops(family, dense):
    assert profile_for_type(family).bf16_tflops == dense


def test_only_ada_and_hopper_cards_have_fp8():
    with_fp8 = {p.family for p in PROFILES if p.has_fp8}
    assert with_fp8 == {"L40S", "H100", "H200"}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA-A800-SXM4-80GB", "A800-SXM4-80GB"),
        ("NVIDIA A800-SXM4-80GB", "A800-SXM4-80GB"),
        ("NVIDIA-A800-80GB-PCIe", "A800-PCIE-80GB"),
        ("NVIDIA A800 80GB PCIe", "A800-PCIE-80GB"),
        ("NVIDIA-A40", "A40"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA-L40S", "L40S"),
        ("NVIDIA L40S", "L40S"),
        ("nvidia-l40s", "L40S"),
        ("NVIDIA-L40S-SHARED", "L40S"),
        ("NVIDIA H200", "H200-SXM-141GB"),
    ],
)
def test_profiles_are_found_by_gfd_label_and_by_torch_device_name(name, key):
    profile = profile_for_product(name)
    assert profile is not None
    assert profile.key == key


def test_unknown_and_mig_products_have_no_profile():
    assert profile_for_product("NVIDIA-L4") is None
    assert profile_for_product("NVIDIA-A800-SXM4-80GB-MIG-1g.10gb") is None


def test_products_for_a_family_are_gfd_labels_without_spaces():
    assert products_for_type("A40") == ["NVIDIA-A40"]
    a800 = products_for_type("a800")
    assert "NVIDIA-A800-SXM4-80GB" in a800
    assert "NVIDIA-A800-80GB-PCIe" in a800
    assert all(" " not in p for p in a800)


def test_any_means_every_user_selectable_family():
    products = products_for_type("Any")
    assert {"NVIDIA-A40", "NVIDIA-L40S", "NVIDIA-A800-SXM4-80GB"} <= set(products)
    assert not any("H100" in p or "H200" in p for p in products)


def test_unknown_gpu_type_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="A800, A40, L40S"):
        profile_for_type("V100")


def test_pcie_cards_have_no_nvlink_and_the_sxm_a800_has_400_gbs():
    assert profile_for_type("A800").nvlink_gbs == 400
    assert profile_for_type("A40").nvlink_gbs is None
    assert profile_for_type("L40S").nvlink_gbs is None


def test_user_selectable_types_have_a_default_profile_with_their_memory():
    assert GPU_TYPES == ("A800", "A40", "L40S")
    assert profile_for_type("A800").memory_gib > 79
    assert 44 < profile_for_type("A40").memory_gib < 46
    assert 44 < profile_for_type("L40S").memory_gib < 46
