"""Launching the demo's job as several nodes on one machine: one torchrun per simulated node
(``--nnodes N --node-rank i`` on 127.0.0.1), node 0's output echoed, the others' kept in a log.

Invariants: no launch outlives its bounds: once one node's torchrun failed, the others get a grace
period to end and are then stopped (a torchrun whose workers all succeeded would otherwise wait
300 s at its exit barrier for the failed node); torchrun's own log directories go into the caller's
scratch directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Cluster:
    nodes: int
    ranks_per_node: int


def torchrun(cluster: Any, args: list[str], log: Path, module: str = "tierpoint.demo.job") -> int:
    """Run ``python -m module args`` on ``cluster.nodes`` x ``cluster.ranks_per_node`` ranks;
    returns the first non-zero exit code (0 if every node succeeded)."""
    from ..testing import free_port  # here: it imports torch, which the demo's --help does not

    scratch = log.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        OMP_NUM_THREADS="1",
        TMPDIR=str(scratch),
    )
    port = free_port()
    procs = []
    with open(log, "ab") as log_file:
        for node in range(cluster.nodes):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={cluster.nodes}",
                f"--nproc-per-node={cluster.ranks_per_node}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                module,
                *args,
            ]
            out = subprocess.PIPE if node == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=log_file))
        echo = threading.Thread(target=_echo, args=(procs[0].stdout,), daemon=True)
        echo.start()
        codes = _wait_all(procs)
        echo.join(10)
    return next((c for c in codes if c != 0), 0)


def _echo(stream: Any) -> None:
    for line in stream:
        sys.stdout.write(line.decode(errors="replace"))
        sys.stdout.flush()


def _wait_all(procs: list[subprocess.Popen], limit: float = 600, grace: float = 30) -> list[int]:
    """Every process's exit code. Once one failed, the others get ``grace`` seconds to end; then,
    or after ``limit`` seconds in all, they are stopped."""
    start = time.monotonic()
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > limit or (failed_at is not None and now - failed_at > grace):
            for p in procs:
                if p.poll() is None:
                    print(f"  stopping torchrun (pid {p.pid}): another node's job failed or hung")
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    return [p.returncode for p in procs]
