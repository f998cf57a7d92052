"""Every rank reads and tokenizes the dataset itself: the check that they all read the same.

With a copy of the dataset per node (a ``hostPath`` volume, a node-local cache) the ranks of a multi-node
job can read different rows. They would then count different steps and wait in collectives the others
never join, hanging until the operator's stall timeout, in every attempt; so can the nodes of a job on a hub
dataset without a pinned revision, downloading it at different times. Right after the data is tokenized and
packed the ranks compare what they read (one all-reduce in the setup group, which waits for a node still
downloading); a difference is a ``DATA_ERROR`` on every rank, so all of them exit together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.batching import Unit
from sftjob_trainer.data import Example
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.evaluation import fingerprint

_PATH_ADVICE = "give every node the same files (a shared volume, not a copy per node)"
_HUB_ADVICE = (
    "pin spec.dataset.revision to a commit (the nodes downloaded the hub dataset at different times)"
)


@dataclass(frozen=True)
class DataCounts:
    """What one rank read: rows, training units (packed rows or examples), their tokens, held-out examples,
    their target tokens and a digest of them (:func:`evaluation.fingerprint`'s, 52 bits: exact as a float).
    Ranks whose held-out examples differ, even in number alike, would build evaluation batches of their own
    and wait in each other's collectives; the same examples make the same evaluation units on every rank."""

    rows: int
    units: int
    tokens: int
    held_out: int
    held_out_targets: int = 0
    held_out_digest: int = 0

    @classmethod
    def of(cls, rows: int, units: Sequence[Unit], held: Sequence[Example]) -> DataCounts:
        evaluated = fingerprint(list(held))
        digest = int(evaluated["digest"][:13], 16)
        tokens = sum(sum(u.lengths) for u in units)
        return cls(rows, len(units), tokens, len(held), evaluated["targets"], digest)

    def __str__(self) -> str:
        return (
            f"{self.rows} rows ({self.units} units, {self.tokens} tokens, {self.held_out} held out with"
            f" {self.held_out_targets} target tokens, digest {self.held_out_digest:013x})"
        )


def check_same_data(ctx: DistContext, counts: DataCounts, dataset: DatasetSource) -> None:
    """Collective: raises ``DATA_ERROR`` on every rank when any rank read other data than rank 0 of
    ``dataset`` (its kind decides the advice)."""
    if not ctx.active:
        return
    width = len(fields(DataCounts))
    mine = [0.0] * (width * ctx.world_size)
    mine[ctx.rank * width : (ctx.rank + 1) * width] = map(float, astuple(counts))
    everyone = ctx.sum_after_setup(mine)  # float64: exact for counts below 2**53
    per_rank = [
        DataCounts(*(int(v) for v in everyone[r * width : (r + 1) * width])) for r in range(ctx.world_size)
    ]
    problem = difference(per_rank, dataset)
    if problem is not None:
        raise TrainerError(ExitCode.DATA_ERROR, problem)


def difference(per_rank: Sequence[DataCounts], dataset: DatasetSource) -> str | None:
    """Why the ranks' data differ (the first rank that read other data than rank 0), and what to do about
    it; None when they do not."""
    others = [rank for rank, counts in enumerate(per_rank) if counts != per_rank[0]]
    if not others:
        return None
    rank = others[0]
    also = f" (and {len(others) - 1} more ranks)" if len(others) > 1 else ""
    advice = _HUB_ADVICE if dataset.name is not None else _PATH_ADVICE
    return (
        f"rank {rank}{also} read {per_rank[rank]}, rank 0 read {per_rank[0]}: the dataset differs between"
        f" nodes; {advice}"
    )
