"""Pieces of killable multi-rank jobs, shared by ``tests/test_random_kills.py`` and the fault suite.

- :class:`Log`: one JSON line per event, appended and fsynced by a rank (a kill may cut only the
  last line); :func:`events` reads every rank's log back in the parent.
- :func:`own_process_group`: the job makes itself one process group (both ranks and the worker
  processes they start from then on), so that it can be SIGKILLed at once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist


class Log:
    """One JSON line per event, appended and fsynced (a kill may cut only the last line)."""

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.fd = os.open(
            os.path.join(directory, f"rank{rank}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT
        )

    def write(self, **event: Any) -> None:
        os.write(self.fd, (json.dumps({**event, "t": time.time()}) + "\n").encode())
        os.fsync(self.fd)


def events(log_dir: Path) -> list[dict[str, Any]]:
    """Every event of every rank's :class:`Log` under ``log_dir``, with its ``rank``."""
    out = []
    for path in sorted(log_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            try:
                out.append({**json.loads(line), "rank": rank})
            except ValueError:
                pass  # the line a kill cut short
    return out


def own_process_group(rank: int) -> None:
    """Make the job one process group of its own (collective), so that it can be killed at once:
    both ranks and the worker processes they start from now on."""
    leader = [os.getpid()]
    if rank == 0:
        os.setpgid(0, 0)
    dist.broadcast_object_list(leader, src=0)
    if rank != 0:
        os.setpgid(0, leader[0])
