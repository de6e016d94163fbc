"""Kills aimed at each phase of each tier, on real 2-rank jobs with a TieredCheckpointManager.

A job (:func:`tiered_job`, run by ``run_ranks``; each rank its own simulated node, so the local
tier replicates each part to the other rank) restores what the previous job left (checked bit for
bit, logged), then saves ``steps`` steps: the local tier every step (keeping 2), the persistent
tier every 2 steps (keeping 2). Every save committed on a rank is logged (``on_event``). The phase
tracer (``hooks/tierpoint_fault_phases.py``) kills one rank, or the whole job, when a chosen
process enters a chosen phase for the n-th time: the snapshot, a tier's write, fsync, rename,
replication, commit or clean-up, or the next job's restore.

The parent (:func:`kill_trial`) runs one job per trial and then checks (:func:`check_disk`,
:func:`check_resumed`):
- no job hung: a rank whose peer was killed raises (within ``TIERPOINT_TIMEOUT``) instead;
- on disk: after a job that ran to its end without a fault nothing waits for clean-up (dirty
  parts, markers, uncommitted steps: a kill may leave its save in flight, removed by the next
  save or commit); the bytes used stay within a fixed bound however many kills came before;
- the next job's restore returns, on both ranks, a step no older than the newest step any job
  logged as committed, bit-equal to what one job saved there.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierpoint import TieredCheckpointManager
from tierpoint.testing import RankFailure, run_ranks

from .jobs import Log, events, own_process_group
from .states import make_state, matches

HOOKS = str(Path(__file__).parent / "hooks")
SETTINGS = {"local_every": 1, "persistent_every": 2, "keep_local": 2, "keep_persistent": 2}
WORLD = 2
STEPS = 6
"""Saves per job (after its restore): 6 local, 3 persistent."""
JOB_ENV = {"TIERPOINT_TIMEOUT": "30", "TIERPOINT_WORKER_NICE": "0"}
"""A peer of a killed rank raises at once (its connections reset); a longer timeout only keeps a
very busy machine (a save slower than the timeout) from failing a job without a fault."""
STOP_TIMEOUT = "5"
"""``TIERPOINT_TIMEOUT`` of a job in which a rank is stopped."""
JOB_TIMEOUT_S = 90.0
MAX_BYTES = 2 << 20
"""Bytes under the roots at most (steady state: about 0.3 MiB)."""


def tiered_job(rank: int, world: int, root: str, job: int, log_dir: str, steps: int) -> None:
    """See the module docstring."""
    own_process_group(rank)
    import tierpoint_fault_phases as phases  # noqa: F401 - on sys.path once installed

    log = Log(log_dir, rank)
    log.write(event="ready", job=job, pid=os.getpid())
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"

    def on_event(record: dict[str, Any]) -> None:
        if record["kind"] == "save" and record["ok"]:
            log.write(event="committed", job=job, tier=record["tier"], step=record["step"])

    base = Path(root)
    manager = TieredCheckpointManager(
        str(base / f"node{rank}"), str(base / "persistent"), "k", on_event=on_event, **SETTINGS
    )
    try:
        state = make_state(rank, 0, job=-1)
        step = manager.restore(state)
        record = manager.last_restore
        equal, saved_by = matches(state, rank, step) if step is not None else (True, -1)
        log.write(
            event="resumed",
            job=job,
            step=step,
            by=saved_by,
            equal=equal,
            tier=record.tier if record else None,
        )
        start = (step or 0) + 1
        for s in range(start, start + steps):
            manager.maybe_save(s, make_state(rank, s, job))
        manager.close()
        log.write(event="done", job=job)
    except BaseException as e:
        log.write(event="failed", job=job, error=f"{type(e).__name__}: {e}"[:500])
        raise


def _job_entry(rank: int, world: int, root: str, job: int, log_dir: str, steps: int) -> None:
    import sys

    sys.path.insert(0, HOOKS)
    import tierpoint_fault_phases as phases

    phases.install_trainer(HOOKS)
    tiered_job(rank, world, root, job, log_dir, steps)


@dataclass
class Trial:
    """One job of a kill run and what came of it."""

    job: int
    kill: dict[str, Any] | None
    killed_in: str | None = None
    """The phase the kill came in (None: the job never reached it and ended normally)."""
    hung: bool = False
    outcome: str = ""
    problems: list[str] = field(default_factory=list)
    stop: dict[str, Any] = field(default_factory=dict)
    """For a SIGSTOP: ``raised_after_s`` (the peer's error after the stop) and ``named`` (whether
    its message names the stopped rank)."""
    seconds: float = 0.0
    pending: int = 0
    """Files waiting for clean-up after the job."""


def _phase_lines(log_dir: Path, job: int) -> list[list[str]]:
    out = []
    for path in (log_dir / f"job{job}").glob("phases-*"):
        out += [line.split() for line in path.read_text().splitlines() if line.strip()]
    return out


def phase_counts(log_dir: Path, job: int) -> dict[tuple[int, str], int]:
    """``(rank, phase) -> times entered`` in ``job`` (any process of the rank)."""
    counts: dict[tuple[int, str], int] = {}
    for parts in _phase_lines(log_dir, job):
        if len(parts) >= 4 and parts[2] != "kill":
            key = (int(parts[0]), parts[2])
            counts[key] = counts.get(key, 0) + 1
    return counts


def kill_trial(
    root: Path, log_dir: Path, job: int, kill: dict[str, Any] | None, steps: int = STEPS
) -> Trial:
    """Run job ``job`` (killed as ``kill`` says, or not), then check the disk and what the job's
    restore found against what earlier jobs committed."""
    trial = Trial(job, kill)
    phase_dir = log_dir / f"job{job}"
    phase_dir.mkdir(parents=True, exist_ok=True)
    env = {**JOB_ENV, "TIERPOINT_FAULT_PHASES": json.dumps({"log": str(phase_dir), "kill": kill})}
    if kill is not None and kill["scope"] == "stop":
        env["TIERPOINT_TIMEOUT"] = STOP_TIMEOUT  # the peer of a stopped rank waits this long
    start = time.monotonic()
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            run_ranks(
                _job_entry,
                WORLD,
                str(root),
                job,
                str(log_dir),
                steps,
                timeout=JOB_TIMEOUT_S,
                env=env,
                allow_crash={0, 1},
            )
        except BaseException as e:  # noqa: BLE001 - examined below
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if kill is not None and kill["scope"] == "stop":
        trial.problems += _watch_stopped(log_dir, job, kill["rank"], thread, trial.stop)
    thread.join(JOB_TIMEOUT_S + 30)
    error = box.get("error")
    if error is None:
        trial.outcome = "completed"
    elif isinstance(error, RankFailure):
        trial.hung = "hung" in str(error)
        trial.outcome = "hung" if trial.hung else "peer raised"
        if trial.hung:
            trial.problems.append(f"job {job} ({kill}): a rank hung: {error}"[:2000])
    else:
        raise error
    trial.seconds = time.monotonic() - start
    killed = [p for p in _phase_lines(log_dir, job) if len(p) >= 4 and p[2] == "kill"]
    trial.killed_in = killed[0][3] if killed else None
    if kill is not None and trial.killed_in is None:
        trial.outcome = "not reached"
    elif trial.killed_in is not None and trial.outcome == "completed":
        trial.outcome = "killed"  # the whole job: no rank left to report
    all_events = events(log_dir)
    failed = [
        e
        for e in all_events
        if e["job"] == job and e["event"] == "failed" and trial.killed_in is None
    ]
    if failed:
        trial.problems.append(f"job {job} failed without a kill: {failed}")
    trial.problems += check_resumed(all_events, job)
    trial.pending = len(pending_files(root))
    trial.problems += check_disk(root, clean=kill is None and trial.outcome == "completed")
    return trial


def _watch_stopped(
    log_dir: Path, job: int, stopped: int, thread: threading.Thread, seen: dict[str, Any]
) -> list[str]:
    """A rank was SIGSTOPped: the other must raise within the timeout (how long it took and whether
    it named the stopped rank go into ``seen``), unless it had nothing left to wait for (it ended
    its job: a rank stopped in the clean-up after its last commit); then the stopped rank is
    killed (its worker dies with it)."""
    timeout = float(STOP_TIMEOUT)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    stopped_at = None
    while time.monotonic() < deadline and thread.is_alive():
        notes = [p for p in _phase_lines(log_dir, job) if len(p) >= 6 and p[2] == "kill"]
        if notes:
            stopped_at = float(notes[0][5])
            break
        time.sleep(0.05)
    if stopped_at is None:
        return []  # never reached: the job ends by itself
    failed = None
    while time.monotonic() < deadline and failed is None:
        failed = next(
            (
                e
                for e in events(log_dir)
                if e["job"] == job and e["event"] in ("failed", "done") and e["rank"] != stopped
            ),
            None,
        )
        time.sleep(0.05)
    ready = [e for e in events(log_dir) if e["job"] == job and e["event"] == "ready"]
    for e in ready:
        if e["rank"] == stopped:
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    if failed is None:
        return [f"job {job}: rank {stopped} stopped, the other rank did not raise (a hang)"]
    problems: list[str] = []
    if failed["event"] == "done":  # the peer finished its job without needing the stopped rank
        seen["peer_done"] = True
        return problems
    seen["raised_after_s"] = waited = round(failed["t"] - stopped_at, 2)
    seen["named"] = f"rank {stopped}" in failed["error"] or f"ranks {stopped}" in failed["error"]
    seen["error"] = failed["error"][:300]
    if waited > 3 * timeout + 10:
        problems.append(f"job {job}: the peer of stopped rank {stopped} raised after {waited} s")
    return problems


def newest_committed(all_events: list[dict[str, Any]], before_job: int) -> int:
    return max(
        (e["step"] for e in all_events if e["event"] == "committed" and e["job"] < before_job),
        default=-1,
    )


def check_resumed(all_events: list[dict[str, Any]], job: int) -> list[str]:
    """The restore of ``job`` (if it finished on both ranks): the same step on both ranks, saved by
    one job, bit-equal, no older than anything committed before."""
    resumed = [e for e in all_events if e["job"] == job and e["event"] == "resumed"]
    if len(resumed) < WORLD:
        return []  # killed during its restore
    problems = []
    steps = {(e["step"], e["by"]) for e in resumed}
    if len(steps) != 1:
        problems.append(f"job {job}: ranks restored different steps / jobs: {steps}")
    for e in resumed:
        if not e["equal"]:
            problems.append(f"job {job}: rank {e['rank']} restored step {e['step']} NOT bit-equal")
    newest = newest_committed(all_events, job)
    got = resumed[0]["step"] if resumed[0]["step"] is not None else -1
    if got < newest:
        problems.append(f"job {job}: restored step {got}, but step {newest} had been committed")
    return problems


def pending_files(root: Path) -> list[str]:
    """Files left for clean-up: dirty parts, markers, data of steps without ``.metadata``."""
    out = [str(p) for p in root.rglob("*.dirty")]
    persistent = root / "persistent"
    if persistent.is_dir():
        for step in persistent.iterdir():
            names = os.listdir(step) if step.is_dir() else []
            out += [str(step / n) for n in names if n.startswith(".unfinished-")]
            if ".metadata" not in names:
                out += [str(step / n) for n in names if n.endswith(".distcp")]
    return out


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def check_disk(root: Path, clean: bool) -> list[str]:
    """After a job that ran to its end without a fault (``clean``) nothing waits for clean-up; after
    any job the bytes under the roots stay bounded. (A killed job may leave its save in flight: an
    uncommitted persistent step stays until a newer step is committed, dirty parts until the next
    save.)"""
    problems = []
    pending = pending_files(root)
    if clean and pending:
        problems.append(f"{len(pending)} files wait for clean-up after a clean job: {pending}")
    used = disk_bytes(root)
    if used > MAX_BYTES:
        problems.append(f"{used} bytes used under {root} (bound {MAX_BYTES})")
    return problems
