"""CPU seconds and memory of a process from /proc: what the operator (or a control-plane part) costs.

``cpu_seconds`` is user + system time; ``rss`` is resident memory now and ``peak_rss`` the kernel's
high-water mark (VmHWM), so a short spike between two readings is not missed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Usage:
    cpu_seconds: float
    rss_bytes: int
    peak_rss_bytes: int


def usage(pid: int) -> Usage | None:
    """The process's usage now, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields after the command name; utime, stime are 12, 13
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    kib = {
        key: int(value.split()[0])
        for key, _, value in (line.partition(":") for line in status.splitlines())
        if key in ("VmRSS", "VmHWM")
    }
    return Usage(cpu, kib.get("VmRSS", 0) * 1024, kib.get("VmHWM", 0) * 1024)


def usages(pids: dict[str, int]) -> dict[str, Usage]:
    """Usage of each named process that still runs."""
    found = {name: usage(pid) for name, pid in pids.items()}
    return {name: u for name, u in found.items() if u is not None}


def cpu_delta(before: dict[str, Usage], after: dict[str, Usage]) -> dict[str, float]:
    """CPU seconds each process used between two readings."""
    return {
        name: round(after[name].cpu_seconds - before[name].cpu_seconds, 2) for name in after if name in before
    }


def machine() -> dict[str, object]:
    """Cores, memory, CPU model and the load average right now."""
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    total_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    return {
        "cores": os.cpu_count(),
        "memoryGiB": round(total_kib / 1024 / 1024, 1),
        "cpuModel": model,
        "loadAverage": load_average(),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
