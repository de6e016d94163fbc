"""Corruption trials on a real 2-rank job (each rank its own simulated node), many per job.

:func:`corruption_trials` (run by :func:`tierpoint.testing.run_ranks`) saves steps 1..6 as a
:class:`~tierpoint.TieredCheckpointManager` lays them out (local tier every step, replicated to the
other node, keeping 2; persistent tier every 2 steps, keeping 2: local steps 5 and 6 in two copies
each, persistent steps 4 and 6; written synchronously, see :func:`_save_in_process`), then for each seed: rank 0 draws and applies one mutation
(:mod:`.corruptions`) and reads the damaged file through tierpoint's checks; both ranks restore
with the tiered manager and with a manager of the persistent tier alone; the damage is undone.
One JSON line per trial goes to ``<log>`` as it ends (a hung trial is the seed after the last line).

What each trial must show (checked by the caller with :func:`problems`):
- the damaged file's outcome is never ``silent``;
- the tiered restore returns step 6 (every file has an intact copy: the other node's replica of a
  part, the local tier for a persistent file) and the persistent-only restore step 6, or step 4
  when the damage (not harmless) is in step 6; each bit-equal on every rank to what was saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tierpoint import TieredCheckpointManager, dcp
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp.step_dirs import step_path
from tierpoint.errors import CheckpointingError
from tierpoint.local import CliqueReplicationStrategy, LocalCheckpointManager
from tierpoint.tensor_aware import BasicTensorAwareStateDict
from tierpoint.testing import run_ranks
from tierpoint.tiered import state as st
from tierpoint.tiered.retention import retire_persistent_steps

from . import corruptions as cx
from .states import make_state, matches

STEPS = 6
NEWEST, OLDER = 6, 4
SETTINGS = {"local_every": 1, "persistent_every": 2, "keep_local": 2, "keep_persistent": 2}


def _manager(root: Path, rank: int, local: bool = True) -> TieredCheckpointManager:
    if not local:
        return TieredCheckpointManager(
            None, str(root / "persistent"), "s", **{**SETTINGS, "local_every": 0}
        )
    return TieredCheckpointManager(
        str(root / f"node{rank}"), str(root / "persistent"), "s", **SETTINGS
    )


@contextlib.contextmanager
def _without_worker() -> Iterator[None]:
    """Managers made here start no background worker: a restore needs none, and closing a manager
    waits for its worker to have started (it imports torch: seconds per trial on a busy machine)."""
    original = AsyncCallsQueue._new_worker
    AsyncCallsQueue._new_worker = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        AsyncCallsQueue._new_worker = original  # type: ignore[method-assign]


def _restore(root: Path, rank: int, local: bool) -> dict[str, Any]:
    state = make_state(rank, 0, job=-1)
    with _without_worker():
        manager = _manager(root, rank, local)
    with manager:
        try:
            step = manager.restore(state)
        except CheckpointingError as e:  # every step damaged: said, not "nothing to restore"
            if "none could be restored" not in str(e):
                raise
            return {"step": None, "tier": None, "equal": False, "refused": True}
        if manager.local is not None:
            manager.local.wait_for_restore()
        record = manager.last_restore
    ok, job = matches(state, rank, step) if step is not None else (False, -1)
    got = {"step": step, "tier": record.tier if record else None, "equal": ok and job == 0}
    if step is not None and not got["equal"]:  # what was loaded instead, for the report
        got["holds"] = [s for s in range(1, STEPS + 1) if matches(state, rank, s)[0]]
        got["skipped"] = record.skipped if record else None
    return got


def _save_in_process(base: Path, rank: int) -> None:
    """Steps 1..6 as the tiered manager with :data:`SETTINGS` lays them out (the local tier's form
    of the state, replicated to the other node, keeping 2; the persistent form every 2 steps,
    keeping 2), written synchronously: no background worker to start (it imports torch: seconds
    per job). The kill tests cover the manager's own saves."""
    local = LocalCheckpointManager(
        str(base / f"node{rank}"), "s", CliqueReplicationStrategy(None, 2), keep_last=2
    )
    persistent = str(base / "persistent")
    for step in range(1, STEPS + 1):
        tree = st.template(make_state(rank, step, job=0))
        local.save(BasicTensorAwareStateDict(st.local_form(tree)), step)
        if step % SETTINGS["persistent_every"] == 0:
            dcp.save(st.persistent_form(tree, rank), step_path(persistent, step))
            if rank == 0:
                retire_persistent_steps(persistent, SETTINGS["keep_persistent"])
    dist.barrier()


