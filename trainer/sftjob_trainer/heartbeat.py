"""Progress reports while rank 0 downloads from the Hugging Face hub, so a long download is not a stall.

The operator ends an attempt as Stalled when no progress report arrives for
``restartPolicy.stallTimeoutSeconds``, and the setup phases report only when they are done (observer.py):
a 70B base model (140 GB, about 47 minutes at 50 MB/s) would outlast the default. While rank 0 is in a
setup phase that may download, a thread measures every ``PROGRESS_REPORT_INTERVAL_SECONDS`` (30 s) the
bytes the hub cache (``$HF_HOME/hub``, set by the operator) holds for the job's repos (their ``blobs``
folders, with the ``.incomplete`` files a download grows) and sends a progress report each time that
number grew. A download that hangs stops the reports, so the stall clock still catches it. The thread
only reads file sizes and hands a record to the reporter: no CUDA, no collectives; it stops before the
phase returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sftjob.config import TrainerConfig
from sftjob.constants import PROGRESS_REPORT_INTERVAL_SECONDS
from sftjob_trainer.checkpoints import newest_complete_step
from sftjob_trainer.metrics import Phase, TrainerMetrics
from sftjob_trainer.observer import Observer
from sftjob_trainer.report import ProgressReporter

log = logging.getLogger("sftjob_trainer")

JOIN_TIMEOUT_SECONDS = 10


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


class DownloadHeartbeat:
    """While active, calls ``report(bytes)`` from a thread every ``interval`` seconds in which the bytes
    in ``folders`` grew; never after ``__exit__`` returned."""

    def __init__(self, folders: Mapping[str, Path], report: Callable[[int], None], interval: float) -> None:
        self.folders, self.report, self.interval = folders, report, interval
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a report and the end of the phase never interleave
        self._thread = threading.Thread(target=self._run, name="download-heartbeat", daemon=True)
        self._last = 0

    def __enter__(self) -> DownloadHeartbeat:
        self._last = cache_bytes(self.folders)  # what earlier attempts downloaded is no progress
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
            size = cache_bytes(self.folders)
            with self._lock:
                if self._stop.is_set():
                    return
                if size <= self._last:
                    continue
                self._last = size
                try:
                    self.report(size)
                except Exception as exc:  # best effort, like the reports themselves: never into training
                    log.warning("download heartbeat stopped: %s", exc)
                    return


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
