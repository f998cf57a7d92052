"""Progress reports while rank 0 downloads, saves or loads, so a long transfer is not taken for a stall.

The operator ends an attempt as Stalled when no progress report arrives for
``restartPolicy.stallTimeoutSeconds`` (default 1800 s), and the training thread reports only between
steps and when a setup phase is done (observer.py): a 70B base model (140 GB, about 47 minutes at
50 MB/s) or every save of a 70B full fine-tune (a 790 GiB checkpoint: 26 minutes at the 0.5 GiB/s the
operator assumes, longer on slower storage) would outlast it. A thread reports while such a phase runs,
every ``PROGRESS_REPORT_INTERVAL_SECONDS`` (30 s), and stops before the phase returns; it only reads
file sizes or the clock and hands a record to the reporter: no CUDA, no collectives.

- Downloads (:func:`downloads`): each time the bytes the hub cache (``$HF_HOME/hub``, set by the
  operator) holds for the job's repos grew (their ``blobs`` folders, with the ``.incomplete`` files a
  download grows). A download that hangs stops the reports, so the stall clock still catches it.
- Reads of the base weights (``downloads(weights=True)``: the model's load, under FSDP rank 0's
  pretrained weights), from a warm hub cache or a local ``model.path``, which grow no file: the last
  report again at every interval in which the cache did not grow, for at most a bound from the size of
  the model's files (:func:`weights_seconds`: 10 minutes plus 10 s/GiB) after the start or the cache's
  last growth (the read after a download). A download that hangs there is ended that bound plus the
  stall timeout after its last growth.
- Checkpoint saves and restores, the best checkpoint's load and the output's writing (:func:`busy`;
  :func:`saving` for the writes, whose phase reads ``saving`` meanwhile): the last report again, at
  every interval, for at most a bound from the checkpoint's size (:func:`io_seconds`: 10 s/GiB, five
  times the time the operator's termination grace assumes, plus 10 minutes). Reads grow no file, and a
  save spends minutes in barriers, fsyncs and renames: time is the one measure of all of them. One that
  hangs is ended that bound plus the stall timeout after it began.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch import nn

from sftjob.config import TrainerConfig
from sftjob.constants import PROGRESS_REPORT_INTERVAL_SECONDS
from sftjob_trainer.checkpoints import newest_complete_step
from sftjob_trainer.metrics import Phase, TrainerMetrics
from sftjob_trainer.observer import Observer
from sftjob_trainer.report import ProgressReporter

log = logging.getLogger("sftjob_trainer")

JOIN_TIMEOUT_SECONDS = 10
GIB = 1024**3
# A save or load that reports while it runs (busy) is trusted for this long: a base, plus the checkpoint at
# about 100 MiB/s, a fifth of the rate the operator's termination grace assumes (2 s/GiB in pods.py).
BUSY_BASE_SECONDS = 600.0
BUSY_SECONDS_PER_GIB = 10.0


def cache_bytes(folders: Mapping[str, Path]) -> int:
    """Bytes written to the files directly in ``folders`` (a repo's ``blobs``, partial downloads
    included); a folder not there yet counts 0, a file renamed or removed while measured is skipped.

    A file counts what it holds on disk, at most its size: a download that sets the file's length first
    and fills it in as chunks arrive (hf-xet assembles files this way) still grows, where its size would
    not."""
    total = 0
    for folder in folders.values():
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    total += min(stat.st_size, stat.st_blocks * 512)
    return total


class Heartbeat:
    """While active, calls ``beat()`` from a thread every ``interval`` seconds until it returns False; never
    after ``__exit__`` returned. ``beat`` reports (best effort: an exception stops the heartbeat)."""

    def __init__(self, beat: Callable[[], bool], interval: float, name: str) -> None:
        self.beat, self.interval = beat, interval
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a report and the end of the phase never interleave
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._stop.set()
        self._thread.join(timeout=JOIN_TIMEOUT_SECONDS)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if not self.beat():
                        return
                except Exception as exc:  # best effort, like the reports themselves: never into training
                    log.warning("%s stopped: %s", self._thread.name, exc)
                    return


class DownloadHeartbeat(Heartbeat):
    """While active, calls ``report(bytes)`` from a thread every ``interval`` seconds in which the bytes
    in ``folders`` grew, and ``quiet(seconds, bytes)`` (when given) every other interval, ``seconds`` since
    they last grew or, before that, since the start; never after ``__exit__`` returned."""

    def __init__(
        self,
        folders: Mapping[str, Path],
        report: Callable[[int], None],
        interval: float,
        quiet: Callable[[float, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(self._grew, interval, "download-heartbeat")
        self.folders, self.report, self.quiet, self.clock = folders, report, quiet, clock
        self._last, self._grown = 0, 0.0

    def __enter__(self) -> DownloadHeartbeat:
        self._last = cache_bytes(self.folders)  # what earlier attempts downloaded is no progress
        self._grown = self.clock()
        super().__enter__()
        return self

    def _grew(self) -> bool:
        size = cache_bytes(self.folders)
        if size > self._last:
            self._last, self._grown = size, self.clock()
            self.report(size)
        elif self.quiet is not None:
            self.quiet(self.clock() - self._grown, size)
        return True


def hub_folders(config: TrainerConfig, phase: Phase, hub_cache: Path) -> dict[str, Path]:
    """The ``blobs`` folders of the hub repos ``phase`` may download, by repo id: the dataset's and the
    model's (tokenizer, config) while loading data, the model's after; none for local paths."""
    repos = {config.model.name: "models"} if config.model.name else {}
    if phase is Phase.LOADING_DATA and config.dataset.name:
        repos[config.dataset.name] = "datasets"
    return {repo: hub_cache / "--".join([kind, *repo.split("/")]) / "blobs" for repo, kind in repos.items()}


@contextlib.contextmanager
def downloads(
    config: TrainerConfig,
    phase: Phase,
    metrics: TrainerMetrics | None,
    observer: Observer | None = None,
    hub_cache: Path | None = None,
    interval: float | None = None,
    *,
    weights: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """A :class:`DownloadHeartbeat` over ``phase`` on rank 0 (``metrics``), every ``interval`` (by default
    ``PROGRESS_REPORT_INTERVAL_SECONDS``), reporting through the observer's reporter, or through its own for
    the phase before the Observer exists (loading data).

    ``weights``: the block reads the base model's weights, from the hub cache or a local ``model.path``,
    which grows no file: rank 0 (``observer``) then also sends its last report again at every interval in
    which the cache did not grow (:func:`reading_weights`), so a long read of a warm cache or a local
    folder is not taken for a stall, nor the read that follows a download."""
    if hub_cache is None:
        from huggingface_hub import constants

        hub_cache = Path(constants.HF_HUB_CACHE)
    folders = hub_folders(config, phase, hub_cache)
    quiet = reading_weights(config, observer) if weights and observer is not None else None
    if metrics is None or not (folders or quiet):
        yield
        return
    reporter = observer.reporter if observer is not None else ProgressReporter(config.report)
    record: dict[str, Any] = {"step": newest_complete_step(Path(config.checkpoints.dir)), "phase": str(phase)}
    if observer is not None and observer.known:
        record["totalSteps"] = observer.total
    repos = ", ".join(folders)

    def report(size: int) -> None:
        amount = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
        message = f"downloading {repos}: {amount}"
        log.info("%s (%s)", message, phase)
        metrics.download_bytes.set(size)
        reporter.progress(record | {"message": message, "downloadedBytes": size})

    every = PROGRESS_REPORT_INTERVAL_SECONDS if interval is None else interval
    try:
        with DownloadHeartbeat(folders, report, every, quiet, clock):
            yield
    finally:
        if observer is None:
            reporter.close()


def folder_bytes(folder: Path) -> int:
    """The size of the files directly in ``folder`` (a local ``model.path``: its weights, links to them
    followed); 0 when it cannot be listed."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    total = 0
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_file():
                total += entry.stat().st_size
    return total


