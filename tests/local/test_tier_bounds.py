"""What the local tier leaves in its root stays within its bound across restarts whose settings
changed: kept parts, and spares only while recycling. 2 real gloo ranks."""

from __future__ import annotations

from pathlib import Path

from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.local.naming import part_name
from tierpoint.testing import run_ranks

from .helpers import make_state


def _save(rank: int, world: int, root: Path, iterations: list[int], recycle: bool) -> None:
    manager = LocalCheckpointManager(root, session_id="job", recycle=recycle)
    manager.find_latest()
    for it in iterations:
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    manager.close()


def _names(root: Path, rank: int) -> list[str]:
    return sorted(p.name for p in (root / "job" / str(rank)).iterdir())


def test_a_job_restarted_without_recycling_removes_the_spares_of_one_that_recycled(shm_dir):
    """A run that recycles keeps a spare per part between saves; restarted with recycle=False,
    nothing takes them any more: its next commit removes them (they stayed for good, RAM on a RAM
    tier)."""
    run_ranks(_save, 2, shm_dir, [1, 2], True)
    assert _names(shm_dir, 0) == [part_name(2, 0), "spare_0.free"]
    run_ranks(_save, 2, shm_dir, [3, 4], False)
    for rank in range(2):
        assert _names(shm_dir, rank) == [part_name(4, rank)]
