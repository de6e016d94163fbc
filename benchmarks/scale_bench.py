"""Coordination at scale, by counting: collectives and bytes each rank receives, per operation, at W ranks.

This machine simulates a few dozen ranks at most, so scale is shown by counts, not by time. Each rank
wraps torch.distributed's tensor collectives (all_reduce, all_gather, broadcast, gather, scatter,
...; the object variants are made of them) and point-to-point calls with a counter, then runs with a tiny state, between
uncounted barriers:

- ``local save``: ``LocalCheckpointManager.save`` (sync, replication factor 2 across simulated nodes
  of ``--ranks-per-node`` ranks);
- ``async save + finalize``: ``save(is_async=True)``, ``schedule_async_request`` and the finalize
  rounds until it is done;
- ``find_latest + load``: a new manager on the same directories;
- ``restore after a node loss``: the last simulated node's directories emptied (a replaced node),
  then a new manager's ``find_latest`` + ``load`` (its parts come back from their replicas) and
  ``wait_for_restore`` (the replicas it held, given back);
- ``persistent save``: ``tierpoint.dcp.save`` of the same state into ``step-N``;
- ``latest complete``: ``tierpoint.dcp.get_latest_complete_checkpoint``;
- ``node-local latest complete``: the same state saved into a directory of each simulated node
  (only the coordinator's node holds ``.metadata``), then ``get_latest_complete_checkpoint(...,
  node_local=True)``, which fetches what each node lacks from its peers.

``TIERPOINT_SCALE_TRACE=1`` prints every collective with its bytes and the tierpoint frame that
issued it. For each operation it prints, per W, the number of collectives and the bytes received by
the busiest rank and by the median one (point-to-point bytes apart: they are the replicas
themselves), then the busiest rank's growth per doubling of W. Run: ``./run bench scale`` or
``.venv/bin/python benchmarks/scale_bench.py --worlds 2 4 8 16``. Everything is written under a temporary directory in /dev/shm and removed at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from tierpoint import dcp
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.testing import run_ranks

OPERATIONS = (
    "local save",
    "async save + finalize",
    "find_latest + load",
    "restore after a node loss",
    "persistent save",
    "latest complete",
    "node-local latest complete",
)
_RECEIVED_ARG = {  # the argument holding what a rank receives, by position and name
    "all_reduce": (0, "tensor"),
    "all_gather": (0, "tensor_list"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "broadcast": (0, "tensor"),
    "gather": (1, "gather_list"),
    "scatter": (0, "tensor"),
    "reduce_scatter": (0, "output"),
    "barrier": (None, None),
}
_P2P = ("send", "recv", "isend", "irecv")


class Counter:
    """Wraps torch.distributed's functions in this process; ``take()`` returns and resets the counts."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        # Object collectives (torch DCP's planning uses them) are made of these tensor collectives,
        # called through distributed_c10d's own globals: both namespaces are wrapped.
        c10d = dist.distributed_c10d
        for name in (*_RECEIVED_ARG, *_P2P):
            wrapped = self._wrap(name, getattr(c10d, name))
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if name in _P2P:
                self.counts["p2p bytes"] += _nbytes(args[0])
            else:
                self.counts["collectives"] += 1
                received = _received(name, args, kwargs)
                self.counts["bytes"] += received
                if os.environ.get("TIERPOINT_SCALE_TRACE"):
                    print(f"rank {dist.get_rank()} {name} {received} B at {_caller()}")
            return original(*args, **kwargs)

        return counted

    def take(self) -> dict[str, int]:
        taken = dict(self.counts)
        self.counts.clear()
        return taken


def _caller() -> str:
    """The innermost tierpoint (or torch DCP) frame that led to a collective."""
    for frame in traceback.extract_stack()[::-1]:
        if "/tierpoint/dist/" in frame.filename or frame.filename.endswith(
            ("testing.py", "scale_bench.py")
        ):
            continue
        if "/tierpoint/" in frame.filename or "/checkpoint/" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _received(name: str, args: tuple, kwargs: dict) -> int:
    """Bytes this rank receives in one call of collective ``name``."""
    position, keyword = _RECEIVED_ARG[name]
    if position is None:
        return 0
    return _nbytes(args[position] if len(args) > position else kwargs.get(keyword))


