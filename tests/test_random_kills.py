"""Whole jobs SIGKILLed at random moments never break either tier's promises.

A job is 2 real gloo ranks (``run_ranks``, on a thread of the test) on two simulated nodes, each
with its own local root; the local tier (in RAM, as by default) replicates with jump 1, factor 2,
so each rank holds the other's replica. At a random half of the relaunches the ranks swap nodes
(as a rendezvous may number them anew): a rank's newest parts then lie in the directory of a rank
now on the other node, and its own directory on the node it left is left behind. The job makes itself one process group (both ranks and the async worker processes they
start), resumes from what the previous job left, then saves every iteration asynchronously to both
tiers (``LocalCheckpointManager.save(is_async=True)`` and ``dcp.async_save_request`` into
``<base>/step-<N>``, through one ``AsyncCallsQueue``), appending each iteration it finalized to a
log file (fsynced). The test SIGKILLs the whole group after a random delay drawn from a seeded RNG,
then checks:

- right after the kill, on disk: every local file under a committed part name is complete (every
  checksum holds) and holds the state saved under that name, and the copies of the parts of a
  complete local iteration all come from one job (never a killed job's leftover next to a later
  job's part); every DCP step that counts as complete loads bit-equal to what one job saved there;
- on relaunch (each next job, then a last one that only loads): ``find_latest()`` + ``load()`` and
  ``get_latest_complete_checkpoint()`` + ``dcp.load()`` return, on every rank alike, a state
  bit-equal to what one job saved at that iteration, no older than the newest iteration any killed
  job logged as finalized.

Every state is a function of (rank, iteration, job number) and carries its job number, so the parts
of one iteration saved by two jobs are told apart. Each run draws a new seed, named in every
assertion message; ``TIERPOINT_KILL_SEED`` replays its kill times (the races they hit depend on
timing too), ``TIERPOINT_KILL_JOBS`` kills more jobs in a longer run.

A fixed case forces a mix that these job numbers reveal but random kills rarely hit: a part left by
a killed job completing, together with a later job's part of the other rank, an iteration that
neither job finished.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierpoint import dcp, fileformat
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp.step_dirs import METADATA_NAME, complete_steps, local_view, step_of
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.local.naming import parse_part_name, part_name
from tierpoint.testing import run_ranks

from .fault.jobs import Log as _Log
from .fault.jobs import events as _events
from .fault.jobs import own_process_group as _own_process_group
from .local.helpers import assert_bitwise_equal

WORLD = 2
SESSION = "kills"
NUMEL = 1 << 19  # 2 MiB of float32 + 0.5 MiB of bfloat16 per rank and tier
JOBS = int(os.environ.get("TIERPOINT_KILL_JOBS", 4))
"""Jobs killed per run: 7-9 s each on 2 cores (mostly starting processes that import torch)."""
MAX_DELAY_S = 3.0
"""A kill comes uniformly within this long after the job is ready (its workers started): it covers
the resume, the first saves (the first DCP save takes about 1.5 s) and a dozen later ones."""
MAX_ITERATIONS = 10_000
"""Saves a job makes if it is not killed first (it always is)."""
JOB_TIMEOUT_S = 120.0
JOB_ENV = {"TIERPOINT_TIMEOUT": "30"}


# ------------------------------------------------------------------------------------ states


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(NUMEL, generator=g),
        "h": torch.randn(NUMEL // 4, generator=g).to(torch.bfloat16),
    }


def local_state(rank: int, iteration: int, job: int) -> dict[str, Any]:
    """What ``job`` saves as ``rank``'s local part of ``iteration``."""
    seed = ((job * 100_003 + iteration) * WORLD + rank) * 2
    return {"model": _tensors(seed), "iteration": iteration, "rank": rank, "job": job}


def dcp_state(rank: int, step: int, job: int) -> dict[str, Any]:
    """``rank``'s share of what ``job`` saves as DCP ``step`` (keys of its own: no resharding)."""
    seed = ((job * 100_003 + step) * WORLD + rank) * 2 + 1
    return {f"rank{rank}": {**_tensors(seed), "job": job}, "step": step}


