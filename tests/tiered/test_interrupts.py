"""A user stopping training while saves are in flight: a Ctrl-C (``KeyboardInterrupt`` on the
training thread) is the user's, never swallowed by a save; the job then stops promptly whether
the user closes the manager or not, and the next job restores the newest committed step."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tierpoint import TieredCheckpointManager
from tierpoint.local import in_place, saving
from tierpoint.testing import run_ranks

from ..asyncsave.test_interrupts import live_workers
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


SLOW_SEAL = 30.0
"""Seconds :func:`slow_seal` takes: far longer than an interrupted close may."""


def slow_seal(*args: Any, **kwargs: Any) -> Any:
    """The local tier's worker job, slowed down (the worker imports it from here)."""
    from tierpoint.local.jobs import seal_staged_part

    time.sleep(SLOW_SEAL)
    return seal_staged_part(*args, **kwargs)


def _ctrl_c_twice(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Step 1 is saved; step 2's save is slow in the worker. A Ctrl-C stops the loop and the
    user's ``finally`` closes the manager, which waits for step 2; the user presses Ctrl-C again."""
    as_node(rank, 1)
    state, events, saved = make_state(rank), [], {}
    manager = TieredCheckpointManager(
        str(root / f"local{rank}"), None, "ctrl-c", local_every=1, on_event=events.append
    )
    for step in (1, 2):
        train_step(state, world)
        saved[step] = _digest(state)
        if step == 2:
            saving.seal_staged_part = slow_seal
        manager.maybe_save(step, state)
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        manager.close()
    except KeyboardInterrupt:
        pass
    return {
        "closing": time.monotonic() - start,
        "workers": live_workers(),
        "saves": [(e["tier"], e["step"], e["ok"]) for e in events if e["kind"] == "save"],
        "saved": saved,
    }


def test_a_second_ctrl_c_while_close_waits_drops_the_save_in_flight(shm_dir):
    # One rank: with two, a peer that is inside a finalize round's all-reduce when its Ctrl-C
    # comes sees it only once that collective ends (gloo blocks in C++), so both wait for it.
    (out,) = run_ranks(_ctrl_c_twice, 1, shm_dir, timeout=240)
    # Before: close() went on waiting for the save (then for the worker's call) after the Ctrl-C.
    assert out["closing"] < SLOW_SEAL / 2
    assert out["workers"] == []
    assert out["saves"] == [("local", 1, True), ("local", 2, False)]
    assert run_ranks(_resume, 1, shm_dir, [out["saved"]], timeout=180) == [1]


def slow_failing_seal(*args: Any, **kwargs: Any) -> Any:
    """The local tier's worker job failing late, as on a full RAM disk (imported by the worker)."""
    time.sleep(2.0)
    raise OSError(28, "No space left on device")


def _wait_past_a_failed_save(rank: int, world: int, root: Path) -> dict[str, Any]:
    """Step 2's local save fails in the worker after step 3's persistent save was scheduled; then
    ``wait()``, as ``final_save`` (a SIGTERM's) and ``restore`` begin."""
    state, events = make_state(rank), []
    manager = TieredCheckpointManager(
        str(root / "local"),
        str(root / "persistent"),
        "wait",
        local_every=2,
        persistent_every=3,
        on_event=events.append,
    )
    for step in (1, 2, 3):
        train_step(state, world)
        if step == 2:
            saving.seal_staged_part = slow_failing_seal
        manager.maybe_save(step, state)
    manager.wait()
    out = {
        "pending": manager.queues.pending(),
        "saves": [(e["tier"], e["step"], e["ok"]) for e in events if e["kind"] == "save"],
    }
    manager.close()
    return out


def test_wait_returns_once_every_save_is_over_also_past_a_failed_one(shm_dir):
    (out,) = run_ranks(_wait_past_a_failed_save, 1, shm_dir, timeout=180)
    # Before: wait() stopped at the failed local save; step 3's persistent save was still in
    # flight when it returned (a SIGTERM's final save then ran beside it).
    assert out["pending"] == 0
    assert out["saves"] == [("local", 2, False), ("persistent", 3, True)]