def weights_seconds(size: int) -> float:
    """How long a read of ``size`` bytes of base weights may go on before :func:`reading_weights` stops
    reporting: the base a save or load gets, plus ``BUSY_SECONDS_PER_GIB`` for each GiB (a 70B model's
    140 GB in bf16: 10 + 22 minutes)."""
    return BUSY_BASE_SECONDS + size / GIB * BUSY_SECONDS_PER_GIB


def reading_weights(config: TrainerConfig, observer: Observer) -> Callable[[float, int], None]:
    """A :class:`DownloadHeartbeat`'s ``quiet`` for a read of the base weights: rank 0's last report again,
    its ``phase`` saying so, as long as the read (counted from the start, or from the cache's last growth:
    the read after a download) has taken less than :func:`weights_seconds` of the model's files (those of
    ``model.path``, or what the hub cache holds of the repo); after that the reports stop, with a warning,
    so the operator's stall timeout still ends one that hangs."""
    source = config.model
    doing = f"loading the weights of {source.name or source.path}"
    local = folder_bytes(Path(source.path)) if source.path else 0
    warned = False

    def quiet(seconds: float, cached: int) -> None:
        nonlocal warned
        taken, size = timedelta(seconds=round(seconds)), local + cached
        if seconds < weights_seconds(size):
            warned = False  # a download grew the cache since: the read after it gets its own bound
            log.info("%s (%s so far)", doing, taken)
            observer.still_busy(doing)
        elif not warned:
            warned = True
            log.warning(
                "%s: still at it after %s, longer than %.1f GB of files should take: no more progress"
                " reports, so restartPolicy.stallTimeoutSeconds ends the attempt if it hangs",
                doing,
                taken,
                size / 1e9,
            )

    return quiet


