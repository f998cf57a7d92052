"""The GPU profile table: one row per card the planner knows, and lookups by the names it goes by.

The operator matches nodes on the GPU Feature Discovery label ``nvidia.com/gpu.product``; the trainer
finds its row from ``torch.cuda.get_device_name()``; both land on the same :class:`GpuProfile`, which
feeds the memory budget, the throughput model and the trainer's MFU metric.

All compute figures are DENSE tensor-core numbers. NVIDIA datasheets print the 2:4-sparsity figure
next to them (A800 bf16: 312 dense, "624" with sparsity); MFU against the sparse number halves the
reported efficiency. Sources: shared/research/trainer-gpu.md §1.1 (datasheets for A100/A800, A40,
L40S, H100; H200 = H100 compute with 141 GB HBM3e).

``memory_gib`` is what CUDA reports as the card's total capacity (what the training process can
address), which is less than the marketing "80 GB"/"48 GB" and less than the GFD
``nvidia.com/gpu.memory`` label (NVML MiB): an L40S reports "total capacity of 44.42 GiB" in
PyTorch's out-of-memory messages while its label says 46068 MiB.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GPU_TYPES: tuple[str, ...] = ("A800", "A40", "L40S")
ANY_GPU = "Any"


@dataclass(frozen=True)
class GpuProfile:
    key: str
    family: str
    memory_gib: float
    bandwidth_gbs: float
    bf16_tflops: float
    fp16_tflops: float
    tf32_tflops: float
    fp8_tflops: float | None
    compute_capability: tuple[int, int]
    nvlink_gbs: float | None  # the datasheet's figure, both directions together; None: PCIe only
    pcie_gen: int
    products: tuple[str, ...]  # GFD product labels and torch/NVML device names
    # Some node's product label says the card is time-sliced (GFD's "-SHARED" suffix): the job may share
    # it with other pods, and time-slicing isolates no memory between them.
    time_sliced: bool = False

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None

    @property
    def interconnect(self) -> str:
        return f"NVLink {self.nvlink_gbs:g} GB/s" if self.nvlink_gbs else f"PCIe Gen{self.pcie_gen} only"

    @property
    def link_gbs(self) -> float:
        """GPU-to-GPU bandwidth inside a node, GB/s per direction, for the throughput model: half the
        NVLink datasheet figure (which counts both directions), or PCIe's effective rate."""
        return self.nvlink_gbs / 2 if self.nvlink_gbs else PCIE_GBS[self.pcie_gen]

    @property
    def peak_tflops(self) -> float:
        """The MFU denominator: dense bf16."""
        return self.bf16_tflops


# Effective per-direction bandwidth of an x16 link (GB/s) after protocol overhead.
PCIE_GBS: dict[int, float] = {4: 25.0, 5: 50.0}

# fmt: off
PROFILES: tuple[GpuProfile, ...] = (
    GpuProfile(key="A800-SXM4-80GB", family="A800", memory_gib=79.15, bandwidth_gbs=2039,
               bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp8_tflops=None,
               compute_capability=(8, 0), nvlink_gbs=400, pcie_gen=4,
               products=("NVIDIA-A800-SXM4-80GB", "NVIDIA A800-SXM4-80GB")),
    # A800 PCIe cards can be paired with NVLink bridges, but bridges are optional hardware: plan as PCIe.
    GpuProfile(key="A800-PCIE-80GB", family="A800", memory_gib=79.15, bandwidth_gbs=1935,
               bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp8_tflops=None,
               compute_capability=(8, 0), nvlink_gbs=None, pcie_gen=4,
               products=("NVIDIA-A800-80GB-PCIe", "NVIDIA A800 80GB PCIe", "NVIDIA-A800-PCIE-80GB")),
    # The 40 GB PCIe card's product spellings were not observed on a real node (research §1.2).
    GpuProfile(key="A800-PCIE-40GB", family="A800", memory_gib=39.39, bandwidth_gbs=1555,
               bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp8_tflops=None,
               compute_capability=(8, 0), nvlink_gbs=None, pcie_gen=4,
               products=("NVIDIA-A800-PCIE-40GB", "NVIDIA A800-PCIE-40GB", "NVIDIA-A800-40GB-PCIe",
                         "NVIDIA A800 40GB PCIe")),
    GpuProfile(key="A40", family="A40", memory_gib=44.35, bandwidth_gbs=696,
               bf16_tflops=149.7, fp16_tflops=149.7, tf32_tflops=74.8, fp8_tflops=None,
               compute_capability=(8, 6), nvlink_gbs=None, pcie_gen=4,
               products=("NVIDIA-A40", "NVIDIA A40")),
    GpuProfile(key="L40S", family="L40S", memory_gib=44.42, bandwidth_gbs=864,
               bf16_tflops=362, fp16_tflops=362, tf32_tflops=183, fp8_tflops=733,
               compute_capability=(8, 9), nvlink_gbs=None, pcie_gen=4,
               products=("NVIDIA-L40S", "NVIDIA L40S")),
    GpuProfile(key="H100-SXM5-80GB", family="H100", memory_gib=79.19, bandwidth_gbs=3350,
               bf16_tflops=989, fp16_tflops=989, tf32_tflops=494, fp8_tflops=1979,
               compute_capability=(9, 0), nvlink_gbs=900, pcie_gen=5,
               products=("NVIDIA-H100-80GB-HBM3", "NVIDIA H100 80GB HBM3")),
    GpuProfile(key="H200-SXM-141GB", family="H200", memory_gib=139.8, bandwidth_gbs=4800,
               bf16_tflops=989, fp16_tflops=989, tf32_tflops=494, fp8_tflops=1979,
               compute_capability=(9, 0), nvlink_gbs=900, pcie_gen=5,
               products=("NVIDIA-H200", "NVIDIA H200")),
)
# fmt: on

