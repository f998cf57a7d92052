"""The trainer's entry point: config, preflight, data, model, loop, checkpoint, output.

Read top to bottom like nanoGPT's train.py. ``run`` is the whole life of one attempt and returns the
exit code the operator will read (ExitCode, with a one-line reason in the termination log); ``main``
is the console script ``sftjob-trainer``, run by torchrun or directly for one process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from sftjob.config import TrainerConfig
from sftjob.constants import CONFIG_ENV, CONFIG_FILE, CONFIG_MOUNT
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer import (
    base_commit,
    checkpoints,
    data_order,
    heartbeat,
    merging,
    output,
    remote_code,
    resume,
    selection,
)
from sftjob_trainer.attention import FLATTENED
from sftjob_trainer.batching import Layout, Schedule, StepBatches, Unit, make_units, trim_heap
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.configs import config_for_device, load_config
from sftjob_trainer.data import load_examples
from sftjob_trainer.distributed import DistContext, init_distributed, loads_on_rank0, shards, wrap_model
from sftjob_trainer.evaluation import EvalSet, eval_set, evaluate, held_out
from sftjob_trainer.failures import exit_with, write_termination_message
from sftjob_trainer.flops import flops_model, peak_flops
from sftjob_trainer.loop import (
    NonFiniteSteps,
    build_optimizer,
    build_scheduler,
    make_scaler,
    train_step,
)
from sftjob_trainer.metrics import Phase, TrainerMetrics, start_metrics
from sftjob_trainer.model import (
    build_model,
    check_positions,
    count_parameters,
    load_model,
    load_model_config,
    load_tokenizer,
    precision_plan,
    prepare_for_training,
    resolve_attention,
    resolve_model_class,
)
from sftjob_trainer.observer import Observer
from sftjob_trainer.preflight import run_preflight
from sftjob_trainer.same_data import DataCounts, check_same_data
from sftjob_trainer.selection import stops_early
from sftjob_trainer.stopping import GracefulStop, ignore_sigterm

log = logging.getLogger("sftjob_trainer")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(int(run(os.environ.get(CONFIG_ENV, f"{CONFIG_MOUNT}/{CONFIG_FILE}"))))


def run(config_path: str) -> ExitCode:
    """One attempt, start to finish; never raises."""
    started = time.time()
    stop = GracefulStop()
    stop.install()
    ctx: DistContext | None = None
    metrics: TrainerMetrics | None = None
    training: Training | None = None
    error: BaseException | None = None  # what ended the attempt; None: it completed
    try:
        config_path = config_for_device(config_path)
        config = load_config(config_path)
        # Rank 0's metrics endpoint is up before the rendezvous and the loads: a scraped pod never
        # refuses its metrics port, and sftjob_train_phase shows what the attempt is doing.
        metrics = start_metrics(config)
        ctx = init_distributed(config)
        if not ctx.is_main:
            logging.getLogger().setLevel(logging.WARNING)
        if ctx.is_main:
            log.info("effective configuration (%s):\n%s", config_path, config.to_json())
        training = Training(config, ctx, stop, metrics)
        summary = training.run()
        loss = summary["finalLoss"]  # None when no step had a finite one
        write_termination_message(
            f"completed {summary['steps']} steps, final loss {'n/a' if loss is None else f'{loss:.4f}'},"
            f" {summary['tokensPerSecond']:,.0f} tokens/s"
        )
        return ExitCode.OK
    except BaseException as exc:
        error = exc
        return exit_with(exc, started, several_ranks=ctx is not None and ctx.active, sigterm=stop.requested)
    finally:
        # The termination message is written: now the last progress report, then the trackers. After a
        # peer rank failed, torchrun gives this one a fixed 30 s to exit, which the trackers' finish
        # alone may take.
        if training is not None:
            training.close(error)
        stop.uninstall()
        if metrics is not None:
            metrics.close()
        if ctx is not None:
            ctx.close()


class Training:
    def __init__(
        self, config: TrainerConfig, ctx: DistContext, stop: GracefulStop, metrics: TrainerMetrics | None
    ) -> None:
        self.config, self.ctx, self.stop, self.metrics = config, ctx, stop, metrics  # metrics: rank 0 only
        self.spec = config  # the job's, its hub model not pinned to a commit: what names the training
        self.t = config.training
        self.io_seconds = heartbeat.BUSY_BASE_SECONDS  # how long a save or load reports: set with the model
        self.own_loss = False  # the trainer computes the loss, not the model (remote_code.py): set with it
        self.observer: Observer | None = None  # rank 0's, once the data is loaded

    def close(self, error: BaseException | None) -> None:
        """The attempt ended (``error``: what ended it, None when it completed) and its termination message
        is written: rank 0 sends its last progress report and finishes its experiment trackers
        (:meth:`Observer.close`); never raises."""
        if self.observer is None:
            return
        try:
            self.observer.close(error, sigterm=self.stop.requested)
        except Exception as exc:  # best effort, like the reports and the trackers themselves
            log.warning("could not close the progress reports and the experiment trackers: %s", exc)

    def run(self) -> dict[str, Any]:
        config, ctx, t = self.config, self.ctx, self.t
        run_preflight(config)
        from transformers import set_seed

        set_seed(t.seed)
        torch.set_float32_matmul_precision("high" if t.tf32 else "highest")

        # Data: every rank tokenizes the same rows the same way; the schedule picks its share.
        if self.metrics is not None:
            self.metrics.enter(Phase.LOADING_DATA)
        # A hub model loads at one commit, the one its checkpoints were trained on (base_commit.py).
        config = self.config = base_commit.pin(config, ctx)
        with heartbeat.downloads(config, Phase.LOADING_DATA, self.metrics):
            tokenizer = load_tokenizer(config.model)
            model_config = load_model_config(config.model)  # before the data: a bad model fails in seconds
            model_class, packing = resolve_model_class(model_config, t.packing, config.model)
            if packing != t.packing:  # packed examples of this model would attend to each other
                t = self.t = t.model_copy(update={"packing": False, "packing_length": None})
                config = self.config = config.model_copy(update={"training": t})
            packing_length = (t.packing_length or config.dataset.max_seq_length) if t.packing else None
            examples, stats, fmt = load_examples(config.dataset, tokenizer, packing_length)
            examples, held = held_out(config, examples, stats.rows, fmt, tokenizer, packing_length)
        units = make_units(examples, packing_length)
        del examples  # the units hold the tokens now; every rank (and its workers) would keep both
        trim_heap()  # the examples' freed arrays would otherwise stay resident in the heap
        self.stop.during_setup("after loading the data")  # a peer that failed already: torchrun stops us
        check_same_data(ctx, DataCounts.of(stats.rows, units, held), config.dataset)  # else a hang
        schedule = Schedule(
            len(units), t.micro_batch_size, t.gradient_accumulation_steps, ctx.world_size, t.seed
        )
        schedule.validate()
        planned = schedule.total_steps(t.epochs, t.max_steps)  # a resume may change it (data_order.follow)
        longest = max([n for unit in units for n in unit.lengths] + [len(e.input_ids) for e in held])
        check_positions(model_config, longest)
        attention = resolve_attention(t.attention, ctx.device, t.packing, model_config, longest, model_class)
        # A tokenizer with no pad, EOS or unknown token: padding is masked out and ignored by the loss anyway.
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        layout = Layout(t.packing, flatten=attention in FLATTENED, pad_id=pad_id)
        evaluation = eval_set(held, packing_length, t.micro_batch_size, layout) if held else None
        log.info(
            "%d training units (%s), %d steps per epoch, %d steps in all",
            len(units),
            f"packed into {packing_length}-token rows" if t.packing else "one example each",
            schedule.steps_per_epoch,
            planned,
        )

        # Progress reports (rank 0) from here on: each setup phase below is one, so the operator's stall
        # clock restarts after a long download, load or resume.
        root = Path(config.checkpoints.dir)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
        _, peak = peak_flops(device_name, ctx.world_size)
        observer = None
        if self.metrics is not None:
            # The course of the checkpoint the attempt will most likely resume from, for the reports until
            # it is restored: an OOM re-plan's resume ends at another step, reads other epochs' data.
            expected = data_order.expected_course(root, t, planned, units, schedule, packing_length)
            total, going = (None, schedule) if expected is None else (expected[0].total, expected[1])
            observer = Observer(config, ctx, self.metrics, peak, total, going)
            self.observer = observer
            observer.metrics.bad_rows.inc(stats.bad_rows)
            observer.phase("data ready", checkpoints.newest_complete_step(root), then=Phase.LOADING_MODEL)
        self.stop.during_setup("after loading the data")
        data = {
            "format": fmt,
            "badRows": stats.bad_rows,
            "truncated": stats.truncated,
            "withoutTarget": stats.without_target,
            "answersCutByTemplate": stats.answers_cut_by_template,
            "answersUntrained": stats.answers_untrained,
        }
        if evaluation is not None:
            data["evalExamples"] = evaluation.examples
        summary = self.train(
            tokenizer, units, packing_length, schedule, layout, attention, planned, observer, data, evaluation
        )
        if ctx.is_main:
            log.info("done: %s", json.dumps(summary))
        return summary

    def train(
        self,
        tokenizer: Any,
        units: list[Unit],
        packing_length: int | None,
        schedule: Schedule,
        layout: Layout,
        attention: str,
        planned: int,
        observer: Observer | None,
        data: dict[str, Any],
        evaluation: EvalSet | None,
    ) -> dict[str, Any]:
        """Model, optimizer, resume, the loop and the output; returns this attempt's summary (``data``: what
        loading the data counted, in it too)."""
        config, ctx, t = self.config, self.ctx, self.t
        root = Path(config.checkpoints.dir)

        # Model. Under FSDP: no weights yet, on any rank (they come from rank 0 or a checkpoint below).
        plan = precision_plan(config.method, t.precision)
        rank0_weights = loads_on_rank0(config, ctx)
        with heartbeat.downloads(
            config, Phase.LOADING_MODEL, self.metrics, observer, weights=not rank0_weights
        ):
            base = (
                build_model(config, attention) if rank0_weights else load_model(config, ctx.device, attention)
            )
        counts = count_parameters(base)
        self.own_loss = remote_code.computes_own_loss(base)
        flops = flops_model(base.config.to_dict(), config.method, counts.non_embedding)
        model = prepare_for_training(
            base, config.method, config.lora, t, ctx.device, revision=config.model.revision
        )
        log.info(
            "model: %.3fB parameters, %.2fM trainable (%s, %s, attention %s)",
            counts.total / 1e9,
            sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
            config.method,
            t.precision,
            attention,
        )
        model = wrap_model(model, config, ctx, plan.compute_dtype)
        self.io_seconds = heartbeat.io_seconds(model)
        optimizer = build_optimizer(model, t, ctx.device)
        scheduler = build_scheduler(optimizer, t, planned)
        parts = Trainables(model, optimizer, scheduler, make_scaler(plan, ctx.device, shards(config, ctx)))
        if observer is not None:
            observer.phase("model loaded", checkpoints.newest_complete_step(root), then=Phase.RESTORING)
        self.stop.during_setup("after loading the model")

        # Resume: the newest checkpoint that loads, else the pretrained weights (resume.py).
        data_layout = data_order.fingerprint(len(units), schedule, t.seed, t.packing)
        state, resumed = resume.restore(
            config, ctx, parts, attention, data_layout, self.metrics, observer, spec=self.spec
        )
        resumed_from = state.step if resumed else None
        if evaluation is not None:
            selection.measured_on(state, evaluation.fingerprint)  # before the resume's report and evaluation
        # After a resume with another layout, the rest of the epoch it interrupted first (data_order.py).
        units, schedule = data_order.rest_of_epoch(
            state.fingerprint, state.step, units, schedule, packing_length
        )
        course, schedule = data_order.follow(state, parts, self.t, planned, schedule)
        if observer is not None:
            observer.follow(schedule, course.total)
            if resumed is not None:
                observer.resumed_from(state, resumed)
            observer.phase("resumed" if resumed else "starting", state.step, state.loss)
            observer.start_tracking(state.step, self.stop)
        settings = config.evaluation
        # A SIGTERM's save, not evaluated: evaluated now only when an uninterrupted run would have evaluated
        # those weights, so that a preemption adds no evaluation to early stopping's count, nor drops one.
        unevaluated = resumed is not None and state.eval_step != state.step
        due = unevaluated and self.evaluation_due(state.step, course.total)
        if evaluation is not None and due and self.evaluate(parts, evaluation, plan, state, observer):
            selection.saving(state)
        # Early stopping ended an earlier attempt here (it then failed writing the output): train no further.
        stopped = state.step < course.total and stops_early(state, settings)
        if stopped and observer is not None:
            observer.stopped_early(state)
        end = state.step if stopped else course.total

        seconds, tokens = self.loop(
            parts,
            plan,
            StepBatches(units, schedule, layout, ctx.rank, state.step, end),
            state,
            end,
            observer,
            flops,
            evaluation,
        )
        summary = {
            "finalLoss": state.loss,
            "steps": state.step,
            "totalSteps": course.total,
            "tokens": state.tokens,
            "samples": state.samples,
            "seconds": round(seconds, 3),
            "tokensPerSecond": tokens / seconds if seconds > 0 else 0.0,
            "resumedFromStep": resumed_from,
            "method": config.method,
        } | data
        if evaluation is not None:
            summary |= {"evalLoss": state.eval_loss, "evalStep": state.eval_step}
            with heartbeat.busy(observer, "loading the best checkpoint", self.io_seconds):
                output_step = selection.load_output(self.config, parts, state, ctx)
            summary |= {"stoppedEarly": state.step < course.total, "outputStep": output_step}
        writing = self.io_seconds
        if config.merge_adapter:  # the base read again, merged and written (merging.py)
            writing += heartbeat.weights_seconds(2 * counts.total * merging.merge_dtype(config).itemsize)
        with heartbeat.saving(observer, "writing the output", writing):
            output.write_model(self.config, self.ctx, model, tokenizer, summary)
        return summary

    def loop(
        self,
        parts: Trainables,
        plan: Any,
        batches: StepBatches,
        state: TrainState,
        total: int,
        observer: Observer | None,
        flops: Any,
        evaluation: EvalSet | None,
    ) -> tuple[float, int]:
        """Train from ``state.step`` to ``total``, evaluating (``evaluation``) before each checkpoint, every
        ``evaluation.everySteps`` steps and after the last step; returns (seconds, tokens) of this attempt."""
        ctx, t, every = self.ctx, self.t, self.config.checkpoints
        settings = self.config.evaluation
        best = settings is not None and settings.final_model == "Best"  # its checkpoint spared by rotation
        # Its own generator: seeding workers must not draw from the global RNG restored from the checkpoint.
        loader = DataLoader(
            batches,
            batch_size=None,
            num_workers=t.dataloader_workers,
            pin_memory=ctx.device.type == "cuda",
            generator=torch.Generator().manual_seed(t.seed),
            worker_init_fn=ignore_sigterm,
        )
        self.stop.during_setup(f"before training resumed at step {state.step}")
        if observer is not None:
            observer.training_started()
        started = last_save = time.monotonic()
        tokens_this_attempt, non_finite = 0, NonFiniteSteps(state.nonfinite_in_a_row)  # over a resume too
        wait_started = time.monotonic()
        for micro_batches in loader:
            stepping = time.monotonic()
            waited = stepping - wait_started
            result = train_step(parts, micro_batches, plan, t.max_grad_norm, ctx, own_loss=self.own_loss)
            state.step += 1
            state.tokens += result.tokens
            state.samples += result.samples
            if math.isfinite(result.loss):  # a skipped step left the weights as they were
                state.loss = result.loss
            tokens_this_attempt += result.tokens
            if observer is not None:
                observer.step(state, result, time.monotonic() - stepping, waited, flops)
            non_finite.count(result, state.step)  # Diverged after too many, before any save of theirs
            state.nonfinite_in_a_row = non_finite.in_a_row
            minutes_due = (
                every.every_minutes is not None and time.monotonic() - last_save >= every.every_minutes * 60
            )
            steps_due = every.every_steps is not None and state.step % every.every_steps == 0
            due, stopping = (
                v > 0 for v in ctx.sum([float(minutes_due or steps_due), float(self.stop.requested)])
            )
            # The last step of an adapter run is saved too (a few MiB), so that a failure while writing the
            # output repeats no training; a full model's last step waits for the output alone.
            last = state.step == total and self.config.method != "full"
            save = stopping or last or (due and state.step < total)
            early = False  # spec.evaluation.earlyStopping ends training at this step
            if evaluation is not None and not stopping and (save or self.evaluation_due(state.step, total)):
                # A SIGTERM during the evaluation stops it: the checkpoint is what the grace period is for.
                stopping = not self.evaluate(parts, evaluation, plan, state, observer)
                early = not stopping and state.step < total and stops_early(state, settings)
                save = save or stopping or (early and self.config.method != "full")  # as a last step
            if save:
                saved = time.monotonic()
                selection.saving(state)
                doing = f"saving the checkpoint of step {state.step}"
                with heartbeat.saving(observer, doing, self.io_seconds):  # a SIGTERM's save as well
                    if ctx.is_main:  # the rows this epoch has used, for a resume with another layout
                        state.fingerprint["used"] = data_order.used_rows(
                            batches.schedule, batches.units, state.step
                        )
                    job = self.config.job
                    path = checkpoints.save(
                        Path(every.dir), state, parts, ctx, keep=every.keep, job=job, keep_best=best
                    )
                last_save = time.monotonic()
                if observer is not None:
                    observer.checkpoint_saved(state, str(path), last_save - saved)
                log.info("checkpoint %s saved in %.1fs", path, last_save - saved)
                # A SIGTERM during a scheduled save: that checkpoint is the one the grace period is for (after
                # the last step, the output is written as it would have been).
                if not stopping and not early and state.step < total:
                    stopping = ctx.sum([float(self.stop.requested)])[0] > 0
            if stopping:
                raise TrainerError(
                    ExitCode.PREEMPTED, f"preempted (SIGTERM): checkpoint saved at step {state.step}"
                )
            if early:
                if observer is not None:
                    observer.stopped_early(state)
                break
            wait_started = time.monotonic()
        return time.monotonic() - started, tokens_this_attempt

    def evaluation_due(self, step: int, total: int) -> bool:
        """Whether the weights of ``step`` are evaluated whatever the clock: at a checkpoint of
        ``checkpoints.everySteps``, every ``evaluation.everySteps`` and at the last step (``total``). The
        loop evaluates before every save besides, a save of ``checkpoints.everyMinutes`` too, but never
        before the save a SIGTERM asks for."""
        settings = self.config.evaluation
        every = (self.config.checkpoints.every_steps, settings.every_steps if settings else None)
        return step >= total or any(n is not None and step % n == 0 for n in every)

    def evaluate(
        self, parts: Trainables, evaluation: EvalSet, plan: Any, state: TrainState, observer: Observer | None
    ) -> bool:
        """Collective: the held-out loss at ``state.step`` into ``state``; False when a SIGTERM stopped it."""
        if observer is not None:
            observer.evaluating()
        loss, took = evaluate(
            parts.model,
            evaluation,
            plan,
            self.ctx,
            own_loss=self.own_loss,
            stop=lambda: self.stop.requested,
            tick=observer.still_evaluating if observer is not None else lambda: None,
        )
        if loss is not None:
            state.eval_loss, state.eval_step = loss, state.step
            if self.config.evaluation is not None:
                selection.evaluated(state, self.config.evaluation)
        if observer is not None:
            observer.evaluated(state, took, stopped=loss is None)
        return loss is not None


if __name__ == "__main__":
    main()