def io_seconds(model: nn.Module) -> float:
    """How long a save or load of ``model``'s checkpoint may take before :func:`busy` stops reporting: a
    base for the barriers, renames and rotation around it, plus the checkpoint (every trainable weight and
    its two AdamW moments, all ranks together; the output is smaller) at ``BUSY_SECONDS_PER_GIB``."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return BUSY_BASE_SECONDS + 3 * trainable / GIB * BUSY_SECONDS_PER_GIB


@contextlib.contextmanager
def busy(
    observer: Observer | None,
    doing: str,
    seconds: float,
    interval: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[None]:
    """Rank 0 (``observer``): the last progress report again every ``interval`` (by default
    ``PROGRESS_REPORT_INTERVAL_SECONDS``) while the block, a save or load (``doing``: "saving the checkpoint
    of step 120"), runs, for at most ``seconds`` (:func:`io_seconds`); after that the reports stop, so the
    operator's stall timeout still ends one that hangs. Other ranks (no ``observer``) report nothing."""
    if observer is None:
        yield
        return
    began = clock()

    def beat() -> bool:
        elapsed = clock() - began
        taken = timedelta(seconds=round(elapsed))
        if elapsed >= seconds:
            log.warning(
                "%s: still at it after %s, longer than a checkpoint this size should take: no more"
                " progress reports, so restartPolicy.stallTimeoutSeconds ends the attempt if it hangs",
                doing,
                taken,
            )
            return False
        log.info("%s (%s so far)", doing, taken)
        observer.still_busy(doing)
        return True

    every = PROGRESS_REPORT_INTERVAL_SECONDS if interval is None else interval
    with Heartbeat(beat, every, "busy-heartbeat"):
        yield


@contextlib.contextmanager
def saving(observer: Observer | None, doing: str, seconds: float) -> Iterator[None]:
    """:func:`busy` around a write, a checkpoint's or the output's (``doing``): meanwhile rank 0's
    ``sftjob_train_phase`` reads ``saving``, which the TrainingStalled alert exempts as it does
    ``evaluating`` (no step is taken while a 70B checkpoint is written for half an hour), and
    ``training`` again once it is done."""
    if observer is None:
        yield
        return
    observer.metrics.enter(Phase.SAVING)
    try:
        with busy(observer, doing, seconds):
            yield
    finally:
        observer.metrics.enter(Phase.TRAINING)
