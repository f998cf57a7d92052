"""Rank 0's view of a run: the human log line, the metrics, the train log, the progress reports and the
experiment trackers (``spec.tracking``: TensorBoard, MLflow, W&B; tracking.py).

Everything here is fed once per optimizer step by the loop in train.py, plus once per setup phase
(data, model, resume) before the first step; the metrics it writes are served from the start of the
attempt (``start_metrics``), before this Observer exists. A report goes out at every
``logging_every_steps`` step and also at any step that ends ``PROGRESS_REPORT_INTERVAL_SECONDS`` after
the previous report, so slow steps never look stalled to the operator. Rates (tokens/s, MFU) are over
the steps of the window since the previous report and the waits for their batches: what the steps
compute. The ETA and the checkpoint interval count the rest of the loop too (evaluations, saves), spread
over this attempt's steps: a run that evaluates for a minute every 50 two-second steps takes 3.2 s a
step, not 2. Reports are sent from the training thread on purpose: a hung rank goes silent and the
operator's stall detection (``restartPolicy.stallTimeoutSeconds``) ends the attempt; only a long save or
load is reported from a thread while it runs (heartbeat.py, bounded), and so is the trackers' start (their
finish comes after the last report). The trackers get what the train log gets, at the same steps, plus
each attempt's plan at its first step; one that fails is dropped, never raised into training.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sftjob.config import TrainerConfig
from sftjob.constants import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX, PROGRESS_REPORT_INTERVAL_SECONDS
from sftjob_trainer import strict_json
from sftjob_trainer.batching import Schedule
from sftjob_trainer.checkpoints import TrainState
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.flops import mfu
from sftjob_trainer.loop import StepResult
from sftjob_trainer.metrics import Phase, TrainerMetrics, WindowRates, checkpoint_interval
from sftjob_trainer.report import ProgressReporter
from sftjob_trainer.stopping import GracefulStop
from sftjob_trainer.tracking import BUSY_SECONDS, Outcome, Trackers, outcome_of

log = logging.getLogger("sftjob_trainer")

TRAIN_LOG_FILE = "train_log.jsonl"  # one JSON line per reported step (rank 0), appended across attempts


class Observer:
    """Rank 0's view of the run: the log line, the metrics, the train log, the progress reports and the
    experiment trackers (started by :meth:`start_tracking`, finished by :meth:`close`)."""

    def __init__(
        self,
        config: TrainerConfig,
        ctx: DistContext,
        metrics: TrainerMetrics,
        peak: float | None,
        total: int | None,
        schedule: Schedule,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``total`` and ``schedule``: the steps and the data order of the course the attempt is expected to
        follow (``data_order.expected_course``); ``total`` None while that is not known, until
        :meth:`follow`."""
        self.ctx, self.metrics, self.peak, self.schedule = ctx, metrics, peak, schedule
        self.total = 0 if total is None else total
        self.known = total is not None  # whether the total and the epoch are known, to be reported
        self.clock = clock
        self.every = config.training.logging_every_steps
        self.checkpoints = config.checkpoints
        # The best checkpoint is reported only where the rotation spares it (finalModel Best): under Last
        # it is removed like any other, and the report would name a folder that is gone.
        self.best_kept = config.evaluation is not None and config.evaluation.final_model == "Best"
        if self.known:
            self.metrics.total_steps.set(self.total)
        self.reporter = ProgressReporter(config.report)
        self.train_log = Path(config.output_dir) / TRAIN_LOG_FILE
        self.trackers = Trackers(config, metrics)
        self._window: list[tuple[StepResult, float, float]] = []  # (result, wall seconds, flops)
        self._reported = clock()  # when the last progress report was sent
        self._started = clock()  # this attempt's loop (training_started): its steps, waits and the rest
        self._steps, self._stepping = 0, 0.0  # steps of this attempt, their seconds with their waits
        self._eval: dict[str, Any] = {}  # the last evaluation, in every report from then on
        self._links: dict[str, Any] = {}  # the trackers' run pages, in every report once they started
        self._last: dict[str, Any] = {}  # the last report, sent again with a new evaluation

    def follow(self, schedule: Schedule, total: int) -> None:
        """The course this attempt follows once resumed (a changed data layout ends it at another step)."""
        self.schedule, self.total, self.known = schedule, total, True
        self.metrics.total_steps.set(total)

    def phase(self, name: str, step: int, loss: float | None = None, *, then: Phase | None = None) -> None:
        """A setup phase is done: report it, so the stall clock restarts after a long download or load
        instead of running from container start to the first logging step; the metrics show the step
        the attempt will resume from and the phase it goes on with (``then``); the total and the epoch
        only once they are known (:attr:`known`)."""
        log.info("%s (step %d of %s)", name, step, self.total if self.known else "?")
        self.metrics.step.set(step)
        if then is not None:
            self.metrics.enter(then)
        record: dict[str, Any] = {"step": step}
        if self.known:
            epoch = self.schedule.epoch_of(step)
            self.metrics.epoch.set(epoch)
            record |= {"totalSteps": self.total, "epoch": round(epoch, 4)}
        record["phase"] = name
        if loss is not None:
            self.metrics.loss.set(loss)
            record["loss"] = loss
        self._progress(record)

    def stopped_early(self, state: TrainState) -> None:
        """Early stopping ended training at ``state.step``: that is the run's total from now on (the
        progress reads complete and no alert takes the output's writing for a stall), and the report
        says what the run was planned for (``plannedSteps``)."""
        planned = self.total
        self.follow(self.schedule, state.step)
        log.info(
            "stopped early at step %d of %d planned: %d evaluations without improvement on %.4f",
            state.step,
            planned,
            state.evals_without_improvement,
            state.lowest_eval_loss or math.nan,
        )
        record = {
            "step": state.step,
            "totalSteps": state.step,
            "plannedSteps": planned,
            "phase": "stopped early",
        }
        self._progress(record | ({"loss": state.loss} if state.loss is not None else {}))

    def start_tracking(self, step: int, stop: GracefulStop | None = None) -> None:
        """Start the experiment trackers for an attempt that goes on from ``step``, reporting progress
        meanwhile (a tracking server that is slow to answer); none once ``stop`` got a SIGTERM, which ends
        the attempt at its next check (its grace period is for the checkpoint and the exit code)."""
        if not self.trackers:
            return
        from sftjob_trainer import heartbeat  # heartbeat imports this module

        with heartbeat.busy(self, "starting the experiment trackers", BUSY_SECONDS):
            self.trackers.start(step, lambda: stop is not None and stop.requested)
        urls = self.trackers.urls
        self._links = {"trackingUrls": urls} if urls else {}

    def training_started(self) -> None:
        """The training loop starts: the CheckpointTooOld and TrainingStalled alerts count from now."""
        self.metrics.training_started()
        self._started = self.clock()

    def _progress(self, record: dict[str, Any]) -> None:
        self._last = record
        self.reporter.progress(record | self._eval | self._links)
        self._reported = self.clock()

    def _due(self, step: int, seconds: float) -> bool:
        """A logging step, the last step, or a step after which the next (as long as this one, ``seconds``)
        would end more than an interval after the last report: reports are never further apart than the
        interval plus one step, so only a step longer than the stall timeout's remainder looks stalled."""
        overdue = self.clock() - self._reported + seconds >= PROGRESS_REPORT_INTERVAL_SECONDS
        return step % self.every == 0 or step == self.total or overdue

    def step(self, state: TrainState, result: StepResult, seconds: float, waited: float, flops: Any) -> None:
        """An optimizer step of ``seconds`` after ``waited`` seconds for its batch: rates over both together,
        the ETA and the step-based checkpoint interval over :meth:`_seconds_per_step`."""
        wall = seconds + waited
        self._steps += 1
        self._stepping += wall
        epoch = self.schedule.epoch_of(state.step)
        self.metrics.record_step(
            step=state.step,
            epoch=epoch,
            loss=result.loss,
            learning_rate=result.learning_rate,
            grad_norm=result.grad_norm,
            tokens=result.tokens,
            samples=result.samples,
            seconds=seconds,
            dataloader_wait=waited,
        )
        self._window.append((result, wall, flops.step_flops(result.tokens, result.attention_pairs)))
        if not self._due(state.step, wall):
            return
        elapsed = sum(s for _, s, _ in self._window) or 1e-9
        rates = WindowRates(
            sum(r.tokens for r, _, _ in self._window) / elapsed,
            sum(r.samples for r, _, _ in self._window) / elapsed,
            mfu(sum(f for _, _, f in self._window) / elapsed, self.peak),
        )
        per_step = self._seconds_per_step(elapsed / len(self._window))
        eta = (self.total - state.step) * per_step
        self._window.clear()
        self.metrics.record_window(rates, self.ctx.device, eta)
        self.metrics.checkpoint_interval.set(checkpoint_interval(self.checkpoints, per_step))
        log.info(
            "step %d/%d (epoch %.2f) | loss %.4f | lr %.2e | grad norm %.3f | %s tokens/s | MFU %.1f%%"
            " | ETA %s",
            state.step,
            self.total,
            epoch,
            result.loss,
            result.learning_rate,
            result.grad_norm,
            f"{rates.tokens_per_second:,.0f}",
            rates.mfu * 100,
            timedelta(seconds=round(eta)),
        )
        record = {
            "step": state.step,
            "totalSteps": self.total,
            "epoch": round(epoch, 4),
            "loss": result.loss,
            "learningRate": result.learning_rate,
            "tokensPerSecond": round(rates.tokens_per_second, 1),
            "etaSeconds": round(eta, 1),
        }
        self._progress(record)
        with self.train_log.open("a", encoding="utf-8") as fh:
            line = record | {"gradNorm": result.grad_norm, "tokens": state.tokens}
            fh.write(strict_json.dumps(line) + "\n")
        tracked = {
            "train/loss": result.loss,
            "train/learning_rate": result.learning_rate,
            "train/grad_norm": result.grad_norm,
            "train/tokens_per_second": rates.tokens_per_second,
            "train/mfu": rates.mfu,
            "train/epoch": epoch,
            "train/tokens": state.tokens,
        }
        self.trackers.log(state.step, tracked)

    def _seconds_per_step(self, stepping: float) -> float:
        """The loop's time a step: ``stepping`` (a step and the wait for its batch, as in the last window)
        plus the rest of the loop (evaluations, saves, anything but steps and waits) this attempt so far,
        spread over its steps."""
        rest = max(0.0, self.clock() - self._started - self._stepping)
        return stepping + rest / max(1, self._steps)

    def evaluating(self) -> None:
        self.metrics.enter(Phase.EVALUATING)

    def still_evaluating(self) -> None:
        """A batch of the evaluation is done: the last report again once an interval has passed since it,
        so the operator's stall clock sees a long evaluation progress (the TrainingStalled alert reads
        the phase, ``evaluating``, instead)."""
        if self.clock() - self._reported >= PROGRESS_REPORT_INTERVAL_SECONDS and self._last:
            self._progress(self._last)

    def still_busy(self, doing: str) -> None:
        """A long save or load is under way (``doing``; called from ``heartbeat.busy``'s thread while the
        training thread is in it): the last report again, its ``phase`` saying what is going on, so the
        operator's stall clock sees it progress."""
        self.reporter.progress(self._last | self._eval | self._links | {"phase": doing})
        self._reported = self.clock()

    def evaluated(self, state: TrainState, seconds: float, *, stopped: bool = False) -> None:
        """An evaluation at ``state.step`` ended: its loss goes into the metrics, the train log and every
        progress report from now on; one a SIGTERM ``stopped`` leaves the last evaluation's."""
        self.metrics.enter(Phase.TRAINING)
        if stopped:
            log.info("step %d: evaluation stopped by SIGTERM after %.1fs", state.step, seconds)
            return
        assert state.eval_loss is not None and state.eval_step is not None
        self.metrics.record_eval(state.eval_step, state.eval_loss, seconds)
        log.info("step %d: eval loss %.4f (%.1fs)", state.eval_step, state.eval_loss, seconds)
        self._remember_eval(state)
        self._progress(self._last or {"step": state.step, "totalSteps": self.total})
        with self.train_log.open("a", encoding="utf-8") as fh:
            line = {"step": state.step, "evalLoss": state.eval_loss, "evalSeconds": round(seconds, 3)}
            fh.write(strict_json.dumps(line) + "\n")
        self.trackers.log(state.eval_step, {"eval/loss": state.eval_loss})

    def _remember_eval(self, state: TrainState) -> None:
        if state.eval_loss is not None and math.isfinite(state.eval_loss):
            self._eval = {"evalLoss": state.eval_loss, "evalStep": state.eval_step}

    def checkpoint_saved(self, state: TrainState, path: str, seconds: float) -> None:
        self.metrics.record_checkpoint(state.step, seconds)
        self.reporter.checkpoint(
            state.step, path, eval_loss=_eval_at(state, state.step), best=self._best(state, path)
        )

    def resumed_from(self, state: TrainState, path: Path) -> None:
        """The checkpoint this run resumed from, as old as it is (its completion marker's time): not a
        save of this run, so the save-duration histogram is left alone."""
        saved_at = (path / CHECKPOINT_COMPLETE_MARKER).stat().st_mtime
        step = state.step
        self.metrics.record_checkpoint(step, None, saved_at)
        self.metrics.step.set(step)
        self.metrics.epoch.set(self.schedule.epoch_of(step))
        self._remember_eval(state)
        if state.eval_loss is not None and state.eval_step is not None:
            self.metrics.record_eval(state.eval_step, state.eval_loss, None)
        self.reporter.checkpoint(
            step, str(path), saved_at, eval_loss=_eval_at(state, step), best=self._best(state, str(path))
        )

    def _best(self, state: TrainState, newest: str) -> dict[str, Any] | None:
        """The best checkpoint for the report, when the rotation keeps it (:attr:`best_kept`)."""
        return _best(state, newest) if self.best_kept else None

    def close(self, error: BaseException | None = None, *, sigterm: bool = False) -> None:
        """The attempt ends, ``error`` what ended it (None: it completed), its termination message written
        (``train.run``): the progress reports stop, the last one sent, then the trackers that started,
        dropped or not, finish its part of the run, each within its bound (tracking.py). In that order:
        after a peer rank failed, torchrun gives this rank a fixed 30 s to exit, which the trackers alone
        may take. The metrics endpoint belongs to the whole attempt (``run``). The run is finished, failed,
        or killed when preempted; an attempt that got a SIGTERM (``sigterm``) is killed whatever error
        ended it (a collective a peer's shutdown broke) and finishes its trackers in the preempted time,
        inside its grace period; one that completed all the same is finished, in that time too."""
        self.reporter.close()
        if self.trackers.started:
            outcome: Outcome = "killed" if sigterm and error is not None else outcome_of(error)
            self.trackers.finish(outcome, hurry=sigterm)


def _eval_at(state: TrainState, step: int) -> float | None:
    """The evaluation of the weights saved at ``step``, if there was one."""
    return state.eval_loss if state.eval_step == step else None


def _best(state: TrainState, newest: str) -> dict[str, Any] | None:
    """The saved checkpoint with the lowest evaluation loss, beside the newest one (``newest``)."""
    if state.best_step is None or state.best_eval_loss is None:
        return None
    path = Path(newest).parent / f"{CHECKPOINT_PREFIX}{state.best_step}"
    return {"step": state.best_step, "path": str(path), "evalLoss": state.best_eval_loss}
