"""A user stopping training while saves are in flight: a Ctrl-C (``KeyboardInterrupt`` on the
training thread) is the user's, never swallowed by a save; the job then stops promptly whether
the user closes the manager or not, and the next job restores the newest committed step."""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path
from typing import Any

from tierpoint import TieredCheckpointManager
from tierpoint.local import in_place
from tierpoint.testing import run_ranks

from .helpers import as_node, fingerprint, make_state, train_step


def _digest(state: dict[str, Any]) -> str:
    """What :func:`fingerprint` holds, as one digest (tensors do not travel back from a rank)."""
    h = hashlib.sha256()
    for key, value in sorted(fingerprint(state).items()):
        for v in value if isinstance(value, list) else [value]:
            h.update(
                key.encode() + (v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode())
            )
    return h.hexdigest()


def _ctrl_c_in_the_snapshot(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Both ranks save steps 1 and 2; a Ctrl-C lands on rank 0 while its snapshot of step 2 copies
    the state. The user's code catches it and closes the manager, as rank 1 does at the end."""
    as_node(rank, 1)
    copy = in_place.InPlaceCopies.copy

    def interrupted_copy(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 0 and args[2] == 2:  # (flat, plan, iteration, ...)
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C, as the terminal sends it
        return copy(self, *args, **kwargs)

    in_place.InPlaceCopies.copy = interrupted_copy
    state, events, saved = make_state(rank), [], {}
    manager = TieredCheckpointManager(
        str(root / f"local{rank}"),
        str(root / "persistent"),
        "ctrl-c",
        local_every=1,
        persistent_every=4,
        on_event=events.append,
    )
    interrupted_at = None
    try:
        for step in (1, 2):
            train_step(state, world)
            saved[step] = _digest(state)
            manager.maybe_save(step, state)
    except KeyboardInterrupt:
        interrupted_at = step
    start = time.monotonic()
    manager.close()
    closing = time.monotonic() - start
    return {
        "interrupted_at": interrupted_at,
        "closing": closing,
        "saves": [(e["tier"], e["step"], e["ok"]) for e in events if e["kind"] == "save"],
        "saved": saved,
    }


def _resume(rank: int, world: int, root: Path, saved: list[dict[int, Any]]) -> int | None:
    as_node(rank, 1)
    state = make_state(rank)
    with TieredCheckpointManager(
        str(root / f"local{rank}"), str(root / "persistent"), "ctrl-c", local_every=1
    ) as manager:
        step = manager.restore(state)
    assert _digest(state) == saved[rank][step]  # bit for bit
    return step


def test_a_ctrl_c_in_the_snapshot_stops_the_rank_and_the_save_fails_everywhere(shm_dir):
    outs = run_ranks(_ctrl_c_in_the_snapshot, 2, shm_dir, timeout=180)
    # Before: the snapshot took the KeyboardInterrupt for a failed copy, and training went on.
    assert [o["interrupted_at"] for o in outs] == [2, None]
    for out in outs:
        assert out["saves"] == [("local", 1, True), ("local", 2, False)]
        assert out["closing"] < 30  # the failed save is agreed at once, not at a timeout
    steps = run_ranks(_resume, 2, shm_dir, [o["saved"] for o in outs], timeout=180)
    assert steps == [1, 1]
