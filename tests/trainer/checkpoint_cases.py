"""What the checkpoint tests share: one process, an attempt of a job, small trainables to save and load."""

from __future__ import annotations

from pathlib import Path

import torch

from sftjob.config import JobRef
from sftjob_trainer import checkpoints
from sftjob_trainer.checkpoints import Trainables
from sftjob_trainer.distributed import DistContext

ONE_PROCESS = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def attempt(n: int, uid: str = "uid-1") -> JobRef:
    return JobRef(name="job", uid=uid, attempt=n)


def trainables() -> Trainables:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Trainables(model, optimizer, scheduler, scaler=None)


def trainables_of_width(width: int) -> Trainables:
    model = torch.nn.Linear(4, width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return Trainables(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None)


def unloadable(path: Path) -> None:
    """Tensor files as long as the index says but not loadable: the checks pass, loading fails part-way."""
    for tensors in (path / checkpoints.TENSORS_DIR).glob("*.distcp"):
        tensors.write_bytes(bytes(tensors.stat().st_size))


def bad(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(checkpoints.BAD_PREFIX))
