"""States, comparisons and rank functions shared by the local-tier tests.

The replication tests simulate two nodes of 2 ranks each (``as_node``): cliques with factor 2 are
{0, 2} and {1, 3}, so every part has a copy on the other node.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import torch

from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LazyCliqueReplicationStrategy,
    LocalCheckpointManager,
)


class WarningRecords(logging.Handler):
    """Collects the messages of tierpoint's warnings in this process from now on."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("tierpoint").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def make_state(rank: int, iteration: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + iteration)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "optimizer": {"step": iteration, "exp_avg": [torch.randn(64, 33, generator=g)], "lr": 0.1},
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "meta": ("rank", rank),
    }


def assert_bitwise_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype != torch.bool else a,
            b.view(torch.uint8) if b.dtype != torch.bool else b,
        )
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b and type(a) is type(b)


def flip_tensor_byte(path: str | Path) -> bytes:
    """Flip a byte near the end of a part file (a tensor byte: the header stays valid, the checksum
    does not); returns the damaged contents."""
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    return bytes(data)


def as_node(rank: int, ranks_per_node: int = 2) -> None:
    """Make this process count as node ``rank // ranks_per_node`` for the node checks."""
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // ranks_per_node}"


def replicated_manager(root: str, lazy: bool = False, **kwargs) -> LocalCheckpointManager:
    cls = LazyCliqueReplicationStrategy if lazy else CliqueReplicationStrategy
    strategy = cls.from_replication_params(replication_factor=2)
    return LocalCheckpointManager(root, session_id="job", repl_strategy=strategy, **kwargs)


def part_files(root: Path, holder: int) -> list[str]:
    """The committed part files in ``holder``'s directory of session ``job``."""
    d = root / "job" / str(holder)
    return sorted(p for p in os.listdir(d) if p.startswith("iter_")) if d.is_dir() else []


def save_replicated(
    rank: int, world: int, root: str, iterations: list[int], lazy: bool
) -> list[str]:
    """Rank function: save ``iterations`` with replication (keep_last=2); this rank's part files."""
    as_node(rank)
    manager = replicated_manager(root, lazy=lazy, keep_last=2)
    for it in iterations:
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    return part_files(Path(root), rank)


def load_latest(rank: int, world: int, root: str, lazy: bool = False) -> tuple[int, list[str]]:
    """Rank function: load the latest iteration (checked bitwise against what ``save_replicated``
    saved) and wait for the replicas restored; ``(iteration or -1, this rank's warnings)``."""
    as_node(rank)
    records = WarningRecords()
    manager = replicated_manager(root, lazy=lazy)
    iteration = manager.find_latest()
    if iteration != -1:
        ta, _ = manager.load()
        assert_bitwise_equal(ta.state_dict, make_state(rank, iteration))
        manager.wait_for_restore()  # replicas come back in the background
    return iteration, records.messages


def open_sockets() -> int:
    """Sockets this process holds (each gloo group holds some to every peer); after a garbage
    collection, so that what a traceback held a while is not counted."""
    gc.collect()
    fds = Path("/proc/self/fd")
    return sum(os.readlink(fd).startswith("socket:") for fd in fds.iterdir() if fd.exists())