def _dcp_template(ranks: range | list[int]) -> dict[str, Any]:
    template: dict[str, Any] = {"step": -1}
    for r in ranks:
        template[f"rank{r}"] = {
            "w": torch.empty(NUMEL),
            "h": torch.empty(NUMEL // 4, dtype=torch.bfloat16),
            "job": -1,
        }
    return template


# ------------------------------------------------------------------------------------ the job


def _manager(rank: int, root: str, nodes: tuple[int, ...] = (0, 1)) -> LocalCheckpointManager:
    """``rank``'s manager on node ``nodes[rank]``, whose local root is ``root/node<n>``."""
    node = f"node{nodes[rank]}"
    os.environ["TIERPOINT_NODE_ID"] = node  # two nodes: the replicas go to the other
    strategy = CliqueReplicationStrategy.from_replication_params(
        replication_jump=1, replication_factor=2
    )
    return LocalCheckpointManager(Path(root) / node, session_id=SESSION, repl_strategy=strategy)


def _resume(rank: int, manager: LocalCheckpointManager, base: str) -> dict[str, Any]:
    """Find and load the latest checkpoint of each tier, checked bit for bit against what the job
    that saved it saved: ``{"local": [iteration, job], "dcp": [step, job]}`` (-1: none)."""
    found: dict[str, Any] = {"local": [-1, -1], "dcp": [-1, -1]}
    iteration = manager.find_latest()
    if iteration != -1:
        ta, ckpt_id = manager.load()
        state = ta.state_dict
        job = state["job"]
        assert ckpt_id.iteration == iteration and state["iteration"] == iteration
        assert_bitwise_equal(state, local_state(rank, iteration, job))
        found["local"] = [iteration, job]
    latest = dcp.get_latest_complete_checkpoint(base)
    if latest is not None:
        step = step_of(os.path.basename(latest))
        assert step is not None
        loaded = _dcp_template([rank])
        dcp.load(loaded, latest)
        job = loaded[f"rank{rank}"]["job"]
        assert loaded["step"] == step
        assert_bitwise_equal(loaded[f"rank{rank}"], dcp_state(rank, step, job)[f"rank{rank}"])
        found["dcp"] = [step, job]
    return found


def _prune_steps(base: str, below: int) -> None:
    """Retention for the DCP tier (rank 0): un-commit each older step first, then remove it."""
    for name in os.listdir(base):
        step = step_of(name)
        if step is None or step >= below:
            continue
        path = os.path.join(base, name)
        try:
            os.unlink(os.path.join(path, METADATA_NAME))
            fileformat.fsync_dir(path)
        except FileNotFoundError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def _job(rank: int, world: int, roots: dict[str, str], job: int, log_dir: str) -> None:
    """Resume, then save every iteration to both tiers until killed."""
    _own_process_group(rank)
    log = _Log(log_dir, rank)
    try:
        manager = _manager(rank, roots["local"], roots["nodes"])
        queue = AsyncCallsQueue(max_in_flight=2)  # a local and a DCP save in flight at once
        queue.wait_ready()
        dist.barrier()  # every process of the job is in its group now
        log.write(event="ready", job=job, pgid=os.getpgid(0))
        found = _resume(rank, manager, roots["dcp"])
        log.write(event="resumed", job=job, **found)
        start = max(found["local"][0], found["dcp"][0]) + 1
        for it in range(start, start + MAX_ITERATIONS):
            _save_both(rank, manager, queue, roots["dcp"], job, it, log)
        queue.close()
    except BaseException:
        log.write(event="failed", job=job, error=traceback.format_exc())
        raise


def _save_both(
    rank: int,
    manager: LocalCheckpointManager,
    queue: AsyncCallsQueue,
    base: str,
    job: int,
    it: int,
    log: _Log,
) -> None:
    """Schedule iteration ``it``'s async saves of both tiers; log each when it is finalized."""
    request = manager.save(BasicTensorAwareStateDict(local_state(rank, it, job)), it, is_async=True)
    request.add_finalize_fn(lambda: log.write(event="local", job=job, iteration=it))
    queue.schedule_async_request(request)
    request = dcp.async_save_request(dcp_state(rank, it, job), dcp.step_path(base, it))

    def finalized() -> None:
        log.write(event="dcp", job=job, iteration=it)
        if rank == 0:
            _prune_steps(base, it)

    request.add_finalize_fn(finalized)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=False)


def _verify(rank: int, world: int, roots: dict[str, str]) -> dict[str, Any]:
    """The last relaunch: find and load the latest checkpoints (checked), nothing more."""
    manager = _manager(rank, roots["local"], roots["nodes"])
    found = _resume(rank, manager, roots["dcp"])
    manager.wait_for_restore()  # before run_ranks destroys the process group
    return found


# ------------------------------------------------------------------------------------ the parent


def _newest_finalized(events: list[dict[str, Any]], tier: str) -> int:
    return max((e["iteration"] for e in events if e["event"] == tier), default=-1)


