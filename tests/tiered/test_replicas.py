"""A value that differs between ranks but is not wrapped in RankLocal is stored once for every rank
by the persistent tier (as torch DCP does): the manager says so, naming the key, once; states whose
ranks agree, or whose ranks hold other keys (pipeline stages), are not warned about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierpoint import RankLocal, TieredCheckpointManager
from tierpoint.testing import run_ranks

from ..local.helpers import open_sockets
from .helpers import as_node, make_state, replica_warnings, train_step

KWARGS = {"local_every": 0, "persistent_every": 2, "keep_persistent": 1}


def _save(state: dict[str, Any], root: Path, world: int | None = None, steps: int = 6) -> None:
    """Six steps saved by schedule (trained first when ``world`` is given)."""
    with TieredCheckpointManager(None, str(root), "r", **KWARGS) as manager:
        for step in range(1, steps + 1):
            if world is not None:
                train_step(state, world)
            manager.maybe_save(step, state)


def _unwrapped(rank: int, world: int, root: Path) -> list:
    state = make_state(rank)
    state["cursor"] = {"shard": rank, "seed": torch.tensor([rank, 7])}  # per rank, not wrapped
    warned = replica_warnings(lambda: _save(state, root / "unwrapped", world))
    state = make_state(rank)  # the same per-rank value, wrapped: nothing to say
    state["cursor"] = RankLocal({"shard": rank, "seed": torch.tensor([rank, 7])})
    wrapped = replica_warnings(lambda: _save(state, root / "wrapped", world))
    return [warned, wrapped]


def test_a_per_rank_value_not_wrapped_in_rank_local_is_named_once(tmp_path):
    (rank0, rank1) = run_ranks(_unwrapped, 2, tmp_path, timeout=120)
    warned, wrapped = rank0
    assert len(warned) == 1, warned  # three persistent saves, one warning
    assert "'cursor'" in warned[0] and "RankLocal" in warned[0]
    assert "'model'" not in warned[0] and "'position'" not in warned[0]  # alike on both ranks
    assert wrapped == []
    assert rank1 == [[], []]  # said by rank 0 only


def _stages(rank: int, world: int, root: Path) -> list[str]:
    """Each rank holds another stage of a model (other keys and shapes): nothing to compare."""
    stage = torch.nn.Linear(4 + rank, 3)
    state = {f"stage{rank}": stage, "position": {"samples": 8}}
    return replica_warnings(lambda: _save(state, root))


def test_ranks_holding_other_keys_are_not_compared(tmp_path):
    assert run_ranks(_stages, 2, tmp_path, timeout=120) == [[], []]


def _batch_norm(rank: int, world: int, root: Path) -> list[str]:
    """Batch-norm statistics differ between data-parallel ranks by design (torch DCP keeps one
    copy): not a warning; neither are tensors whose bytes torch will not show (a conjugate view)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)))  # per-rank statistics
    state = {"model": model, "phase": torch.randn(3, dtype=torch.complex64).conj()}
    return replica_warnings(lambda: _save(state, root))


def test_batch_norm_statistics_are_not_taken_for_a_mistake(tmp_path):
    assert run_ranks(_batch_norm, 2, tmp_path, timeout=120) == [[], []]


def _built_in_rank_order(rank: int, world: int, root: Path) -> list[str]:
    """Each rank adds its keys in another order (as from iterating a set) and holds another
    ``cursor``: the order is no difference, the cursor is."""
    made = make_state(rank)
    made["cursor"] = {"b": rank, "a": 1} if rank else {"a": 1, "b": rank}
    names = list(made)
    state = {name: made[name] for name in (names if rank == 0 else names[::-1])}
    return replica_warnings(lambda: _save(state, root, world))


def test_keys_in_another_order_on_each_rank_are_still_compared(tmp_path):
    warned, other = run_ranks(_built_in_rank_order, 2, tmp_path, timeout=120)
    assert len(warned) == 1 and "'cursor'" in warned[0] and "'model'" not in warned[0]
    assert other == []


def _managers_made_again(rank: int, world: int, root: Path) -> list[int]:
    """An in-process restart, three times: a manager with replicas saves (local, replicated, and
    persistent) and is closed; the sockets this process holds after each."""
    node = as_node(rank, 1)
    state, sockets = make_state(rank), []
    local = str(root / f"node{node}")
    for cycle in range(3):
        kwargs = {"local_every": 1, "persistent_every": 2, "replication_factor": 2}
        with TieredCheckpointManager(local, str(root / "p"), "job", **kwargs) as m:
            for step in range(2 * cycle + 1, 2 * cycle + 3):
                train_step(state, world)
                m.maybe_save(step, state)
        sockets.append(open_sockets())
    return sockets


@pytest.mark.slow
def test_managers_closed_and_made_again_leave_no_gloo_groups_behind(shm_dir):
    """Each closed manager freed nothing of its gloo groups (its queue's, its replication's):
    about 7 groups, their sockets and threads, per manager made, for the life of the process."""
    # 3 managers made, each saving 2 steps: minutes where tests run in parallel on a busy machine
    for sockets in run_ranks(_managers_made_again, 2, shm_dir, timeout=240):
        assert sockets[-1] <= sockets[0], sockets
