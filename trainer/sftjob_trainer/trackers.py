"""The three experiment trackers of ``spec.tracking`` (TensorBoard, MLflow, Weights & Biases), one class each.

Each has one shape (:class:`Tracker`: ``start`` / ``log`` / ``finish``) and imports its library in
``start``, only when a job asks for it; :mod:`sftjob_trainer.tracking` holds the rules they are used by
(never stopping training, dropping one that fails). What each does for a job that is one run across its
attempts: TensorBoard, one folder on the checkpoint volume, a file per attempt, each step shown once, the
latest attempt's; W&B, the run whose id is the job's uid, resumed; MLflow, the run tagged with the job's
uid, found again and resumed, ended FINISHED, FAILED or KILLED by each attempt. None sends telemetry to a
third party (:data:`TELEMETRY_DEFAULTS`), and MLflow's requests are short (:data:`MLFLOW_HTTP_DEFAULTS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Final, Literal, Protocol

from sftjob.config import MlflowSettings, TrainerConfig, WandbSettings

log = logging.getLogger("sftjob_trainer")

# How an attempt ended: MLflow's FINISHED, FAILED, KILLED; W&B's exit code 0, 1, and 1 after "preempting".
Outcome = Literal["finished", "failed", "killed"]

# W&B's x axis: every value is logged with the optimizer step it belongs to, so a resumed attempt that logs
# a step again is a new row of that step (W&B's own ``_step`` only ever grows and would drop it).
WANDB_STEP_METRIC: Final = "train/step"
WANDB_INIT_TIMEOUT_SECONDS: Final = 60.0
# Finishing one tracker at most (uploading what is left, ending the run), then it is given up on.
FINISH_SECONDS: Final = 30.0
# TensorBoard's event files reach the volume this often (a killed attempt loses at most this much).
TENSORBOARD_FLUSH_SECONDS: Final = 30
# MLflow's defaults are 120 s a request and 7 retries with exponential backoff (minutes for one request);
# set before MLflow is imported unless the pod's environment sets them.
MLFLOW_HTTP_DEFAULTS: Final = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
# Environment variables set before MLflow or W&B is imported unless the pod's environment sets them: no
# usage telemetry (MLflow 3) nor error reports (W&B) sent to a third party from the trainer pods.
TELEMETRY_DEFAULTS: Final = {
    "mlflow": {"MLFLOW_DISABLE_TELEMETRY": "true"},
    "wandb": {"WANDB_ERROR_REPORTING": "false"},
}
# The MLflow run's tags: the job it belongs to (the uid finds it again on the next attempt).
UID_TAG, NAMESPACE_TAG, NAME_TAG = "sftjob.io/uid", "sftjob.io/namespace", "sftjob.io/name"
_MLFLOW_STATUS: Final[dict[Outcome, str]] = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


class Tracker(Protocol):
    name: ClassVar[str]  # the ``tracker`` label of sftjob_train_tracking_errors_total
    url: str | None  # the run's page once started (status.progress.trackingUrls); None: it has none

    def start(self, first_step: int) -> None:
        """Open the job's run; this attempt logs from ``first_step`` on (its evaluation of the checkpoint
        it resumed from, at ``first_step - 1``, aside)."""

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        """Finite values of optimizer step ``step``; raises when logging failed, returns whether it is known
        to work (False: not known yet, MLflow's batches in flight: neither a failure nor a success)."""

    def finish(self, outcome: Outcome) -> None:
        """End the attempt's part of the run."""


class TensorBoardTracker:
    """Event files in ``directory`` (the checkpoint volume): one writer per attempt, all in one folder, which
    TensorBoard shows as one run."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.url: str | None = None  # event files, no page
        self._writer: Any = None

    def start(self, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # What a killed attempt logged after the checkpoint this one resumed from is logged again: TensorBoard
        # shows each step once, this attempt's. Its legacy loader hides everything of earlier files from
        # purge_step on (this marker); its data server (the default, --load_fast) drops a tag's points from
        # a step on when a later file logs that tag at that step or below.
        self._writer = SummaryWriter(
            self.directory, purge_step=first_step, flush_secs=TENSORBOARD_FLUSH_SECONDS
        )

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        return True

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
        self.url: str | None = None
        self._metric: Any = None  # mlflow.entities.Metric
        # One thread waits on each asynchronous batch in turn: a failed one is raised at the next log.
        self._checks: list[Future[None]] = []
        self._waiter: ThreadPoolExecutor | None = None

    def start(self, first_step: int) -> None:
        for name, value in (MLFLOW_HTTP_DEFAULTS | TELEMETRY_DEFAULTS["mlflow"]).items():
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
            log.info("MLflow: run %s created in experiment %s", self._run_id, experiment_id)
        # Parameters cannot change once logged: the first attempt's settings, never the plan's; logged by
        # the attempt that created the run, or by a later one when that attempt could not.
        if not found or not found[0].data.params:
            params = [Param(key, value) for key, value in mlflow_params(self.config).items()]
            try:
                client.log_batch(self._run_id, params=params)
            except Exception as exc:  # the run exists: this attempt logs to it, the next logs them
                log.warning("MLflow: the run's parameters not logged (the next attempt tries again): %s", exc)
        self.url = mlflow_run_url(self.settings.tracking_uri, experiment_id, self._run_id)
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-batches")

    def _experiment(self, name: str) -> str:
        client = self._client
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(client.create_experiment(name))
            except Exception:  # another job created it meanwhile
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":  # MLflow would refuse to create the run in it
            raise RuntimeError(
                f"MLflow experiment {name!r} is deleted: restore it (mlflow experiments restore"
                f" --experiment-id {experiment.experiment_id}) or name another experiment in"
                " spec.tracking.mlflow.experiment"
            )
        return str(experiment.experiment_id)

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        """Sends ``values`` in the background, then tells how the earlier batches answered since the last
        call went: raises the latest failure among them (one per call, however many batches an outage
        failed), True when they all got through, False when none was answered yet (nothing known: a slow
        server's batches take longer than the steps between two logging steps)."""
        answered = [check for check in self._checks if check.done()]
        self._checks = [check for check in self._checks if check not in answered]
        now = int(time.time() * 1000)
        metrics = [self._metric(key, value, now, step) for key, value in values.items()]
        operations = self._client.log_batch(self._run_id, metrics=metrics, synchronous=False)
        assert self._waiter is not None
        self._checks.append(self._waiter.submit(operations.wait))
        failed = [error for error in (check.exception() for check in answered) if error is not None]
        if failed:
            raise failed[-1]
        return bool(answered)

    def finish(self, outcome: Outcome) -> None:
        """Ends the run first (MLflow takes metrics on an ended run: a slow batch still being sent must
        not leave it RUNNING when the finish is given up on), then waits for the batches still being
        sent; one that fails is not this call's failure (it was, or would have been, counted at a logging
        step)."""
        try:
            self._client.set_terminated(self._run_id, _MLFLOW_STATUS[outcome])
            for check in self._checks:
                with contextlib.suppress(Exception):
                    check.result()
        finally:
            if self._waiter is not None:
                self._waiter.shutdown(wait=False, cancel_futures=True)


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI the server serves (None for a store that has no UI: ``file:``)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


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
        self.url: str | None = None

    def start(self, first_step: int) -> None:
        for name, value in TELEMETRY_DEFAULTS["wandb"].items():
            os.environ.setdefault(name, value)
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
        self.url = run.url  # None offline
        run.define_metric(WANDB_STEP_METRIC)
        run.define_metric("*", step_metric=WANDB_STEP_METRIC)

    def log(self, step: int, values: Mapping[str, float]) -> bool:
        self._run.log({**values, WANDB_STEP_METRIC: step})
        return True

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
