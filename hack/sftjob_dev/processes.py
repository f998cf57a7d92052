"""Starting, watching and stopping the control plane's processes by recorded PID.

Components run in their own session so they outlive the command that started them and ignore its
Ctrl-C. A PID is trusted only while /proc says it still runs the binary we started, so a recycled PID
is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from sftjob_dev.errors import ClusterError

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0
LOG_TAIL_LINES = 30


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Run argv in the background with stdout and stderr appended to `log`; return its PID."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    return proc.pid


def _reap(pid: int) -> None:
    """Collect the exit status of a child of this process so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def is_running(pid: int, exe: Path | None = None) -> bool:
    """True when `pid` is a live (non-zombie) process, running `exe` when one is given."""
    _reap(pid)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
        return False
    if exe is None:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return cmdline == str(exe)


def stop(pid: int, exe: Path | None = None, grace: float = STOP_GRACE_SECONDS) -> bool:
    """TERM, wait up to `grace` seconds, then KILL. Returns False if the PID was not ours to stop."""
    if not is_running(pid, exe):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(POLL_SECONDS)
    if is_running(pid, exe):
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + grace
        while is_running(pid) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
    return True


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a component's log, for error messages."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_until(
    ready: Callable[[], bool], *, component: str, log: Path, timeout: float, pid: int | None = None
) -> None:
    """Poll `ready` until it holds; fail fast if the component's process died, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except OSError:
            pass
        if pid is not None and not is_running(pid):
            raise ClusterError(f"{component} exited during start-up; log: {log}\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{component} was not ready after {timeout:.0f}s; log: {log}\n{log_tail(log)}")
        time.sleep(POLL_SECONDS)
