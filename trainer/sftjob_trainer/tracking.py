"""How the experiment trackers a job asks for (``spec.tracking``) are used: started, fed, dropped, finished.

Why it exists: the metrics endpoint and ``train_log.jsonl`` are the cluster's view of one attempt; people
compare runs, and look at a job across its restarts, in the trackers they already use. Rank 0's
:class:`~sftjob_trainer.observer.Observer` feeds :class:`Trackers` what it reports anyway: the logging
steps' loss, learning rate, gradient norm, throughput, MFU, epoch and tokens, every evaluation's loss, and
each attempt's plan at its first step (an OOM re-plan between attempts shows on the charts).

The trackers themselves (TensorBoard, MLflow, W&B) are :mod:`sftjob_trainer.trackers`'s; the rules every
tracker is held to are here:

- **It never stops training.** Whatever it raises (import, start, log, finish) is logged as a warning
  naming it and counted in ``sftjob_train_tracking_errors_total{tracker}``. A tracker that fails to start,
  or to log :data:`MAX_LOG_FAILURES` times in a row (a transient error in a days-long attempt does not
  drop it), is dropped for the rest of the attempt: ``sftjob_train_tracking_active{tracker}`` goes from
  1 to 0. Every tracker that started is finished, dropped or not: its MLflow run is ended all the same.
- **It holds up the loop as little as it can.** W&B's service process writes in the background; MLflow
  logs asynchronously, with short HTTP timeouts and few retries unless the pod's environment says
  otherwise, and a failed batch is noticed at a later logging step. TensorBoard's writer writes in a
  thread too, but its queue is bounded: a checkpoint volume that hangs blocks ``add_scalar`` (as it hangs
  the saves). Starting and finishing are bounded. Starting runs under ``heartbeat.busy``, so the progress
  reports go on meanwhile; finishing comes last, after the attempt's termination message and its last
  progress report, which a rank stopped by torchrun (30 s) must not lose to a slow tracking server.
- **No telemetry to third parties**: MLflow's usage telemetry and W&B's error reporting are off unless the
  pod's environment turns them on.
- **A job is one run across its attempts**, in each tracker (:mod:`sftjob_trainer.trackers`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.failures import one_line
from sftjob_trainer.metrics import TrainerMetrics
from sftjob_trainer.trackers import FINISH_SECONDS, Outcome, Tracker, configured

log = logging.getLogger("sftjob_trainer")

# How long starting the trackers reports progress (``heartbeat.busy``) at most: an MLflow server that is
# down fails its first request in under a minute with MLFLOW_HTTP_DEFAULTS, and W&B gives up after its
# init timeout. (Each tracker's finish is given up on after FINISH_SECONDS.)
BUSY_SECONDS: Final = 300.0
# A preempted attempt finishes its trackers after its checkpoint, its termination message and its last
# progress report, inside the pod's grace period, and its exit code comes after them: each gets only a
# few seconds then.
PREEMPTED_FINISH_SECONDS: Final = 5.0
# A tracker failing to log this many times in a row is dropped for the rest of the attempt; a log that
# works in between starts the count again (an MLflow server restarted in a days-long attempt).
MAX_LOG_FAILURES: Final = 3


def outcome_of(error: BaseException | None) -> Outcome:
    """How the attempt ended, from what ended it (None: it completed)."""
    if error is None:
        return "finished"
    preempted = isinstance(error, TrainerError) and error.code == ExitCode.PREEMPTED
    return "killed" if preempted or isinstance(error, KeyboardInterrupt) else "failed"


def attempt_values(config: TrainerConfig) -> dict[str, float]:
    """What this attempt runs with, logged at its first step: the attempt and the plan it trains with."""
    t = config.training
    return {
        "attempt": config.job.attempt,
        "plan/micro_batch_size": t.micro_batch_size,
        "plan/gradient_accumulation_steps": t.gradient_accumulation_steps,
        "plan/gradient_checkpointing": int(t.gradient_checkpointing),
    }


class Trackers:
    """Every configured tracker (rank 0): started once, fed finite values, finished once. One that fails is
    warned about and counted; one that fails to start, or to log ``MAX_LOG_FAILURES`` times in a row, is
    dropped, and the others go on."""

    def __init__(
        self, config: TrainerConfig, metrics: TrainerMetrics, trackers: list[Tracker] | None = None
    ) -> None:
        self.config, self.metrics = config, metrics
        self._waiting = configured(config) if trackers is None else trackers
        self._started: list[Tracker] = []  # each is finished, dropped or not
        self._live: list[Tracker] = []  # started and not dropped: logged to
        self._failures: dict[int, int] = {}  # failed logs in a row, by id of the tracker
        for tracker in self._waiting:
            metrics.tracking_errors(tracker.name)  # exported at 0: its first error is an increase

    def __bool__(self) -> bool:
        return bool(self._waiting or self._started)

    @property
    def live(self) -> list[str]:
        """The names of the trackers started and not dropped."""
        return [tracker.name for tracker in self._live]

    @property
    def started(self) -> list[str]:
        """The names of the trackers started, dropped since or not: the ones :meth:`finish` ends."""
        return [tracker.name for tracker in self._started]

    @property
    def urls(self) -> dict[str, str]:
        """The pages of the live trackers' runs, by tracker (for the progress reports)."""
        return {tracker.name: tracker.url for tracker in self._live if tracker.url}

    def start(self, step: int, stopping: Callable[[], bool] = lambda: False) -> None:
        """Start each tracker for an attempt that goes on from ``step`` (0: from the start), then log the
        attempt's plan at its first step; none is started once ``stopping()`` (a SIGTERM: the grace period
        is for the checkpoint and the exit code)."""
        waiting, self._waiting = self._waiting, []
        for tracker in waiting:
            if stopping():
                log.info("SIGTERM received: experiment tracker %s not started", tracker.name)
                continue
            error = self._call(tracker, tracker.start, step + 1)
            self.metrics.tracking_active(tracker.name).set(1 if error is None else 0)
            if error is not None:
                self._warn(tracker, "start, dropped for the rest of this attempt (training goes on)", error)
                continue
            self._started.append(tracker)
            self._live.append(tracker)
        if self._live:
            log.info("experiment trackers: %s", ", ".join(self.live))
            self.log(step + 1, attempt_values(self.config))

    def log(self, step: int, values: Mapping[str, float | int | None]) -> None:
        """``values`` at ``step``; a missing or non-finite one (a NaN loss) is left out."""
        finite = {key: float(v) for key, v in values.items() if v is not None and math.isfinite(v)}
        if not finite:
            return
        for tracker in list(self._live):
            try:
                works = tracker.log(step, finite)
            except Exception as exc:  # whatever a tracker raises: never into training
                self._log_failed(tracker, exc)
            else:
                if works:  # a failure from now on starts a new count
                    self._failures[id(tracker)] = 0

    def _log_failed(self, tracker: Tracker, error: Exception) -> None:
        """Count and warn; the ``MAX_LOG_FAILURES``-th failure in a row drops the tracker."""
        self.metrics.tracking_errors(tracker.name).inc()
        failures = self._failures[id(tracker)] = self._failures.get(id(tracker), 0) + 1
        if failures < MAX_LOG_FAILURES:
            self._warn(
                tracker, f"log ({failures} in a row, dropped at {MAX_LOG_FAILURES}; training goes on)", error
            )
            return
        what = f"log {failures} times in a row, dropped for the rest of this attempt (training goes on)"
        self._warn(tracker, what, error)
        self._live.remove(tracker)
        self.metrics.tracking_active(tracker.name).set(0)

    def finish(self, outcome: Outcome, *, hurry: bool = False) -> None:
        """End each started tracker's part of the run, dropped or not, each given up on after a bounded wait:
        shorter for a preempted attempt or one that got SIGTERM (``hurry``), inside its grace period. The
        ``sftjob_train_tracking_active`` gauge is left as it is: the pod ends."""
        started, self._started, self._live, self._waiting = self._started, [], [], []
        seconds = PREEMPTED_FINISH_SECONDS if hurry or outcome == "killed" else FINISH_SECONDS
        for tracker in started:

            def end(tracker: Tracker = tracker) -> None:
                tracker.finish(outcome)

            error = self._call(tracker, within, seconds, f"finishing {tracker.name}", end)
            if error is not None:
                self._warn(tracker, "finish", error)

    def _call(self, tracker: Tracker, call: Callable[..., None], *args: Any) -> Exception | None:
        """``call(*args)``: None when it worked, else what it raised, counted in the tracker's errors."""
        try:
            call(*args)
            return None
        except Exception as exc:  # whatever a tracker raises: never into training
            self.metrics.tracking_errors(tracker.name).inc()
            return exc

    def _warn(self, tracker: Tracker, what: str, error: Exception) -> None:
        """One warning per failure: ``experiment tracker NAME failed to WHAT: ERROR``."""
        log.warning(
            "experiment tracker %s failed to %s: %s",
            tracker.name,
            what,
            one_line(f"{type(error).__name__}: {error}"),
        )


def within(seconds: float, doing: str, call: Callable[[], None]) -> None:
    """``call()`` in a thread, waited for at most ``seconds``: raises what it raised, or TimeoutError (the
    thread, a daemon, is left to end on its own)."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=doing, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"{doing} took more than {seconds:.0f}s: given up")
    if failure:
        raise failure[0]
