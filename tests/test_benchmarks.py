"""The CPU benchmarks still run against the library as it is now: each at its smallest size, in a
subprocess, must finish with exit status 0 and leave nothing in /dev/shm (the benches' own figures
are not checked here; ``./run bench NAME`` prints them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench(name: str, prefix: str, *args: str) -> str:
    """Run ``benchmarks/<name>_bench.py args``; its output. ``prefix``: its /dev/shm directories'."""
    shm_before = set(os.listdir("/dev/shm"))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}_bench.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    left = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith(prefix)}
    assert not left, left
    return output


def test_replication_bench_runs_and_every_phase_hook_exists() -> None:
    """The bench once set a read-only manager property and wrapped functions that had moved."""
    output = _bench("replication", "tierpoint-repl-bench-", "--mib", "4", "--reps", "1")
    assert "tierpoint replication step (manager.last_replication)" in output
    assert "replication figure from manager.last_replication" in output
    assert "hooks missing" not in output, output
    assert "each wiped rank receives 4 MiB before load returns" in output


def test_local_bench_runs_and_says_what_else_the_machine_did() -> None:
    output = _bench("local", "tierpoint-local-bench-", "--mib", "12", "--reps", "1")
    assert "tierpoint save (none recycled yet)" in output  # one save: nothing was recycled
    assert "machine: " in output and "other processes" in output


def test_training_bench_runs_and_times_the_managers_queues() -> None:
    """The bench once wrapped the queue of a manager that now makes one queue per tier on use."""
    small = ["--layers", "1", "--d-model", "64", "--batch", "4", "--seq", "32", "--vocab", "256"]
    output = _bench("training", "tierpoint-training-bench-", "--quick", *small)
    assert "snapshot + dispatch (schedule)" in output  # a hook on the queues' class
    assert "finalize rounds (poll)" in output