def run_corruption_trials(
    root: str | os.PathLike, seeds: list[int], log: str | os.PathLike, timeout: float
) -> list[list[dict[str, Any]]]:
    """:func:`corruption_trials` on 2 real ranks (each its own simulated node); every rank's
    records, in rank order. The one launcher of the CI test and the long runner."""
    return run_ranks(
        corruption_trials,
        2,
        str(root),
        list(seeds),
        str(log),
        timeout=timeout,
        env={"TIERPOINT_TIMEOUT": "20"},
    )


def corruption_trials(
    rank: int, world: int, root: str, seeds: list[int], log: str, kinds: tuple[str, ...] = cx.KINDS
) -> list[dict[str, Any]]:
    """See the module docstring. Returns this rank's restores, one dict per seed."""
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"
    base = Path(root)
    _save_in_process(base, rank)
    out = []
    for seed in seeds:
        start = time.monotonic()
        box: list[Any] = [None]
        if rank == 0:
            box[0] = cx.draw(seed, cx.catalogue(base), base, kinds).__dict__
        dist.broadcast_object_list(box, src=0)
        m = cx.Mutation(**box[0])
        # Reading a DCP step is collective (both ranks read it); a part is read by rank 0 alone.
        reads = rank == 0 or m.file_kind != "part"
        undo = None
        before = cx.read_values(base / m.target, base) if reads and m.kind != "plant" else None
        dist.barrier()
        if rank == 0:
            undo = cx.apply(m, base)
        dist.barrier()
        outcome, reason = "", ""
        if m.kind == "plant":
            outcome, reason = "detected", "a stale marker: the step no longer counts as complete"
            if cx.read_values(base / m.target, base) is not None:
                outcome, reason = "silent", "a step with a marker still counts as complete"
        elif reads:
            outcome, reason = cx.inspect(m, base, before)
        box = [(outcome, reason)]
        dist.broadcast_object_list(box, src=0)
        outcome, reason = box[0]
        trial = {"mutation": m.__dict__, "outcome": outcome, "reason": reason[:300]}
        tiered = _restore(base, rank, local=True)
        persistent = _restore(base, rank, local=False)
        dist.barrier()
        if undo is not None:
            undo()
        dist.barrier()
        record = {**trial, "seed": seed, "rank": rank, "tiered": tiered, "persistent": persistent}
        record["seconds"] = time.monotonic() - start
        if rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
        out.append(record)
    return out


def expected_steps(record: dict[str, Any]) -> tuple[int, int | None]:
    """The steps the tiered and the persistent-only restore must return for a trial: a damaged
    persistent step is skipped (a swap between steps damages both); the local tier always has an
    intact copy of each part (the other node's), and a step at least as new as the persistent one."""
    m = cx.Mutation(**record["mutation"])
    if record["outcome"] == "harmless" or m.file_kind == "part":
        return NEWEST, NEWEST
    damaged = {cx.step_of_file(Path(p)) for p in (m.target, m.partner) if p is not None}
    intact = [s for s in (NEWEST, OLDER) if s not in damaged]
    return NEWEST, intact[0] if intact else None


def problems(records: list[dict[str, Any]]) -> list[str]:
    """What went wrong in the trials (empty: nothing), each naming its seed."""
    bad = []
    for r in records:
        m = cx.Mutation(**r["mutation"])
        if r["outcome"] == "silent":
            bad.append(f"{m.describe()}: SILENT: {r['reason']}")
        tiered, persistent = expected_steps(r)
        for name, want in (("tiered", tiered), ("persistent", persistent)):
            got = r[name]
            refused = want is None and not got.get("refused")  # None: restore must refuse
            if got["step"] != want or (want is not None and not got["equal"]) or refused:
                bad.append(
                    f"{m.describe()} ({r['outcome']}): rank {r['rank']}'s {name} restore gave "
                    f"step {got['step']} from {got['tier']} (bit-equal: {got['equal']}), "
                    f"expected step {want}"
                )
    return bad
