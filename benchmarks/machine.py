"""What else the machine did during a benchmark: CPU taken by other processes, the usual cause of drift.

``start = cpu_sample()`` before, ``machine_line(start)`` after: one line saying how many CPU-seconds
this benchmark (with all its descendant processes) and everything else used. ``require_memory(need,
hint)`` refuses to start a run that would not fit in memory (an OOM kill skips clean-up).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuSample:
    machine_busy: float
    """CPU seconds the whole machine spent busy (all processes, from /proc/stat)."""
    own: float
    """CPU seconds this process and its descendants (live or exited) spent."""
    wall: float


def _live_descendants_cpu() -> float:
    """CPU seconds of this process's live descendants, with the children they reaped (ranks forked
    by a fork server are its children, not ours: they show up here, not in ``os.times``)."""
    parents: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    ours = {os.getpid()}
    grew = True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in ours and pid not in ours}
        ours |= new
        grew = bool(new)
    ours.discard(os.getpid())
    return sum(used[pid] for pid in ours) / os.sysconf("SC_CLK_TCK")


def cpu_sample() -> CpuSample:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system + _live_descendants_cpu()
    return CpuSample(busy, own, time.perf_counter())


def others_cpu_seconds(start: CpuSample, end: CpuSample) -> float:
    """CPU seconds other processes took between two samples."""
    return max(0.0, (end.machine_busy - start.machine_busy) - (end.own - start.own))


def machine_line(start: CpuSample) -> str:
    end = cpu_sample()
    wall = end.wall - start.wall
    others = others_cpu_seconds(start, end)
    return (
        f"machine: {os.cpu_count()} CPUs; over {wall:.0f} s this benchmark used"
        f" {end.own - start.own:.0f} CPU-s, other processes {others:.0f} CPU-s"
        f" ({others / wall:.2f} CPUs on average)"
    )


def require_memory(need: int, hint: str) -> int:
    """Exit with a message (``hint``: how to make the run smaller) unless ``need`` bytes are
    available; return the available bytes."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvail"))
    if available < need:
        raise SystemExit(
            f"not enough memory: {available / 2**30:.1f} GiB available, this run needs about"
            f" {need / 2**30:.1f} GiB; {hint}"
        )
    return available
