"""The local tier's files on one rank: spares made ahead of the first saves."""

from __future__ import annotations

import os

from tierpoint.local.store import PartStore


def test_spares_made_ahead_have_their_space_and_stay_mapped(shm_dir):
    store = PartStore(shm_dir, "job")
    assert store.make_spares(3 << 20, 2) == 2
    spares = sorted(
        (e for e in os.scandir(store.directory) if e.name.startswith("spare_")),
        key=lambda e: e.name,
    )
    assert [e.name for e in spares] == ["spare_0.free", "spare_1.free"]
    assert all(e.stat().st_size == 3 << 20 <= e.stat().st_blocks * 512 for e in spares)
    assert len(store.mappings) == 2
    assert store.make_spares(3 << 20, 2) == 0  # there already
    store.mappings.close()