def _check_found(found: list[dict[str, Any]], events: list[dict[str, Any]], why: str) -> None:
    """Every rank found the same checkpoint, saved by one job, no older than anything finalized."""
    for tier in ("local", "dcp"):
        seen = {tuple(f[tier]) for f in found}
        assert len(seen) == 1, f"{why}: ranks found different {tier} checkpoints {seen}"
        ((iteration, _),) = seen
        newest = _newest_finalized(events, tier)
        assert iteration >= newest, (
            f"{why}: the {tier} tier resumed from {iteration}, but iteration {newest} had been "
            "finalized"
        )


def _assert_bitwise(got: object, expected: object, why: str) -> None:
    try:
        assert_bitwise_equal(got, expected)
    except AssertionError as e:
        raise AssertionError(f"{why}: not what was saved there") from e


def _check_local_files(root: Path, why: str, nodes: tuple[int, ...] = (0, 1)) -> None:
    """Every committed part name holds a complete part with the state saved under it, and every
    copy of every part of an iteration complete in the directories of the job's ranks (on the
    nodes ``nodes`` gives them) was saved by the same job. (The directories its ranks left behind
    on other nodes may hold a killed job's parts of an iteration the job saved again: they are
    retired by the job's commits, and a load never takes parts of two saves: their tokens differ.)"""
    jobs: dict[int, dict[int, set[int]]] = {}  # iteration -> origin -> jobs of its copies
    live = {root / f"node{nodes[r]}" / SESSION / str(r) for r in range(WORLD)}
    for holder_dir in sorted(root.glob(f"node*/{SESSION}/*")):
        if not holder_dir.is_dir():
            continue  # (<rank>.node: the node a rank's directory was last saved from)
        for entry in sorted(os.listdir(holder_dir)):
            parsed = parse_part_name(entry)
            if parsed is None:
                continue
            iteration, origin = parsed
            path = holder_dir / entry
            try:
                fileformat.verify(path)
                state = fileformat.read(path)
            except Exception as e:  # noqa: BLE001 - reported with the seed
                raise AssertionError(f"{why}: {path} is visible but broken: {e}") from e
            _assert_bitwise(state, local_state(origin, iteration, state["job"]), f"{why}: {path}")
            if holder_dir in live:
                jobs.setdefault(iteration, {}).setdefault(origin, set()).add(state["job"])
    for iteration, origins in sorted(jobs.items()):
        if set(origins) >= set(range(WORLD)):
            assert len(set().union(*origins.values())) == 1, (
                f"{why}: local iteration {iteration} counts as complete, but its copies come from "
                f"different jobs: {origins}"
            )


def _check_dcp_steps(base: Path, why: str) -> None:
    """Every step that counts as complete loads bit-equal to what one job saved there."""
    if not base.is_dir():
        return
    for step in complete_steps([local_view(base)]):
        loaded = _dcp_template(range(WORLD))
        try:
            dcp.load(loaded, dcp.step_path(base, step))
        except Exception as e:  # noqa: BLE001 - reported with the seed
            raise AssertionError(f"{why}: DCP step {step} counts as complete but: {e}") from e
        jobs = {loaded[f"rank{r}"]["job"] for r in range(WORLD)}
        assert len(jobs) == 1, f"{why}: DCP step {step} mixes the saves of jobs {jobs}"
        (job,) = jobs
        expected = [dcp_state(r, step, job)[f"rank{r}"] for r in range(WORLD)]
        got = [loaded[f"rank{r}"] for r in range(WORLD)]
        _assert_bitwise([loaded["step"], *got], [step, *expected], f"{why}: DCP step {step}")


class _Job:
    """One job (2 ranks through ``run_ranks``) run on a thread of the test, killed as a whole."""

    def __init__(self, roots: dict[str, str], job: int, log_dir: Path) -> None:
        self.job, self.log_dir = job, log_dir
        self.error: BaseException | None = None
        self.pgid: int | None = None
        self.thread = threading.Thread(target=self._run, args=(roots,), daemon=True)
        self.thread.start()

    def _run(self, roots: dict[str, str]) -> None:
        try:
            run_ranks(
                _job,
                WORLD,
                roots,
                self.job,
                str(self.log_dir),
                timeout=JOB_TIMEOUT_S,
                env=JOB_ENV,
                allow_crash={0, 1},  # killed ranks report nothing
            )
        except BaseException as e:  # noqa: BLE001 - raised by the test's thread
            self.error = e

    def wait_until_ready(self, why: str) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            ready = [
                e for e in _events(self.log_dir) if e["job"] == self.job and e["event"] == "ready"
            ]
            if len(ready) == WORLD:
                self.pgid = ready[0]["pgid"]
                return
            if not self.thread.is_alive():
                raise AssertionError(f"{why}: the job ended before it was ready: {self.error}")
            time.sleep(0.01)
        raise AssertionError(f"{why}: the job was not ready within {JOB_TIMEOUT_S} s")

    def kill(self) -> None:
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.thread.join(JOB_TIMEOUT_S)  # run_ranks kills what is left at its own timeout
        assert not self.thread.is_alive(), "run_ranks did not return"


