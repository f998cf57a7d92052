"""What torchrun prints about its workers: each one's tee'd lines and, when one fails, its report.

Two readers need the same words. The operator reads them from the log tail the kubelet keeps when the
trainer wrote no termination message (:mod:`sftjob_operator.termination`); the trainer's launcher
(``sftjob_trainer.launch``, the container's PID 1 above torchrun) reads them from torchrun's stderr as they
come, and when a rank was killed by a signal (the NCCL watchdog's SIGABRT, a segfault, the OOM killer's
SIGKILL) writes the message that rank could not. Reading the report once, here, keeps both summing up a
failure alike (``rank 1 killed by SIGABRT: <its last words>``). The report ends with the root cause::

    ============================================================
    sftjob_trainer.train FAILED
    ------------------------------------------------------------
    ...
    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-30_09:00:10
      host      : llama-sft-1-0
      rank      : 1 (local_rank: 1)
      exitcode  : -6 (pid: 10526)  (SIGABRT)
    ...
    ============================================================

With ``--tee=2`` torchrun prints each worker's stderr lines behind ``[<role><local rank>]:``
(``[default1]:...``, its role being ``default``), which is how the launcher knows whose last words are whose.
Pure functions, no I/O.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

# The heading of the last block of torchrun's report (torch.distributed.elastic.multiprocessing.errors).
ROOT_CAUSE_HEADING = "Root Cause (first observed failure):"
RULE = re.compile(r"^\s*([=*-])\1{2,}\s*$")  # the report's =/- rules, torchrun's ***** banner
_REPORT_FIELD = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
_ALPHANUMERIC = re.compile(r"[A-Za-z0-9]")
# A C++ backtrace (c10::Error's "Exception raised from ...", then "frame #N: ..."), as an NCCL watchdog abort
# prints below its what(): never the words that say what happened.
CPP_BACKTRACE = re.compile(r"^(?:frame #\d+: |Exception raised from )")
# The prefix torchrun's --tee puts before a worker's line: its default template, [${role_name}${local_rank}]:,
# with the role torchrun's default (--role), which the pod's command leaves alone.
_WORKER_LINE = re.compile(r"^\[default(\d+)\]:")


@dataclass(frozen=True, slots=True)
class RootCause:
    """The report's first failed worker: its global ``rank``, its ``local_rank`` on the node, and its
    ``exitcode`` (negative: killed by that signal); each None when the report does not say."""

    rank: int | None
    local_rank: int | None
    exitcode: int | None

    def describe(self) -> str:
        """``rank 1 killed by SIGABRT``, ``rank 0 exited with code 1``; empty without an exit code."""
        if self.exitcode is None:
            return ""
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        if self.exitcode >= 0:
            return f"{who} exited with code {self.exitcode}"
        try:
            return f"{who} killed by {signal.Signals(-self.exitcode).name}"
        except ValueError:
            return f"{who} killed by signal {-self.exitcode}"


@dataclass(frozen=True, slots=True)
class Report:
    """The last report in some lines: ``start``, the index of its top rule (0 when the lines begin inside
    it), and its ``root_cause``."""

    start: int
    root_cause: RootCause


def read_report(lines: Sequence[str]) -> Report | None:
    """The last report of torchrun in ``lines``, or None when they hold no root-cause heading."""
    heading = max((i for i, line in enumerate(lines) if line.strip() == ROOT_CAUSE_HEADING), default=None)
    if heading is None:
        return None
    top = max((i for i in range(heading) if RULE.match(lines[i]) and "=" in lines[i]), default=0)
    return Report(top, _root_cause(lines[heading + 1 :]))


def summarize(cause: RootCause, words: str) -> str:
    """How the root cause ended, then the last words it wrote: ``rank 1 killed by SIGABRT: <words>``."""
    root = cause.describe()
    return f"{root}: {words}" if root and words else root or words


def last_words(lines: Sequence[str], local_rank: int | None = None) -> str:
    """The last line with letters or digits that is neither a rule nor a C++ backtrace's: where a traceback
    puts the error, and a C++ exception its what(). Tee'd lines are read without their prefix, and when some
    are the worker ``local_rank``'s, only its own are (a peer's last lines are its shutdown)."""
    tagged = [(worker_line(line), line) for line in lines]
    if any(worker is not None and worker[0] == local_rank for worker, _ in tagged):
        said = [worker[1] for worker, _ in tagged if worker is not None and worker[0] == local_rank]
    else:
        said = [worker[1] if worker is not None else line for worker, line in tagged]
    return next(
        (
            s
            for s in (line.strip() for line in reversed(said))
            if _ALPHANUMERIC.search(s) and not RULE.match(s) and not CPP_BACKTRACE.match(s)
        ),
        "",
    )


def worker_line(line: str) -> tuple[int, str] | None:
    """The local rank that wrote a tee'd line and the line as it wrote it; None for torchrun's own lines."""
    match = _WORKER_LINE.match(line)
    return (int(match[1]), line[match.end() :]) if match else None


def _root_cause(block: Sequence[str]) -> RootCause:
    """The fields of the report's root-cause block, up to its closing rule (the first of each)."""
    fields: dict[str, int] = {}
    for line in block:
        if RULE.match(line):
            break
        match = _REPORT_FIELD.match(line)
        if match and match[1] not in fields:
            fields[match[1]] = int(match[2])
            if match[3] is not None:
                fields["local_rank"] = int(match[3])
    return RootCause(fields.get("rank"), fields.get("local_rank"), fields.get("exitcode"))
