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
- Checkpoint saves and restores, the best checkpoint's load and the output's writing (:func:`busy`):
  the last report again, at every interval, for at most a bound from the checkpoint's size
  (:func:`io_seconds`: 10 s/GiB, five times the time the operator's termination grace assumes, plus 10
  minutes). Reads grow no file, and a save spends minutes in barriers, fsyncs and renames: time is the
  one measure of all of them. One that hangs is ended that bound plus the stall timeout after it began.
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
    in ``folders`` grew; never after ``__exit__`` returned."""

    def __init__(self, folders: Mapping[str, Path], report: Callable[[int], None], interval: float) -> None:
        super().__init__(self._grew, interval, "download-heartbeat")
        self.folders, self.report = folders, report
        self._last = 0

    def __enter__(self) -> DownloadHeartbeat:
        self._last = cache_bytes(self.folders)  # what earlier attempts downloaded is no progress
        super().__enter__()
        return self

    def _grew(self) -> bool:
        size = cache_bytes(self.folders)
        if size > self._last:
            self._last = size
            self.report(size)
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
    interval: float = PROGRESS_REPORT_INTERVAL_SECONDS,
) -> Iterator[None]:
    """A :class:`DownloadHeartbeat` over ``phase`` on rank 0 (``metrics``), reporting through the
    observer's reporter, or through its own for the phase before the Observer exists (loading data)."""
    if hub_cache is None:
        from huggingface_hub import constants

        hub_cache = Path(constants.HF_HUB_CACHE)
    folders = hub_folders(config, phase, hub_cache)
    if metrics is None or not folders:
        yield
        return
    reporter = observer.reporter if observer is not None else ProgressReporter(config.report)
    record: dict[str, Any] = {"step": newest_complete_step(Path(config.checkpoints.dir)), "phase": str(phase)}
    if observer is not None:
        record["totalSteps"] = observer.total
    repos = ", ".join(folders)

    def report(size: int) -> None:
        amount = f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
        message = f"downloading {repos}: {amount}"
        log.info("%s (%s)", message, phase)
        metrics.download_bytes.set(size)
        reporter.progress(record | {"message": message, "downloadedBytes": size})

    try:
        with DownloadHeartbeat(folders, report, interval):
            yield
    finally:
        if observer is None:
            reporter.close()


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