def test_jobs_killed_at_random_moments_resume_from_a_complete_checkpoint(tmp_path: Path) -> None:
    seed = int(os.environ.get("TIERPOINT_KILL_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    # The local tier where it lives by default: in RAM (async snapshots go into the part files).
    local = Path(tempfile.mkdtemp(prefix="tierpoint-test-kills-", dir="/dev/shm"))
    roots: dict[str, Any] = {"local": str(local), "dcp": str(tmp_path / "dcp")}
    log_dir = tmp_path / "logs"
    try:
        for job in range(JOBS):
            why = f"seed {seed} (TIERPOINT_KILL_SEED), job {job}"
            delay = rng.uniform(0.0, MAX_DELAY_S)
            # The ranks swap nodes at some relaunches (numbered anew at a rendezvous): the newest
            # parts lie in the directories of ranks now on the other node, adopted from there, and
            # the directories left behind are retired by the job's saves.
            roots["nodes"] = (1, 0) if rng.random() < 0.5 else (0, 1)
            why += f", nodes {roots['nodes']}"
            running = _Job(roots, job, log_dir)
            try:
                running.wait_until_ready(why)
                time.sleep(delay)
            finally:
                running.kill()
            why += f" killed {delay:.3f} s after it was ready"
            events = _events(log_dir)
            failed = [e["error"] for e in events if e["job"] == job and e["event"] == "failed"]
            assert not failed and running.error is None, (
                f"{why}: the job failed: {running.error}\n" + "\n".join(failed)
            )
            found = [e for e in events if e["job"] == job and e["event"] == "resumed"]
            if len(found) == WORLD:
                _check_found(found, [e for e in events if e["job"] < job], why)
            _check_local_files(local, why, roots["nodes"])
            _check_dcp_steps(Path(roots["dcp"]), why)
        roots["nodes"] = (1, 0) if rng.random() < 0.5 else (0, 1)
        why = f"seed {seed} (TIERPOINT_KILL_SEED), the last relaunch, nodes {roots['nodes']}"
        try:
            found = run_ranks(_verify, WORLD, roots, env=JOB_ENV)
        except AssertionError as e:
            raise AssertionError(f"{why}: {e}") from e
        _check_found(found, _events(log_dir), why)
    finally:
        shutil.rmtree(local, ignore_errors=True)


# ------------------------------------------------------------------------------------ a fixed case


def _one_rank_stalls(rank: int, world: int, root: str, job: int, iteration: int, slow: int) -> None:
    """Resume, save up to ``iteration`` - 1, then ``iteration`` with rank ``slow`` stalled before
    it writes; it kills the whole job as soon as its peer's part of ``iteration`` is committed."""
    _own_process_group(rank)
    manager = _manager(rank, root)
    latest = manager.find_latest()
    if latest != -1:
        manager.load()
    for it in range(latest + 1, iteration):
        manager.save(BasicTensorAwareStateDict(local_state(rank, it, job)), it)
    if rank == slow:
        peer = Path(root) / f"node{1 - rank}" / SESSION / str(1 - rank)
        peer /= part_name(iteration, 1 - rank)

        def stalled_write(*args: Any, **kwargs: Any) -> None:
            deadline = time.monotonic() + 60
            while not peer.exists() and time.monotonic() < deadline:
                time.sleep(0.002)
            os.killpg(0, signal.SIGKILL)

        fileformat.write_flat = stalled_write  # this rank's process only
    manager.save(BasicTensorAwareStateDict(local_state(rank, iteration, job)), iteration)


def test_a_part_left_by_a_killed_job_never_completes_a_later_jobs_iteration(tmp_path: Path) -> None:
    """Job 0 dies with only rank 0's part of iteration 2 committed; job 1 resumes from 1 and dies
    with only rank 1's new part of 2 committed: iteration 2 must not count as complete (it would
    load rank 0's state of job 0 with rank 1's of job 1)."""
    root = str(tmp_path / "local")
    for job, slow in ((0, 1), (1, 0)):
        run_ranks(_one_rank_stalls, WORLD, root, job, 2, slow, allow_crash={0, 1}, env=JOB_ENV)
        _check_local_files(Path(root), f"after job {job}")
    roots = {"local": root, "dcp": str(tmp_path / "dcp"), "nodes": (0, 1)}
    found = run_ranks(_verify, WORLD, roots, env=JOB_ENV)
    assert [f["local"] for f in found] == [[1, 0]] * WORLD  # saved by job 0, the only complete one
