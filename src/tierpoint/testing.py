"""The multi-rank runner for tests, benchmarks and users' own tests: run a function on N real local
processes joined by a real gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (spawn start method), each joins a
gloo group through a TCPStore that the parent hosts on a free port of 127.0.0.1, then calls
``fn(rank, world_size, *args)``. Ranks are forked from a fork server that imported torch once (see
``_context``) and see the caller's environment at the time of the call. It returns the ranks' return
values in rank order, or raises one ``RankFailure`` carrying every failed rank's traceback. Ranks
still running at the timeout are killed and reported as hung. ``fn`` must be importable (defined at
module level in a test module). :func:`free_port` serves launchers and test servers (the demo's
launcher too).

Call order: ``run_ranks`` from the parent process (never from inside a rank); ``free_port`` any time.
Invariants: the library's own modules never import this one, except the demo launcher (for
``free_port``); a rank's failure, crash or hang is never silent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

HOST = "127.0.0.1"


class RankFailure(AssertionError):
    """One or more ranks failed, crashed or hung."""


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple,
    env: dict[str, str],
    results: Any,
    pg_timeout_s: float,
) -> None:
    # The fork server's environment is a snapshot from its start; give the rank the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": HOST,
            "MASTER_PORT": str(port),
        }
    )
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        store = dist.TCPStore(
            HOST, port, world_size, is_master=False, timeout=timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # A rank may return from init before its peers finished connecting to it: one that
        # destroyed the group at once made a peer's init fail ("Connection closed by peer").
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # ``fn`` may have destroyed it already
                dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "error", traceback.format_exc()))


# torch DCP and tierpoint's tiers too: importing them costs each rank ~1.7 s of CPU otherwise.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "tierpoint",
    "tierpoint.asyncsave",
    "tierpoint.dcp",
    "tierpoint.local",
]


def _context() -> mp.context.BaseContext:
    """A fork server that imported torch once: each rank then starts in milliseconds, not seconds.

    The server forks from a single-threaded process that never touched a process group, so children
    start clean, as with ``spawn``; ``fn``'s module is imported in the child as with ``spawn``.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


_LOWEST_PORT = 20000
"""The lowest port :func:`free_port` picks (below: the ports fixed services tend to use)."""


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (for a launcher or a test server).

    Picked at random below the kernel's ephemeral range where there is room: the kernel hands the
    ports of that range to any process that binds port 0 or connects (other jobs' stores, gloo's
    sockets, their clients), so one of those, taken by the kernel for someone else between this
    call and the launcher's bind, made the launch fail ("address already in use") on a busy
    machine. A port outside it is taken only by another explicit choice."""
    start = _ephemeral_ports_start()
    if start - _LOWEST_PORT >= 1024:
        rng = random.SystemRandom()
        for _ in range(100):
            port = rng.randrange(_LOWEST_PORT, start)
            if _bindable(port):
                return port
    with socket.socket() as sock:  # no room below the range (or all taken): the kernel's choice
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout: float = 60.0,
    allow_crash: set[int] | frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; see the module docstring.

    Ranks in ``allow_crash`` may die without reporting (their result is ``None``); the others must
    succeed.
    """
    ctx = _context()
    store = dist.TCPStore(HOST, 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, store.port, args, env, results, pg_timeout),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                outcome[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    # Drain what the processes put just before exiting.
                    try:
                        while True:
                            rank, status, value = results.get(timeout=0.5)
                            outcome[rank] = (status, value)
                    except queue.Empty:
                        break
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:  # hung at the timeout, or this call interrupted (SIGTERM made an exit, Ctrl-C)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:  # no rank outlives the call
            if p.is_alive():
                p.kill()
                p.join(5)
    problems = []
    for rank in range(world_size):
        status, value = outcome.get(rank, (None, None))
        if status == "error":
            problems.append(f"--- rank {rank} failed:\n{value}")
        elif status is None and rank not in allow_crash:
            why = (
                "hung (killed at the timeout)"
                if rank in hung
                else f"died (exit code {procs[rank].exitcode})"
            )
            problems.append(f"--- rank {rank} {why}")
    del store
    if problems:
        raise RankFailure(
            f"{len(problems)} of {world_size} ranks did not succeed:\n" + "\n".join(problems)
        )
    return [outcome.get(r, (None, None))[1] for r in range(world_size)]
