"""The CPU benchmarks still run against the library as it is now: each at its smallest size, in a
subprocess, must finish with exit status 0 and leave nothing in /dev/shm (the benches' own figures
are not checked here; ``./run bench NAME`` prints them)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench(name: str, prefix: str, *args: str) -> str:
    """Run ``benchmarks/<name>_bench.py args``; its output. ``prefix``: its /dev/shm directories'."""
    returncode, output = _run_python([str(REPO / "benchmarks" / f"{name}_bench.py"), *args], prefix)
    assert returncode == 0, output[-4000:]
    return output


def _run_python(args: list[str], prefix: str) -> tuple[int, str]:
    """``python args`` in the repository: its exit status and output, once it is checked to have
    left no directory whose name starts with ``prefix`` (:func:`_new_dirs`)."""
    with _new_dirs(prefix) as new:
        done = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
            timeout=240,
        )
        assert not new(), new()
    return done.returncode, done.stdout + done.stderr


@contextlib.contextmanager
def _new_dirs(prefix: str) -> Iterator[Callable[[], set[str]]]:
    """The directories named ``prefix...`` in /dev/shm and /tmp made since entry. One such check
    at a time across the parallel test workers, which would see each other's directories (the
    lock: the benchmarks directory's)."""

    def named() -> set[str]:
        return {os.path.join(d, n) for d in ("/dev/shm", "/tmp") for n in os.listdir(d)
                if n.startswith(prefix)}  # fmt: skip

    fd = os.open(REPO / "benchmarks", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = named()
        yield lambda: named() - before
    finally:
        os.close(fd)


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


GPU_SMALL = ["--device", "cpu", "--reps", "1", "--train-reps", "1", "--pairs", "1", "--steps", "12"]


def test_gpu_bench_a_failed_part_hides_none_of_the_others(tmp_path: Path) -> None:
    """The single unattended device run once lost every later figure to one failure in the saves'
    set-up (no training, no JSON): each part now fails alone, the exit status says so."""
    figures = tmp_path / "bench.json"
    inject = (
        "import sys; sys.path.insert(0, 'benchmarks'); import gpu_bench\n"
        "def fail(self): raise RuntimeError('CUDA error: out of memory (injected)')\n"
        "gpu_bench.PersistentSaver.warm_up = fail\n"
        "gpu_bench.main(sys.argv[1:])\n"
    )
    args = [*GPU_SMALL, "--parts", "saves,training", "--variants", "tp10", "--json", str(figures)]
    returncode, output = _run_python(["-c", inject, *args], "tierpoint-gpu-bench-")
    assert returncode != 0, output[-4000:]
    assert "saves: failed (RuntimeError: CUDA error: out of memory (injected))" in output, output
    assert "training loop: GPT" in output and "tierpoint local async every 10" in output, output
    written = json.loads(figures.read_text())
    assert "out of memory" in written["failed_parts"]["saves"]
    assert written["train_none"] and written["train_tp10"] and not written["incomplete"]


def test_gpu_bench_stopped_by_sigterm_keeps_the_figures_so_far(tmp_path: Path) -> None:
    """The device run stops the bench with SIGTERM at its time limit: what was measured by then
    is in the JSON (marked incomplete), and /dev/shm is clean."""
    figures = tmp_path / "bench.json"
    args = [*GPU_SMALL, "--json", str(figures), "--memory-saves", "400"]
    with _stopped_by_sigterm("gpu", args, "tierpoint-gpu-bench-") as (bench, _):
        assert bench.stdout is not None
        for line in bench.stdout:
            if line.startswith("persistent tier (tierpoint.dcp.async_save): blocking"):
                break  # the saves' table: the memory check's 400 saves come next
        time.sleep(1)
    written = json.loads(figures.read_text())
    assert written["incomplete"] and len(written["floor_pinned"]) == 1 and written["tp_block"]


@pytest.mark.parametrize("name", ["local", "dcp"])
def test_a_bench_stopped_by_sigterm_removes_its_files(name: str) -> None:
    """``tierpoint bench`` and ``timeout`` stop a bench with SIGTERM: these benches died at once,
    leaving their directories (in /dev/shm: memory) and a rank waiting out its group timeout."""
    prefix = f"tierpoint-{name}-bench-"
    args = ["--reps", "50", *(["--mib", "128"] if name == "local" else ["--gib", "0.1"])]
    with _stopped_by_sigterm(name, args, prefix) as (bench, new):
        deadline = time.monotonic() + 60
        while not new():
            assert time.monotonic() < deadline and bench.poll() is None
            time.sleep(0.1)
        time.sleep(3)  # the ranks are saving


@contextlib.contextmanager
def _stopped_by_sigterm(
    name: str, args: list[str], prefix: str
) -> Iterator[tuple[subprocess.Popen, Callable[[], set[str]]]]:
    """Start ``benchmarks/<name>_bench.py args``, giving it and its new directories
    (:func:`_new_dirs`); SIGTERM it when the block ends; check that it exited from the signal and
    left no directory named ``prefix...`` (its ranks are killed)."""
    with _new_dirs(prefix) as new:
        bench = subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / f"{name}_bench.py"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # its ranks too, for the clean-up below
        )
        try:
            yield bench, new
            bench.send_signal(signal.SIGTERM)
            rest = bench.communicate(timeout=120)[0]
            assert bench.returncode == 128 + signal.SIGTERM, rest[-4000:]
            assert not new(), new()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
            for left in new():
                shutil.rmtree(left, ignore_errors=True)


def test_gpu_device_run_ends_when_a_step_ignores_sigterm(tmp_path: Path) -> None:
    """The unattended device run's ``timeout`` sent SIGTERM and no SIGKILL: a benchmark stuck on
    it held the run until the machine's own limit cut the summary and the exit status off."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/bin/sh\n"
        'case "$1" in benchmarks/gpu_bench.py) exec "$REAL_PYTHON" -c "import signal, time; '
        'signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)";; esac\n'
        'exec "$REAL_PYTHON" "$@"\n'
    )
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PART": "bench", "BENCH_TIMEOUT": "2", "KILL_AFTER": "2",
           "OUT": str(out), "PYTHON": str(stub), "REAL_PYTHON": sys.executable}  # fmt: skip
    run = subprocess.Popen(
        ["bash", str(REPO / "benchmarks" / "gpu_device_run.sh")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
        start_new_session=True,  # the stuck stand-in too, for the clean-up below
    )
    try:
        assert run.wait(90) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert "FAIL gpu_bench (see bench.log)" in (out / "summary").read_text()
