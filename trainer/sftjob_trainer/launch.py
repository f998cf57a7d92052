"""The trainer container's PID 1: it runs torchrun and writes the termination message of a killed rank.

A rank that fails with an exception writes its own tagged message (:mod:`sftjob_trainer.failures`). A rank
killed by a signal (the NCCL watchdog's SIGABRT on a collective that timed out, a segfault, the kernel OOM
killer's SIGKILL) writes nothing, and the kubelet's fallback, the log's last 2048 bytes, is then torchrun's
own traceback and report, without the rank's words. Worse, in a pod of several GPUs torchrun SIGTERMs the
other local ranks, and one of them writes the SIGTERM code (``[exit 20]``), which the operator reads as a
pod stopped though nothing asked it to. So this launcher runs the torchrun command it is given (the pod's
command: ``python -m sftjob_trainer.launch torchrun --tee=2 ... -m sftjob_trainer.train``), echoes its
stderr unchanged while keeping each local rank's last lines (``--tee=2`` puts ``[default<local rank>]:``
before them) and torchrun's report, and when torchrun fails, nothing asked the pod to stop and no rank
wrote a message of its own (or only that SIGTERM echo), writes the report's root cause with its last words,
untagged: ``rank 1 killed by SIGABRT: ... Watchdog caught collective operation timeout: WorkNCCL(...)``. The
operator classes such a message by its words (``sftjob_operator.termination``), as it would a log tail.

As PID 1 it must pass SIGTERM and SIGINT on itself (a PID 1 has no default action for them), and it exits
with torchrun's code (128 + N when torchrun was killed by signal N). It imports no torch: it starts at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from types import FrameType
from typing import IO

from sftjob.failures import ExitCode, read_exit_tag
from sftjob.torchrun_report import CPP_BACKTRACE, RootCause, last_words, read_report, summarize, worker_line
from sftjob_trainer.failures import EXITING, termination_log_path, write_termination_message

# Enough of a rank's last lines (C++ backtrace frames never kept) to find its last words past blank lines and
# rules, and enough of torchrun's own to hold its whole report (some 8 lines per failed local rank).
RANK_LINES = 16
TORCHRUN_LINES = 400
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A process killed by signal N ends with 128 + N, as a shell (and the kubelet) reports it.
SIGNALLED_BASE = 128


class StderrTail:
    """The last lines of torchrun's stderr: each local rank's (by its tee prefix) and torchrun's own."""

    def __init__(self) -> None:
        self.ranks: dict[int, deque[str]] = {}
        self.torchrun: deque[str] = deque(maxlen=TORCHRUN_LINES)
        self.wrote_own: set[int] = set()  # the local ranks that logged ending with a message of their own

    def add(self, line: str) -> None:
        line = line.rstrip("\r\n")
        worker = worker_line(line)
        if worker is None:
            self.torchrun.append(line)
            return
        local_rank, said = worker
        if EXITING in said:
            self.wrote_own.add(local_rank)
        if not CPP_BACKTRACE.match(said.strip()):
            self.ranks.setdefault(local_rank, deque(maxlen=RANK_LINES)).append(said)

    def root_cause(self) -> RootCause | None:
        report = read_report(list(self.torchrun))
        return report.root_cause if report is not None else None

    def last_words(self, local_rank: int | None) -> str:
        return last_words(self.ranks.get(local_rank, ())) if local_rank is not None else ""


class Launcher:
    """Runs one torchrun command and passes the signals that ask the pod to stop on to it."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None  # the signal that asked the pod to stop, once one did
        self.tail = StderrTail()

    def run(self) -> int:
        """Run the command to its end; its exit code, 128 + N when it was killed by signal N."""
        started = time.time()
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self._forward)
        try:
            self.child = subprocess.Popen(self.command, stderr=subprocess.PIPE)
        except OSError as exc:  # no torchrun in the image, or one built for another CPU
            write_termination_message(
                f"the image cannot run {self.command[0]} ({exc}): use an image built from the trainer image,"
                " which has torchrun and the sftjob_trainer package, for the nodes' CPU architecture",
                ExitCode.CONFIG_ERROR,
            )
            return ExitCode.CONFIG_ERROR
        if self.stop_signal is not None:  # asked to stop before torchrun was there to hear it
            self.child.send_signal(self.stop_signal)
        assert self.child.stderr is not None
        self._echo(self.child.stderr)
        returncode = self.child.wait()
        if returncode != 0 and self.stop_signal is None:
            self._write_root_cause(started)
        return SIGNALLED_BASE - returncode if returncode < 0 else returncode

    def _forward(self, signum: int, _frame: FrameType | None) -> None:
        self.stop_signal = signum
        if self.child is not None:
            self.child.send_signal(signum)

    def _echo(self, stderr: IO[bytes]) -> None:
        out = sys.stderr.buffer
        for raw in stderr:
            out.write(raw)
            out.flush()
            self.tail.add(raw.decode(errors="replace"))

    def _write_root_cause(self, started: float) -> None:
        """Write the report's root cause as the termination message when no rank wrote one of its own since
        the launch ``started`` (a ``time.time()``), or only a peer's echo: the SIGTERM code of a peer torchrun
        stopped, or, when the root cause was killed by a signal, a peer's broken collective."""
        cause = self.tail.root_cause()
        if cause is None or not cause.exitcode:
            return  # no report: torchrun failed on its own (a rendezvous), and its log says how
        written = _message_since(termination_log_path(), started)
        if written is not None:
            code, _ = read_exit_tag(written)
            # A peer's broken collective, when the root cause (killed by a signal) wrote no word of its own.
            silent = cause.exitcode < 0 and cause.local_rank not in self.tail.wrote_own
            echo = code == ExitCode.PREEMPTED or (code == ExitCode.COMMUNICATION_ERROR and silent)
            if not echo or cause.exitcode == ExitCode.PREEMPTED:
                return  # a rank's own reason (the root cause's SIGTERM code too, when it stopped first)
        write_termination_message(summarize(cause, self.tail.last_words(cause.local_rank)))


def _message_since(path: str, since: float) -> str | None:
    """The termination message written at ``path`` since ``since`` (a ``time.time()``), or None."""
    try:
        if os.stat(path).st_mtime < since:
            return None
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read() or None
    except OSError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m sftjob_trainer.launch torchrun [torchrun's arguments]", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    return Launcher(command).run()


if __name__ == "__main__":
    sys.exit(main())
