"""The experiment trackers a job asks for (``spec.tracking``): TensorBoard, MLflow and Weights & Biases.

Why it exists: the metrics endpoint and ``train_log.jsonl`` are the cluster's view of one attempt; people
compare runs, and look at a job across its restarts, in the trackers they already use. Rank 0's
:class:`~sftjob_trainer.observer.Observer` feeds :class:`Trackers` what it reports anyway: the logging
steps' loss, learning rate, gradient norm, throughput, MFU, epoch and tokens, every evaluation's loss, and
each attempt's plan at its first step (an OOM re-plan between attempts shows on the charts).

Each tracker has one shape (``start`` / ``log`` / ``finish``) and its library is imported in ``start``,
only when the job asks for it. The rules every tracker is held to here:

- **It never stops training.** Whatever it raises (import, start, log, finish) is logged once as a
  warning naming it, counted in ``sftjob_train_tracking_errors_total{tracker}``, and the tracker is dropped
  for the rest of the attempt.
- **It never holds up the loop.** TensorBoard's writer and W&B's service process write in the
  background; MLflow logs asynchronously, with short HTTP timeouts and few retries unless the pod's
  environment says otherwise (:data:`MLFLOW_HTTP_DEFAULTS`); a failed batch is noticed at the next
  logging step. Starting and finishing are bounded and run under ``heartbeat.busy``, so the progress
  reports go on meanwhile.
- **A job is one run across its attempts.** TensorBoard: one folder on the checkpoint volume, each
  attempt's writer purging what a killed attempt logged after the checkpoint this one resumed from.
  W&B: the run's id is the job's uid, resumed. MLflow: the run tagged with the job's uid, found again and
  resumed, ended FINISHED, FAILED or KILLED (preempted) by each attempt.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Final, Literal, Protocol

from sftjob.config import MlflowSettings, TrainerConfig, WandbSettings
from sftjob.failures import ExitCode, TrainerError
from sftjob_trainer.failures import one_line
from sftjob_trainer.metrics import TrainerMetrics

log = logging.getLogger("sftjob_trainer")

# How an attempt ended: MLflow's FINISHED, FAILED, KILLED; W&B's exit code 0, 1, and 1 after "preempting".
Outcome = Literal["finished", "failed", "killed"]

# W&B's x axis: every value is logged with the optimizer step it belongs to, so a resumed attempt that logs
# a step again is a new row of that step (W&B's own ``_step`` only ever grows and would drop it).
WANDB_STEP_METRIC: Final = "train/step"
# How long starting or finishing the trackers reports progress (``heartbeat.busy``) at most: an MLflow
# server that is down fails its first request in under a minute with MLFLOW_HTTP_DEFAULTS, W&B gives up
# after its init timeout, and each tracker's finish is given up on after FINISH_SECONDS.
BUSY_SECONDS: Final = 300.0
WANDB_INIT_TIMEOUT_SECONDS: Final = 60.0
# Finishing one tracker at most (uploading what is left, ending the run), then it is given up on. A
# preempted attempt finishes after its checkpoint, inside the pod's grace period, and its exit code and
# termination message come after the trackers: they get only a few seconds each then.
FINISH_SECONDS: Final = 30.0
PREEMPTED_FINISH_SECONDS: Final = 5.0
# TensorBoard's event files reach the volume this often (a killed attempt loses at most this much).
TENSORBOARD_FLUSH_SECONDS: Final = 30
# MLflow's defaults are 120 s a request and 7 retries with exponential backoff (minutes for one request);
# set before MLflow is imported unless the pod's environment sets them.
MLFLOW_HTTP_DEFAULTS: Final = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
# The MLflow run's tags: the job it belongs to (the uid finds it again on the next attempt).
UID_TAG, NAMESPACE_TAG, NAME_TAG = "sftjob.io/uid", "sftjob.io/namespace", "sftjob.io/name"
_MLFLOW_STATUS: Final[dict[Outcome, str]] = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def outcome_of(error: BaseException | None) -> Outcome:
    """How the attempt ended, from what ended it (None: it completed)."""
    if error is None:
        return "finished"
    preempted = isinstance(error, TrainerError) and error.code == ExitCode.PREEMPTED
    return "killed" if preempted or isinstance(error, KeyboardInterrupt) else "failed"


class Tracker(Protocol):
    name: ClassVar[str]  # the ``tracker`` label of sftjob_train_tracking_errors_total

    def start(self, first_step: int) -> None:
        """Open the job's run; this attempt logs from ``first_step`` on (its evaluation of the checkpoint
        it resumed from, at ``first_step - 1``, aside)."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Finite values of optimizer step ``step``."""

    def finish(self, outcome: Outcome) -> None:
        """End the attempt's part of the run."""


