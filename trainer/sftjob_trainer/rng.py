"""The random state a rank resumes with: Python's, NumPy's, torch's CPU generator and its own GPU's.

Saved per rank into every checkpoint (``rng-rank<N>.pt``) so a resumed run draws what the uninterrupted
one would have (dropout masks, anything seeded). Only the rank's current device's CUDA state is kept: a
restart may see fewer GPUs than the run that saved it.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    numpy_state: Any = np.random.get_state()
    kind, keys, pos, has_gauss, gauss = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():  # this rank's device only: a restart may see fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" not in state or not torch.cuda.is_available():
        return
    cuda = state["cuda"]
    if isinstance(cuda, list | tuple):  # older checkpoints hold one state per visible device
        index = torch.cuda.current_device()
        if index >= len(cuda):
            log.info("checkpoint holds no CUDA RNG state of device %d: keeping this run's seed", index)
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda)
