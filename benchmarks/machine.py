"""What else the machine did during a benchmark: CPU taken by other processes, the usual cause of drift.

``start = cpu_sample()`` before, ``machine_line(start)`` after: one line saying how many CPU-seconds
this benchmark (with its child processes, once they exited) and everything else used.
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
    """CPU seconds this process and its exited children spent."""
    wall: float


def cpu_sample() -> CpuSample:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    t = os.times()
    return CpuSample(
        busy, t.user + t.system + t.children_user + t.children_system, time.perf_counter()
    )


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