def _rank(rank: int, world: int, base: str, per_node: int) -> dict[str, dict[str, int]]:
    per_node = max(1, min(per_node, world // 2))  # at least two nodes: replicas go to the other
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // per_node}"
    state = {"w": torch.full((64,), float(rank)), "step": 1}
    counter = Counter()
    results: dict[str, dict[str, int]] = {}
    root = Path(base) / "local"

    def measure(name: str, fn: Any) -> Any:
        dist.barrier()
        counter.take()
        out = fn()
        results[name] = counter.take()
        return out

    strategy = CliqueReplicationStrategy(replication_jump=per_node, replication_factor=2)
    manager = LocalCheckpointManager(root, session_id="scale", repl_strategy=strategy)
    manager.save(BasicTensorAwareStateDict(dict(state)), 1)  # set-up (groups, layout) not counted
    measure("local save", lambda: manager.save(BasicTensorAwareStateDict(dict(state)), 2))

    queue = AsyncCallsQueue()
    _async_save(queue, manager, state, 3)  # the worker's start, not counted
    measure("async save + finalize", lambda: _async_save(queue, manager, state, 4))
    queue.close()

    def restore() -> None:
        fresh = LocalCheckpointManager(root, session_id="scale", repl_strategy=strategy)
        fresh.load() if fresh.find_latest() >= 0 else None

    measure("find_latest + load", restore)

    lost = rank // per_node == (world - 1) // per_node  # the last node's ranks
    if lost:
        shutil.rmtree(root / "scale" / str(rank), ignore_errors=True)

    def restore_lost_node() -> None:
        fresh = LocalCheckpointManager(root, session_id="scale", repl_strategy=strategy)
        fresh.load()
        fresh.wait_for_restore(timeout=120)

    measure("restore after a node loss", restore_lost_node)
    persistent = f"{base}/persistent"
    dcp.save(dict(state), dcp.step_path(persistent, 1))  # set-up not counted
    measure("persistent save", lambda: dcp.save(dict(state), dcp.step_path(persistent, 2)))
    measure("latest complete", lambda: dcp.get_latest_complete_checkpoint(persistent))
    node_base = f"{base}/node{rank // per_node}/persistent"
    dcp.save(dict(state), dcp.step_path(node_base, 1))
    measure(
        "node-local latest complete",
        lambda: dcp.get_latest_complete_checkpoint(node_base, node_local=True),
    )
    return results


def _async_save(queue: AsyncCallsQueue, manager: Any, state: dict, iteration: int) -> None:
    request = manager.save(BasicTensorAwareStateDict(dict(state)), iteration, is_async=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=200)
    # SIGTERM unwinds like Ctrl-C: the finally below removes the files (and stops the ranks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    by_world: dict[int, dict[str, dict[str, int]]] = {}
    for world in args.worlds:
        base = tempfile.mkdtemp(prefix="tierpoint-scale-", dir="/dev/shm")
        try:
            ranks = run_ranks(_rank, world, base, args.ranks_per_node, timeout=600)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        by_world[world] = {
            op: {
                **{k: max(r[op].get(k, 0) for r in ranks) for k in ("collectives", "bytes")},
                "median bytes": int(statistics.median(r[op].get("bytes", 0) for r in ranks)),
            }
            for op in OPERATIONS
        }
        console.print(f"W={world}: done")
    table = Table(title=f"coordination per rank ({args.ranks_per_node} ranks per simulated node)")
    table.add_column("operation")
    for world in args.worlds:
        table.add_column(f"W={world}\ncoll / busiest / median", justify="right")
    table.add_column("busiest's bytes\nper doubling", justify="right")
    for op in OPERATIONS:
        row = [op]
        for world in args.worlds:
            c = by_world[world][op]
            row.append(f"{c['collectives']} / {c['bytes']:,} / {c['median bytes']:,}")
        first, last = by_world[args.worlds[0]][op], by_world[args.worlds[-1]][op]
        doublings = max(1.0, math.log2(args.worlds[-1] / args.worlds[0]))
        growth = (last["bytes"] / max(1, first["bytes"])) ** (1 / doublings)
        row.append(f"{growth:.2f}x")
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
