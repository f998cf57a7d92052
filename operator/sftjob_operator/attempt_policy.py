"""The seam between the reconcile and the restart policy: what the attempt after a history looks like.

The reconcile asks one question, in two places: "given the attempts so far, what is the next attempt
(its number, its plans, the nodes it avoids, when it may start), or why is there none?"

1. to render the current attempt's children (asked with the history *before* that attempt), so a
   ConfigMap or pod re-created after an operator crash carries the same plan as the original;
2. after the current attempt ended in failure (asked with the whole history), to restart or give up.

The restart policy (``restarts.next_attempt``) is the :data:`AttemptPolicy` the operator runs; the
reconcile only depends on this protocol, so its tests can plug in simpler policies. Whatever a policy
answers, :func:`numbered` keeps attempt numbers from going backwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from sftjob.attempts import AttemptRecord
from sftjob.spec import SFTJobSpec
from sftjob_operator.planning import CandidatePlans

NodeObj = Mapping[str, Any]


@dataclass(frozen=True)
class NextAttempt:
    """Start attempt ``attempt`` with ``plans`` once ``now >= not_before`` (None: at once)."""

    attempt: int
    plans: CandidatePlans
    avoid_nodes: tuple[str, ...] = ()  # nodes that failed the job: preferred against
    not_before: datetime | None = None
    ladder_step: str | None = None
    message: str = ""  # what changed from the previous attempt, for the event


@dataclass(frozen=True)
class GiveUp:
    """No further attempt: the job fails with this ``Failed`` condition reason and message."""

    reason: str
    message: str


class FinalFailure(Protocol):
    """Whether the failure that ended the history ends the job whatever the plans (asked without plans)."""

    def __call__(self, spec: SFTJobSpec, history: Sequence[AttemptRecord]) -> GiveUp | None: ...


class AttemptPolicy(Protocol):
    def __call__(
        self,
        spec: SFTJobSpec,
        history: Sequence[AttemptRecord],
        plans: CandidatePlans,
        *,
        nodes: Mapping[str, NodeObj],
        now: datetime,
    ) -> NextAttempt | GiveUp: ...


def numbered(decision: NextAttempt, history: Sequence[AttemptRecord], *, current: int) -> NextAttempt:
    """``decision`` numbered so attempts never go backwards, whatever the status lost: past every
    recorded attempt, and at least the ``current`` one (``status.attempt``, the pods' labels). A current
    attempt without a record (its record was unreadable, or the status was reset) is taken over under
    its own number: its pods are kept and judged like any attempt's, never doubled by a lower one."""
    recorded = max((r.attempt for r in history), default=0)
    return replace(decision, attempt=max(decision.attempt, recorded + 1, current))
