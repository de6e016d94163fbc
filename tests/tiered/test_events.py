"""What the tiered manager keeps of its saves for ``stats()``: sums and the most recent times, not
every record (a job saving every few steps for days)."""

from __future__ import annotations

import gc
from pathlib import Path

from tierpoint import TieredCheckpointManager
from tierpoint.testing import run_ranks
from tierpoint.tiered import events

from .helpers import make_state, train_step

STEPS = 40


def _many_saves(rank: int, world: int, root: Path) -> dict:
    events.RECENT = 8  # the medians look back on 8 saves here (1000 by default)
    state = make_state(rank)
    kwargs = {"local_every": 1, "persistent_every": 4, "replication_factor": 1}
    kept = []
    with TieredCheckpointManager(str(root / "local"), str(root / "p"), "e", **kwargs) as manager:
        for step in range(1, STEPS + 1):
            train_step(state, world)
            manager.maybe_save(step, state)
            if step % 10 == 0:
                gc.collect()
                kept.append(sum(isinstance(o, events.SaveRecord) for o in gc.get_objects()))
        manager.wait()
        return {"kept": kept, "stats": manager.stats()}


def test_stats_keep_sums_not_every_record(tmp_path):
    for out in run_ranks(_many_saves, 2, tmp_path, timeout=120):
        assert max(out["kept"]) <= 4, out["kept"]  # those in flight (before: one per save made)
        tiers = out["stats"]["tiers"]
        assert (tiers["local"]["saves"], tiers["persistent"]["saves"]) == (STEPS, STEPS // 4)
        assert tiers["local"]["failed"] == tiers["persistent"]["failed"] == 0
        for tier in tiers.values():
            for spread in (tier["blocking_s"], tier["durable_s"]):
                assert 0 < spread["median"] <= spread["max"] <= spread["total"]
