"""CPU time of processes, read from /proc (Linux): what a benchmark's servers spent."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

TICK = os.sysconf("SC_CLK_TCK")


def stat_fields(pid: int | str) -> Optional[list[str]]:
    """/proc/PID/stat's fields after the command name (state first), None for a process gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_s(fields: list[str]) -> float:
    """User plus system CPU seconds, every thread, of a process's stat fields."""
    return (int(fields[11]) + int(fields[12])) / TICK


def process_cpu_s(pid: int) -> float:
    """A live process's CPU seconds so far."""
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return cpu_s(fields)


def machine_ticks() -> tuple[int, int]:
    """The whole machine's busy and total CPU ticks so far (/proc/stat's first line):
    a window's busy share is the ratio of their differences."""
    user, nice, system, idle, iowait, *rest = map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:])
    busy = user + nice + system + sum(rest[:3])  # irq, softirq, steal
    return busy, busy + idle + iowait
