"""Why no node takes a pod of the operator's trainer image when its NVIDIA driver floor is what keeps it
out (``--image-min-driver-major``, GPU Feature Discovery's driver label in the node affinity), and what
to do: the Unschedulable message's hint. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from sftjob import constants as c

Obj = Mapping[str, Any]

# The newest CUDA major each NVIDIA driver major runs (Linux; CUDA minor version compatibility), newest first.
CUDA_MAJOR_OF_DRIVER = ((580, 13), (525, 12), (450, 11))


def driver_too_old(
    nodes: Iterable[Obj], products: Collection[str], min_driver_major: int | None
) -> str | None:
    """Why no node with one of ``products`` takes pods that need NVIDIA driver ``min_driver_major``: the
    drivers those nodes have (GPU Feature Discovery's label) or lack a label for, and what to do; None
    when one of them has such a driver, or none exists."""
    if not min_driver_major:
        return None
    old: dict[str, set[int]] = {}
    unlabelled: set[str] = set()
    for node in nodes:
        labels = (node.get("metadata") or {}).get("labels") or {}
        if (product := labels.get(c.GFD_PRODUCT)) not in products:
            continue
        major = str(labels.get(c.GFD_DRIVER_MAJOR) or "")
        if not major.isdigit():
            unlabelled.add(str(product))
        elif int(major) >= min_driver_major:
            return None
        else:
            old.setdefault(str(product), set()).add(int(major))
    if not old and not unlabelled:
        return None
    image_cuda = _cuda_major(min_driver_major)
    needs = f"NVIDIA driver >= {min_driver_major}" + (f" (CUDA {image_cuda})" if image_cuda else "")
    said = [f"the trainer image needs {needs}"]
    if old:
        have = "; ".join(
            f"nodes with {p} have {' or '.join(map(str, sorted(d)))}" for p, d in sorted(old.items())
        )
        # An older CUDA build is a way out only when the newest driver there runs an older CUDA major.
        theirs = _cuda_major(max(m for d in old.values() for m in d))
        build = (
            f" or set spec.image to a CUDA {theirs} build"
            if theirs and image_cuda and theirs < image_cuda
            else ""
        )
        said.append(f"{have}: upgrade the driver{build}")
    if unlabelled:
        said.append(
            f"nodes with {', '.join(sorted(unlabelled))} have no {c.GFD_DRIVER_MAJOR} label: NVIDIA GPU"
            " Feature Discovery sets it (install it, or check that it runs on those nodes)"
        )
    return "; ".join(said)


def _cuda_major(driver_major: int) -> int | None:
    """The newest CUDA major an NVIDIA driver major runs, or None when it runs none we know of."""
    return next((cuda for floor, cuda in CUDA_MAJOR_OF_DRIVER if driver_major >= floor), None)