class TensorBoardTracker:
    """Event files in ``directory`` (the checkpoint volume): one writer per attempt, all in one folder, which
    TensorBoard shows as one run."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._writer: Any = None

    def start(self, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard hides whatever earlier files hold from purge_step on: what a killed attempt logged
        # after the checkpoint this one resumed from, which this attempt logs again.
        self._writer = SummaryWriter(
            self.directory, purge_step=first_step, flush_secs=TENSORBOARD_FLUSH_SECONDS
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def finish(self, outcome: Outcome) -> None:
        self._writer.close()


class MlflowTracker:
    """One run of ``experiment`` (default: the job's namespace) per job, tagged with its uid: created by the
    first attempt with the job's settings as parameters, resumed by the next ones."""

    name: ClassVar[str] = "mlflow"

    def __init__(self, settings: MlflowSettings, config: TrainerConfig) -> None:
        self.settings, self.config = settings, config
        self._client: Any = None
        self._run_id = ""
        self._metric: Any = None  # mlflow.entities.Metric
        # One thread waits on each asynchronous batch in turn: a failed one is raised at the next log.
        self._checks: list[Future[None]] = []
        self._waiter: ThreadPoolExecutor | None = None

    def start(self, first_step: int) -> None:
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        job = self.config.job
        self._metric = Metric
        self._client = client = MlflowClient(tracking_uri=self.settings.tracking_uri)
        experiment_id = self._experiment(self.settings.experiment or job.namespace)
        found = (
            client.search_runs(
                [experiment_id],
                filter_string=f"tags.`{UID_TAG}` = '{job.uid}'",
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
            if job.uid
            else []
        )
        if found:
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
            log.info("MLflow: resuming run %s of experiment %s", self._run_id, experiment_id)
        else:
            tags = {NAMESPACE_TAG: job.namespace, NAME_TAG: job.name, UID_TAG: job.uid}
            run = client.create_run(experiment_id, run_name=job.name, tags=tags)
            self._run_id = run.info.run_id
            # Parameters cannot change once logged: the first attempt's settings, never the plan's.
            params = [Param(key, value) for key, value in mlflow_params(self.config).items()]
            client.log_batch(self._run_id, params=params)
            log.info("MLflow: run %s created in experiment %s", self._run_id, experiment_id)
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-batches")

    def _experiment(self, name: str) -> str:
        client = self._client
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(client.create_experiment(name))
        except Exception:  # another job created it meanwhile
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for check in [c for c in self._checks if c.done()]:
            self._checks.remove(check)
            check.result()  # an earlier batch that failed: raised here, once
        now = int(time.time() * 1000)
        metrics = [self._metric(key, value, now, step) for key, value in values.items()]
        operations = self._client.log_batch(self._run_id, metrics=metrics, synchronous=False)
        assert self._waiter is not None
        self._checks.append(self._waiter.submit(operations.wait))

    def finish(self, outcome: Outcome) -> None:
        try:
            for check in self._checks:
                check.result()
            self._client.set_terminated(self._run_id, _MLFLOW_STATUS[outcome])
        finally:
            if self._waiter is not None:
                self._waiter.shutdown(wait=False, cancel_futures=True)


def mlflow_params(config: TrainerConfig) -> dict[str, str]:
    """What the run was started with: a flat handful of the settings people filter runs by."""
    t = config.training
    params: dict[str, Any] = {
        "method": config.method,
        "model": config.model.name or config.model.path,
        "model_revision": config.model.revision,
        "dataset": config.dataset.name or config.dataset.path,
        "dataset_split": config.dataset.split,
        "max_seq_length": config.dataset.max_seq_length,
        "epochs": t.epochs,
        "max_steps": t.max_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler": t.lr_scheduler,
        "warmup_ratio": t.warmup_ratio,
        "weight_decay": t.weight_decay,
        "global_batch_size": t.global_batch_size,
        "precision": t.precision,
        "packing": t.packing,
        "seed": t.seed,
    }
    if config.method != "full":
        modules = config.lora.target_modules
        params |= {
            "lora_r": config.lora.r,
            "lora_alpha": config.lora.alpha,
            "lora_dropout": config.lora.dropout,
            "lora_target_modules": modules if isinstance(modules, str) else ",".join(modules),
        }
    return {key: str(value) for key, value in params.items() if value is not None}


class WandbTracker:
    """One W&B run per job: its id is the job's uid (W&B picks one when there is none, a local run), resumed
    by every attempt; the trainer's configuration is the run's config."""

    name: ClassVar[str] = "wandb"

    def __init__(self, settings: WandbSettings, config: TrainerConfig) -> None:
        self.settings, self.config = settings, config
        self._run: Any = None

    def start(self, first_step: int) -> None:
        import wandb

        job = self.config.job
        self._run = run = wandb.init(
            project=self.settings.project,
            entity=self.settings.entity,
            id=job.uid or None,
            resume="allow" if job.uid else None,
            name=job.name,
            config=self.config.model_dump(mode="json"),  # no credential in it: those are env variables
            # console off: the trainer's own output stays untouched (the pod's log is its record).
            settings=wandb.Settings(
                init_timeout=WANDB_INIT_TIMEOUT_SECONDS, finish_timeout=FINISH_SECONDS, console="off"
            ),
        )
        run.define_metric(WANDB_STEP_METRIC)
        run.define_metric("*", step_metric=WANDB_STEP_METRIC)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log({**values, WANDB_STEP_METRIC: step})

    def finish(self, outcome: Outcome) -> None:
        if outcome == "killed":
            self._run.mark_preempting()
        self._run.finish(exit_code=0 if outcome == "finished" else 1)


def configured(config: TrainerConfig) -> list[Tracker]:
    """The trackers ``config.tracking`` asks for, not started."""
    tracking = config.tracking
    trackers: list[Tracker] = []
    if tracking.tensorboard_dir is not None:
        trackers.append(TensorBoardTracker(tracking.tensorboard_dir))
    if tracking.mlflow is not None:
        trackers.append(MlflowTracker(tracking.mlflow, config))
    if tracking.wandb is not None:
        trackers.append(WandbTracker(tracking.wandb, config))
    return trackers


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
    """Every configured tracker (rank 0): started once, fed finite values, finished once; one that fails is
    warned about, counted and dropped, and the others go on."""

    def __init__(
        self, config: TrainerConfig, metrics: TrainerMetrics, trackers: list[Tracker] | None = None
    ) -> None:
        self.config, self.metrics = config, metrics
        self._waiting = configured(config) if trackers is None else trackers
        self._live: list[Tracker] = []
        for tracker in self._waiting:
            metrics.tracking_errors(tracker.name)  # exported at 0: its first error is an increase

    def __bool__(self) -> bool:
        return bool(self._waiting or self._live)

    @property
    def live(self) -> list[str]:
        """The names of the trackers started and not dropped."""
        return [tracker.name for tracker in self._live]

    def start(self, step: int) -> None:
        """Start each tracker for an attempt that goes on from ``step`` (0: from the start), then log the
        attempt's plan at its first step."""
        waiting, self._waiting = self._waiting, []
        for tracker in waiting:
            if self._call(tracker, "start", tracker.start, step + 1):
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
            if not self._call(tracker, "log", tracker.log, step, finite):
                self._live.remove(tracker)

    def finish(self, outcome: Outcome) -> None:
        """End each live tracker's part of the run, each given up on after a bounded wait (shorter for a
        preempted attempt, which is inside its grace period)."""
        live, self._live, self._waiting = self._live, [], []
        seconds = PREEMPTED_FINISH_SECONDS if outcome == "killed" else FINISH_SECONDS
        for tracker in live:

            def end(tracker: Tracker = tracker) -> None:
                tracker.finish(outcome)

            self._call(tracker, "finish", within, seconds, f"finishing {tracker.name}", end)

    def _call(self, tracker: Tracker, doing: str, call: Callable[..., None], *args: Any) -> bool:
        try:
            call(*args)
            return True
        except Exception as exc:  # whatever a tracker raises: never into training
            log.warning(
                "experiment tracker %s failed to %s, dropped for the rest of this attempt"
                " (training goes on): %s",
                tracker.name,
                doing,
                one_line(f"{type(exc).__name__}: {exc}"),
            )
            self.metrics.tracking_errors(tracker.name).inc()
            return False


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
