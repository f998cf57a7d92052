"""torchrun's report on a failed worker, as the operator's log-tail reader and the trainer's launcher read it
(torch.distributed.elastic.multiprocessing.errors): shared by their tests."""

from __future__ import annotations

import signal

RULE, SECTION = "=" * 60, "-" * 60


def report_block(rank: int, exitcode: int, *, local_rank: int, detail: str = "<N/A>") -> list[str]:
    """The report's lines from its top rule to its closing one: the root cause global ``rank`` (local
    ``local_rank``) that ended with ``exitcode`` (negative: killed by that signal), ``detail`` its
    traceback field."""
    signal_name = f"  ({signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    return [
        RULE,
        "sftjob_trainer.train FAILED",
        SECTION,
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        SECTION,
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-05-01_12:00:00",
        "  host      : llama-sft-1-0",
        f"  rank      : {rank} (local_rank: {local_rank})",
        f"  exitcode  : {exitcode} (pid: {40 + local_rank}){signal_name}",
        "  error_file: <N/A>",
        f"  traceback : {detail}",
        RULE,
    ]
