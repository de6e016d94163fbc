"""A worker must not outlive its trainer: run a trainer script that prints its worker's pid and
kills itself, then check the worker ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


def assert_worker_dies_with_trainer(script: str, within: float = 10.0) -> None:
    """Run ``script`` (prints the worker's pid first, then SIGKILLs itself); fail, killing the
    worker, unless the worker is gone within ``within`` seconds."""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    worker_pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if worker_parent(worker_pid) is None:  # gone (or its pid reused by another process)
            return
        time.sleep(0.05)
    os.kill(worker_pid, 9)
    pytest.fail(f"worker {worker_pid} outlived its killed trainer")


def worker_parent(pid: int) -> int | None:
    """The parent of ``pid`` when it is a live (not zombie) tierpoint worker, else ``None`` (also
    for a process that reused the pid: a parallel test's, which must not be killed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except (OSError, ValueError, IndexError):
        return None
    return int(parent) if state != "Z" and b"asyncsave._entry" in command else None