# The row a family means when only the family is known (the SFTJob's spec.gpu.type).
_DEFAULT_KEY = {
    "A800": "A800-SXM4-80GB",
    "A40": "A40",
    "L40S": "L40S",
    "H100": "H100-SXM5-80GB",
    "H200": "H200-SXM-141GB",
}


# GFD appends this to the product label of a time-sliced GPU; the card is the same.
TIME_SLICED_SUFFIX = "-shared"
# A memory size in a product label or profile key ("NVIDIA-A800-40GB-PCIe", "A800-PCIE-40GB").
_NAMED_GB = re.compile(r"(\d+)gb\b")


def _dashed(name: str) -> str:
    return re.sub(r"\s+", "-", name.strip()).casefold()


def normalise_product(name: str) -> str:
    """GFD labels are NVML names with spaces turned into dashes; compare both spellings that way."""
    return _dashed(name).removesuffix(TIME_SLICED_SUFFIX)


def is_time_sliced(product: str) -> bool:
    """Whether a GFD product label is that of a time-sliced GPU (``NVIDIA-L40S-SHARED``)."""
    return _dashed(product).endswith(TIME_SLICED_SUFFIX)


def named_gb(name: str) -> int | None:
    """The memory size (GB) a product label or profile key names, the smallest when it names several (a
    MIG slice's label names its card's and its own); None when it names none."""
    sizes = [int(size) for size in _NAMED_GB.findall(name.casefold())]
    return min(sizes, default=None)


_BY_PRODUCT = {normalise_product(p): profile for profile in PROFILES for p in profile.products}


def profile_for_product(name: str) -> GpuProfile | None:
    """The profile for a GFD ``nvidia.com/gpu.product`` label or a ``torch.cuda.get_device_name()``.

    MIG slices (``...-MIG-1g.10gb``) have a fraction of the card's memory and get no profile.
    """
    return _BY_PRODUCT.get(normalise_product(name))


def _family(gpu_type: str) -> str:
    for family in _DEFAULT_KEY:
        if family.casefold() == gpu_type.strip().casefold():
            return family
    known = ", ".join([*GPU_TYPES, ANY_GPU])
    raise ValueError(f"unknown GPU type {gpu_type!r}: expected one of {known}")


def profile_for_type(gpu_type: str) -> GpuProfile:
    """The default profile of a family (e.g. "A800" → the SXM4 80 GB card)."""
    key = _DEFAULT_KEY[_family(gpu_type)]
    return next(p for p in PROFILES if p.key == key)


def profiles_for_type(gpu_type: str) -> list[GpuProfile]:
    """Every card of a family ("Any": of all user-selectable families), in table order."""
    families = GPU_TYPES if gpu_type.strip().casefold() == ANY_GPU.casefold() else (_family(gpu_type),)
    return [profile for profile in PROFILES if profile.family in families]


def products_for_type(gpu_type: str) -> list[str]:
    """GFD product labels of every card in a family ("Any": all user-selectable families)."""
    return [p for profile in profiles_for_type(gpu_type) for p in profile.products if " " not in p]


def profile_for_key(key: str) -> GpuProfile:
    """A profile by its exact key (``Plan.gpu``), or by family/product name as a convenience."""
    for profile in PROFILES:
        if profile.key.casefold() == key.strip().casefold():
            return profile
    found = profile_for_product(key)
    return found if found is not None else profile_for_type(key)
