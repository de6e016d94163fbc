"""A torchrun job for tests/test_dist.py: tierpoint's collectives (``agree``: the coordination
group alone; ``everything``: a persistent save, a local save with replicas and an async queue
too), then a normal interpreter exit, what users' jobs do (the test helper's ranks leave with
os._exit, which skips the shutdown where gloo groups are freed). Arguments: ROOT WHAT [destroy]."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

root, what = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
from tierpoint import dcp  # noqa: E402 - what is imported decides what shutdown frees when
from tierpoint.dist import agree  # noqa: E402

with agree("a clean exit"):
    pass
if what == "everything":
    from tierpoint.asyncsave import AsyncCallsQueue
    from tierpoint.dist import node_groups
    from tierpoint.local import (
        BasicTensorAwareStateDict,
        CliqueReplicationStrategy,
        LocalCheckpointManager,
    )

    node_groups()
    dcp.save({"w": torch.ones(4)}, f"{root}/persistent")
    strategy = CliqueReplicationStrategy(replication_jump=1, replication_factor=2)
    manager = LocalCheckpointManager(f"{root}/local", session_id="exit", repl_strategy=strategy)
    queue = AsyncCallsQueue()
    state = BasicTensorAwareStateDict({"w": torch.full((4,), float(rank))})
    queue.schedule_async_request(manager.save(state, 1, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
if "destroy" in sys.argv[3:]:
    dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
