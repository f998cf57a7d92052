"""How the trainer stops when asked: SIGTERM (pod deletion, preemption, a suspend) sets a flag the loop
reads between steps, so the step finishes, a checkpoint is saved and the exit code says PREEMPTED.
torchrun forwards the signal to the whole process group, DataLoader workers included, which must
outlive it until the trainer stops them."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from sftjob.failures import ExitCode, TrainerError

log = logging.getLogger("sftjob_trainer")


class GracefulStop:
    """SIGTERM sets a flag; the loop finishes its step, saves a checkpoint and exits PREEMPTED."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def during_setup(self, where: str) -> None:
        """SIGTERM during setup (a long download, tokenization or load): stop at the next phase with
        nothing to save, well inside the grace period, instead of being killed at its end."""
        if self.requested:
            raise TrainerError(ExitCode.PREEMPTED, f"preempted (SIGTERM) {where}: no checkpoint to save")

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.requested:
            log.warning("SIGTERM received: finishing the current step, then saving a checkpoint")
        self.requested = True


def ignore_sigterm(_worker: int) -> None:
    """DataLoader workers are in the trainer's process group, which torchrun signals as a whole: a worker
    dying of SIGTERM would end the step with an error instead of a checkpoint. They keep serving batches
    until the trainer, which handles the signal, finishes its step and stops them."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
