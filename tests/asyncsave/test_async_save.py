"""Asynchronous local saves on real gloo ranks: equivalence with sync saves, no torn snapshots,
worker death, abort, back-pressure, flat memory."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tierpoint import fileformat, storage
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from tierpoint.asyncsave.request import Commit
from tierpoint.errors import CheckpointingError
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CliqueReplicationStrategy,
    LocalCheckpointManager,
)
from tierpoint.staging import in_memory_filesystem
from tierpoint.testing import run_ranks

from ..mounts import small_tmpfs
from .orphans import assert_worker_dies_with_trainer

WORLD = 4


def make_state(rank: int, iteration: int, numel: int = 4096) -> dict:
    g = torch.Generator().manual_seed(rank * 100_000 + iteration)
    return {
        "model": {
            "w": torch.randn(numel, generator=g),
            "h": torch.randn(16, 8, generator=g).half(),
        },
        "optimizer": {"step": iteration, "m": [torch.randn(numel // 4, generator=g)]},
    }


def flat_bytes(state: dict) -> list[bytes]:
    flat = BasicTensorAwareStateDict(state).tensors
    return [bytes(fileformat.byte_view(t.contiguous())) for t in flat]


def _async_equals_sync(rank: int, world: int, root: str) -> bool:
    state = make_state(rank, 1)
    sync = LocalCheckpointManager(os.path.join(root, "sync"), session_id="j")
    sync.save(BasicTensorAwareStateDict(state), 1)
    queue = AsyncCallsQueue()
    asyn = LocalCheckpointManager(os.path.join(root, "async"), session_id="j")
    queue.schedule_async_request(asyn.save(BasicTensorAwareStateDict(state), 1, is_async=True))
    queue.close()
    a, _ = LocalCheckpointManager(os.path.join(root, "async"), session_id="j").load()
    s, _ = LocalCheckpointManager(os.path.join(root, "sync"), session_id="j").load()
    return (
        flat_bytes(a.state_dict) == flat_bytes(s.state_dict)
        and a.state_dict["optimizer"]["step"] == 1
    )


def test_async_and_sync_saves_load_identically(tier_root):
    assert run_ranks(_async_equals_sync, WORLD, str(tier_root)) == [True] * WORLD


def _hundred_saves(rank: int, world: int, root: str) -> int:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue()
    live = make_state(rank, 0)
    checked = 0
    for it in range(1, 101):
        expected = make_state(rank, it)
        for t, e in zip(
            BasicTensorAwareStateDict(live).tensors, BasicTensorAwareStateDict(expected).tensors
        ):
            t.copy_(e)
        live["optimizer"]["step"] = it
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(live), it, is_async=True)
        )
        for t in BasicTensorAwareStateDict(live).tensors:
            t.fill_(-1)  # the training step changes everything right after the snapshot
        queue.maybe_finalize_async_calls(blocking=True)
        stored = fileformat.read(manager.local_ckpt_dir / f"iter_{it:07d}_{rank}_local.safetensors")
        assert flat_bytes(stored) == flat_bytes(expected), f"iteration {it} is torn or stale"
        assert stored["optimizer"]["step"] == it
        checked += 1
    queue.close()
    return checked


def test_hundred_async_saves_each_hold_their_snapshot(tier_root):
    assert run_ranks(_hundred_saves, WORLD, str(tier_root), timeout=300) == [100] * WORLD


def _finalize_timed(queue: AsyncCallsQueue) -> tuple[str, float]:
    """A blocking finalize: the error it raised (or "no error") and the seconds it took."""
    start = time.monotonic()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = "no error"
    except CheckpointingError as e:
        error = str(e)
    return error, time.monotonic() - start


def _kill_worker_mid_save(rank: int, world: int, root: str) -> dict:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue(timeout=60)
    big = make_state(rank, 1, numel=8 << 20)  # 32 MiB: the write takes a while
    queue.schedule_async_request(manager.save(BasicTensorAwareStateDict(big), 1, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    if rank == 1:  # stopped first, so that the save is surely in flight when the worker dies
        os.kill(queue._worker.process.pid, signal.SIGSTOP)
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 2, 8 << 20)), 2, is_async=True)
    )
    if rank == 1:
        os.kill(queue._worker.process.pid, signal.SIGKILL)
    error, seconds = _finalize_timed(queue)
    latest = LocalCheckpointManager(root, session_id="j").find_latest()
    # The next save works: a new worker is started.
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 3, is_async=True)
    )
    queue.close()
    ta, _ = LocalCheckpointManager(root, session_id="j").load()
    return {
        "error": error,
        "seconds": seconds,
        "latest_after_failure": latest,
        "final_ok": flat_bytes(ta.state_dict) == flat_bytes(make_state(rank, 3)),
    }


def test_killed_worker_fails_the_save_on_every_rank_and_the_next_save_works(tier_root):
    results = run_ranks(_kill_worker_mid_save, WORLD, str(tier_root), timeout=300)
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    (error,) = errors
    assert "rank 1" in error and "worker process died" in error
    for r in results:
        assert r["seconds"] < 60
        assert r["latest_after_failure"] == 1
        assert r["final_ok"]


def _stop_worker_mid_save(rank: int, world: int, root: str, replicated: bool) -> dict:
    strategy = None
    if replicated:  # each rank its own node, each part copied to the other rank in the background
        os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"
        strategy = CliqueReplicationStrategy.from_replication_params(replication_factor=2)
    manager = LocalCheckpointManager(root, session_id="j", repl_strategy=strategy)
    generous = 60  # save 3 must work however busy the machine is (3 s may be too short for it)
    queue = AsyncCallsQueue(timeout=generous)  # save 1 too: it is not what this test times out
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1, is_async=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)
    queue.timeout = 3  # for save 2, which one rank's stopped worker never finishes
    if rank == 1:  # a worker that stops answering (SIGSTOP): it neither finishes nor exits
        os.kill(queue._worker.process.pid, signal.SIGSTOP)
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2, is_async=True)
    )
    errors = []
    for _ in range(80):  # training steps: a collective, then a non-blocking poll
        dist.barrier()
        try:
            queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointingError as e:  # raised on every rank in the same round
            errors.append(f"{type(e).__name__}: {e}")
            break
        if not queue.get_num_unfinalized_calls():
            break
        time.sleep(0.1)
    if errors:
        queue.timeout = generous
    request = manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 3, is_async=True)
    try:
        queue.schedule_async_request(request)  # waits for save 2 first (max_in_flight=1)
    except CheckpointingError as e:
        errors.append(f"{type(e).__name__}: {e}")
        queue.timeout = generous
        queue.schedule_async_request(request)
    queue.close()
    return {"errors": errors}


def _resume(rank: int, world: int, root: str) -> int:
    ta, ckpt = LocalCheckpointManager(root, session_id="j").load()
    assert flat_bytes(ta.state_dict) == flat_bytes(make_state(rank, ckpt.iteration))
    return ckpt.iteration


@pytest.mark.parametrize("replicated", [False, True])
def test_a_stopped_worker_fails_the_save_on_every_rank_together_and_is_replaced(
    tmp_path, replicated
):
    """One rank's worker stops: every rank fails the save in the same finalize round (no rank
    drifts a timeout behind; with replication the background step gives up on the worker first),
    the save is undone everywhere, and the next save works with a new worker."""
    results = run_ranks(_stop_worker_mid_save, 2, str(tmp_path), replicated, timeout=120)
    assert results[0] == results[1], results
    (error,) = results[0]["errors"]
    timed_out = "iteration 2: not finished on every rank within 3 s"
    given_up = "the background worker did not finish in time"  # replication's wait ended first
    assert timed_out in error or (
        replicated and "iteration 2 failed" in error and given_up in error
    )
    assert run_ranks(_resume, 2, str(tmp_path), timeout=120) == [3, 3]


def _two_in_flight(rank: int, world: int, root: str) -> dict:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue(max_in_flight=2)
    for it in (1, 2):
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it, is_async=True)
        )
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        error = "no error"
    except CheckpointingError as e:
        error = str(e)
    queue.schedule_async_request(  # one at a time works on
        manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 3, is_async=True)
    )
    queue.close()
    ta, ckpt = LocalCheckpointManager(root, session_id="j").load()
    equal = flat_bytes(ta.state_dict) == flat_bytes(make_state(rank, ckpt.iteration))
    return {"error": error, "loaded": ckpt.iteration, "equal": equal}


def test_a_second_local_save_in_flight_is_refused_and_the_first_commits(tier_root):
    """The local tier keeps one async save in flight (its snapshot reuses the previous save's
    staging memory): with max_in_flight=2 the second is refused on every rank, nothing written,
    instead of recycling the dirty file the worker is still writing."""
    results = run_ranks(_two_in_flight, 2, str(tier_root), timeout=180)
    assert len({r["error"] for r in results}) == 1, results
    assert (
        "iteration 2 was scheduled while the one of iteration 1 is still in flight"
        in (results[0]["error"])
    )
    assert all(r["loaded"] == 3 and r["equal"] for r in results)


def _peer_dies_mid_save(rank: int, world: int, root: str) -> dict:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue()
    for it in (1, 2):
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it, is_async=True)
        )
        if it == 1:
            queue.maybe_finalize_async_calls(blocking=True)
    if rank == 1:
        os._exit(0)  # the whole rank is gone while save 2 is in flight
    first, seconds = _finalize_timed(queue)
    try:  # (a manager's save would fail earlier, agreeing on its iteration with the gone peer)
        queue.schedule_async_request(AsyncRequest(time.sleep, (0.0,), description="next call"))
        second = "no error"
    except CheckpointingError as e:
        second = str(e)
    queue.close()
    return {"first": first, "second": second, "seconds": seconds}


def test_a_peer_gone_mid_save_makes_the_queue_give_up_and_a_restart_resumes(tmp_path, monkeypatch):
    """The agreement round fails when a rank is gone: the survivor raises at once, refuses more
    saves (its ranks cannot agree any more), and a restarted job resumes from the last complete
    checkpoint."""
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "20")
    results = run_ranks(_peer_dies_mid_save, 2, str(tmp_path), allow_crash={1}, timeout=120)
    survivor = results[0]
    assert "could not agree" in survivor["first"] and "Restart the job" in survivor["first"]
    assert survivor["seconds"] < 30
    assert "gave up" in survivor["second"]
    assert run_ranks(_resume, 2, str(tmp_path), timeout=120) == [1, 1]


def _abort_in_flight(rank: int, world: int, root: str) -> list[str]:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1, is_async=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(rank, 2, 8 << 20)), 2, is_async=True)
    )
    queue.close(abort=True)
    return sorted(
        p.name for p in manager.local_ckpt_dir.iterdir() if not p.name.startswith("spare_")
    )


def test_close_with_abort_leaves_no_partial_checkpoint(tier_root):
    results = run_ranks(_abort_in_flight, 2, str(tier_root))
    for rank, names in enumerate(results):
        assert names == [f"iter_0000001_{rank}_local.safetensors"]
    assert run_ranks(_find_latest, 2, str(tier_root)) == [1, 1]


def _full_disk_async(rank: int, world: int, root: str) -> dict:
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue(overlap_snapshot=rank == 1)
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict({"x": torch.ones(10)}), 1, is_async=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)
    big = {"x": torch.ones(10)} if rank != 1 else {"x": torch.ones(2**20)}  # 4 MiB > the 1 MiB disk
    try:
        queue.schedule_async_request(manager.save(BasicTensorAwareStateDict(big), 2, is_async=True))
        queue.maybe_finalize_async_calls(blocking=True)
        error = "no error"
    except CheckpointingError as e:
        error = str(e)
    queue.close()
    return {"error": error, "files": sorted(p.name for p in manager.local_ckpt_dir.iterdir())}


def test_full_ram_disk_fails_the_async_save_on_every_rank_and_keeps_the_previous(tmp_path):
    # The tier is a tmpfs: the snapshot goes straight into the part file, whose space is reserved
    # first, so a full disk is an error (not a SIGBUS while copying into the mapping).
    with small_tmpfs(tmp_path / "j" / "1"):
        results = run_ranks(_full_disk_async, WORLD, str(tmp_path))
        latest = run_ranks(_find_latest, WORLD, str(tmp_path))
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors
    (error,) = errors
    assert "rank 1" in error and "No space left" in error, error
    assert results[1]["files"] == ["iter_0000001_1_local.safetensors"]
    assert latest == [1] * WORLD


def _find_latest(rank: int, world: int, root: str) -> int:
    return LocalCheckpointManager(root, session_id="j").find_latest()


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _held(gate: str, limit: float) -> bool:
    """A call that runs until ``gate`` exists (``False``: it gave up after ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_polling_is_cheap_and_back_pressure_waits(tmp_path):
    queue = AsyncCallsQueue()
    done: list[int] = []
    gate = tmp_path / "released"
    held = AsyncRequest(_held, (str(gate), 60.0), [lambda: done.append(1)])
    first = queue.schedule_async_request(held)
    # The call runs until the gate is opened: a poll that waited for it would return it a minute
    # later. CPU time of this thread, not wall time, which a loaded machine stretches.
    cpu = time.thread_time()
    assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert time.thread_time() - cpu < 0.5
    assert queue.get_num_unfinalized_calls() == 1
    gate.touch()
    second = queue.schedule_async_request(AsyncRequest(_slow, (0.1,), [lambda: done.append(2)]))
    assert done == [1], "scheduling a second call first finalized the one in flight"
    assert queue.maybe_finalize_async_calls(blocking=True) == [second] and first != second
    assert done == [1, 2]
    queue.close()


def _write_size(path: str, data: bytes) -> None:
    Path(path).write_text(f"{len(data)} {data[-1]}")


def test_a_large_call_is_handed_over_without_waiting_for_the_busy_worker(tmp_path):
    """A call's message went through the pipe whose buffer holds about 200 KiB: with a call in
    flight (``max_in_flight=2``), scheduling one whose arguments pickle larger (a plan of tens of
    thousands of tensors) blocked the training thread until the worker finished the call ahead,
    past any timeout (a fresh queue's first such call waited for the worker's start the same
    way). Its message now travels in a memfd."""
    queue = AsyncCallsQueue(max_in_flight=2, timeout=60)
    gate, out = tmp_path / "released", tmp_path / "size.txt"
    first = queue.schedule_async_request(AsyncRequest(_held, (str(gate), 30.0), []))
    start = time.monotonic()
    data = bytes(range(256)) * (16 << 10)  # 4 MiB
    second = queue.schedule_async_request(AsyncRequest(_write_size, (str(out), data), []))
    assert time.monotonic() - start < 20, "scheduling waited for the worker's call ahead"
    gate.touch()
    assert queue.maybe_finalize_async_calls(blocking=True) == [first, second]
    assert out.read_text() == f"{len(data)} 255"
    queue.close()


def _raise_in_worker() -> None:
    raise OSError("disk full")


def test_a_failing_call_raises_and_runs_abort_fns():
    queue = AsyncCallsQueue()
    aborted: list[bool] = []
    queue.schedule_async_request(
        AsyncRequest(
            _raise_in_worker,
            (),
            [lambda: pytest.fail("finalize ran")],
            abort_fns=[lambda: aborted.append(True)],
        )
    )
    with pytest.raises(CheckpointingError, match="rank 0: OSError: disk full"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert aborted == [True]
    queue.close()


def _write_then_return_a_generator(path: str):
    Path(path).write_text("saved")
    return (n for n in range(3))  # (a handle, a future, a generator: nothing pickle can send)


def test_a_call_whose_result_cannot_be_pickled_still_succeeds(tmp_path):
    """The worker sent a call's return value back by pickle, so a call that did its work but
    returned something unpicklable failed, and its ``abort_fns`` undid the work. The result is not
    used (nor is it by NVRx): the call succeeds."""
    queue = AsyncCallsQueue()
    target = tmp_path / "out.txt"
    ran: list[str] = []
    request = AsyncRequest(
        _write_then_return_a_generator,
        (str(target),),
        [lambda: ran.append("finalized")],
        abort_fns=[lambda: ran.append("aborted")],
    )
    call = queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True) == [call]
    assert ran == ["finalized"] and target.read_text() == "saved"
    queue.close()


class _UserFinalizeError(Exception):
    pass


def _raise_user_error() -> None:
    raise _UserFinalizeError("user finalize failed")


def test_after_a_finalize_fn_raised_only_tierpoints_commits_run_and_the_first_error_is_raised():
    queue = AsyncCallsQueue()
    ran: list[str] = []

    def commit() -> None:
        ran.append("commit")
        raise OSError("the commit failed too")

    fns = [_raise_user_error, lambda: ran.append("user's"), Commit(commit)]
    queue.schedule_async_request(AsyncRequest(_slow, (0.0,), fns))
    with pytest.raises(_UserFinalizeError, match="user finalize failed"):
        queue.maybe_finalize_async_calls(blocking=True)
    # as in NVRx, a user's function after a failed one does not run (it may rely on it)
    assert ran == ["commit"]
    assert queue.get_num_unfinalized_calls() == 0
    queue.close()


def test_a_user_finalize_fn_raising_first_leaves_no_save_in_flight(tmp_path):
    """A user's finalize function put before the local tier's commit raises: the save is still
    committed (the error is raised), and later async saves go on. The commit used to be skipped:
    the tier kept iteration 1 in flight for good and refused every later save."""
    manager = LocalCheckpointManager(tmp_path, session_id="j", keep_last=1)
    queue = AsyncCallsQueue()
    first = make_state(0, 1)
    request = manager.save(BasicTensorAwareStateDict(first), 1, is_async=True)
    request.finalize_fns = [_raise_user_error, *request.finalize_fns]
    queue.schedule_async_request(request)
    with pytest.raises(_UserFinalizeError):
        queue.maybe_finalize_async_calls(blocking=True)
    assert manager.find_latest() == 1
    for iteration in (2, 3):
        state = make_state(0, iteration)
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
        )
        queue.maybe_finalize_async_calls(blocking=True)
        loaded, _ = manager.load()
        assert flat_bytes(loaded.state_dict) == flat_bytes(state)
    queue.close()
    assert sorted(p.name for p in (tmp_path / "j" / "0").glob("iter_*")) == [
        "iter_0000003_0_local.safetensors"
    ]


def test_sync_save_while_async_pending_is_refused(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="j")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1, is_async=True)
    )
    with pytest.raises(CheckpointingError, match="not finalized"):
        manager.save(BasicTensorAwareStateDict(make_state(0, 2)), 2)
    queue.close()
    manager.save(BasicTensorAwareStateDict(make_state(0, 2)), 2)
    assert manager.find_latest() == 2


def _kib_fields(path: str) -> dict[str, int]:
    fields = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[key] = int(rest.split()[0])
    return fields


def _staging_kib(pid: int) -> int:
    """Resident memory of the memfd staging buffers a process maps."""
    total, in_memfd = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's first line
            in_memfd = "/memfd:tierpoint-staging" in line
        elif in_memfd and first == "Rss:":
            total += int(line.split()[1])
    return total


def _tier_kib(root: str, exclude: set[str]) -> int:
    """Memory the part files in a RAM tier occupy (0 for a disk tier), ``exclude`` (names) aside."""
    if not in_memory_filesystem(root):
        return 0
    return sum(
        os.stat(os.path.join(d, f)).st_blocks // 2
        for d, _, files in os.walk(root)
        for f in files
        if f not in exclude
    )


def _host_kib(pids: list[int], root: str, exclude: set[str] = frozenset()) -> int:
    """Memory of the trainer and its worker: anonymous memory of each, their shared staging memory
    once, and the part files when the tier is in RAM. File-backed pages (libraries) are left out:
    their per-process share moves whenever another process on the machine maps the same library."""
    anon = sum(_kib_fields(f"/proc/{pid}/smaps_rollup")["Pss_Anon"] for pid in pids)
    return anon + max(_staging_kib(pid) for pid in pids) + _tier_kib(root, set(exclude))


def _memory_profile(rank: int, world: int, root: str) -> dict[str, float]:
    state = make_state(0, 0, numel=16 << 20)  # ~84 MiB
    nbytes = sum(t.numel() * t.element_size() for t in BasicTensorAwareStateDict(state).tensors)
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue()
    pids = [os.getpid(), queue._worker.process.pid]
    queue.wait_ready()
    # Warm up the code paths (imports, thread pools) with a tiny state, whose staging buffer the big
    # state's layout then replaces: the baseline is "saving works, nothing big is staged".
    queue.schedule_async_request(
        manager.save(BasicTensorAwareStateDict(make_state(0, 0)), 1, is_async=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)
    before = _host_kib(pids, root)
    peak_extra = 0
    after: dict[int, int] = {}
    for it in range(2, 102):
        state["optimizer"]["step"] = it
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
        )
        # The committed checkpoint is what a save keeps, not what it costs.
        committed = {f"iter_{it - 1:07d}_0_local.safetensors"}
        peak_extra = max(peak_extra, _host_kib(pids, root, committed) - before)
        queue.maybe_finalize_async_calls(blocking=True)
        if it in (3, 101):
            after[it] = _host_kib(pids, root)
    staged_in_place = queue._worker._sent == set()
    queue.close()
    return {
        "flat": after[101] / after[3],
        "peak": peak_extra * 1024 / nbytes,
        "in_place": staged_in_place,
    }


@pytest.mark.slow
def test_host_memory_is_flat_across_saves_and_bounded_in_flight(tier_root):
    # A fresh process, so that other tests' garbage does not move the numbers.
    (profile,) = run_ranks(_memory_profile, 1, str(tier_root), timeout=300)
    assert profile["in_place"] == in_memory_filesystem(tier_root), profile
    assert profile["flat"] <= 1.05, profile
    assert profile["peak"] <= 1.1, profile


def _overlapped_saves(root: Path, hook: bool, iterations: int) -> list[int]:
    """Save with an overlapped snapshot and step right away; return the iterations saved torn."""
    model = torch.nn.Linear(4096, 2048)  # 32 MiB: the copy takes a while
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = LocalCheckpointManager(root, session_id="j")
    queue = AsyncCallsQueue(overlap_snapshot=True)
    if hook:
        queue.install_optimizer_hook(optimizer)
    torn = []
    for it in range(1, iterations + 1):
        model(torch.randn(4, 4096)).sum().backward()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        start = time.monotonic()
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(model.state_dict()), it, is_async=True)
        )
        assert time.monotonic() - start < 5
        optimizer.step()  # changes every parameter, possibly while the snapshot copies them
        optimizer.zero_grad()
        queue.maybe_finalize_async_calls(blocking=True)
        saved = fileformat.read(manager.local_ckpt_dir / f"iter_{it:07d}_0_local.safetensors")
        if not all(torch.equal(saved[k], expected[k]) for k in expected):
            torn.append(it)
    queue.close()
    return torn


def test_overlapped_snapshot_with_optimizer_hook_saves_pre_step_values(tier_root):
    assert _overlapped_saves(tier_root / "hook", hook=True, iterations=5) == []
    # Without the hook the same loop tears snapshots: the test above can fail.
    assert _overlapped_saves(tier_root / "nohook", hook=False, iterations=10) != []


def _failing_snapshot() -> None:
    raise RuntimeError("copy to staging failed")


def test_a_failed_snapshot_is_reported_at_finalize_and_aborts():
    queue = AsyncCallsQueue()
    aborted: list[bool] = []
    request = AsyncRequest(
        _slow, (0.0,), [], preload_fn=_failing_snapshot, abort_fns=[lambda: aborted.append(True)]
    )
    queue.schedule_async_request(request)  # does not raise alone: the outcome is agreed first
    with pytest.raises(
        CheckpointingError, match="snapshot failed: RuntimeError: copy to staging failed"
    ):
        queue.maybe_finalize_async_calls(blocking=True)
    assert aborted == [True]
    queue.close()


_ORPHAN_SCRIPT = """
import os, signal, sys
from tierpoint.asyncsave import AsyncCallsQueue
queue = AsyncCallsQueue()
queue.wait_ready()
print(queue._worker.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_worker_dies_with_its_trainer():
    assert_worker_dies_with_trainer(_ORPHAN_SCRIPT)


def test_request_runs_synchronously_with_added_finalize_fns():
    calls: list[str] = []
    request = AsyncRequest(calls.append, ("work",), [lambda: calls.append("finalize")])
    request.add_finalize_fn(lambda: calls.append("added"))
    request.execute_sync()
    assert calls == ["work", "finalize", "added"]


def test_a_request_run_synchronously_still_commits_after_a_users_finalize_fn_raised(tmp_path):
    # execute_sync ran finalize functions in a plain loop: a user's function put before the local
    # tier's commit skipped it, and every later save failed as 'not finalized yet'.
    manager = LocalCheckpointManager(tmp_path, session_id="j")
    state = BasicTensorAwareStateDict(make_state(0, 1, 64))
    request = manager.save(state, 1, is_async=True)

    def user_fn() -> None:
        raise ValueError("the user's finalize function")

    request.finalize_fns = [user_fn, *request.finalize_fns]
    with pytest.raises(ValueError, match="the user's finalize function"):
        request.execute_sync()
    assert manager.find_latest() == 1
    manager.save(state, 2)
    assert manager.find_latest() == 2


def test_a_changed_layout_releases_the_old_staging_buffer_in_the_worker(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="j")
    queue = AsyncCallsQueue()
    for it, numel in enumerate([4096, 8192, 4096], start=1):
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(make_state(0, it, numel)), it, is_async=True)
        )
        queue.maybe_finalize_async_calls(blocking=True)
        assert len(queue._worker._sent) == 1  # only the current layout's buffer stays mapped
    queue.close()


def test_a_call_runs_in_the_directory_its_caller_was_in_when_scheduling(tmp_path, monkeypatch):
    """The worker process keeps the directory it started in; a call's relative paths mean what
    they meant to the training process when it scheduled the call (the local tier hands the
    worker paths under its root as given, relative ones included)."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    monkeypatch.chdir(first)
    with AsyncCallsQueue() as queue:
        queue.wait_ready()
        monkeypatch.chdir(second)
        queue.schedule_async_request(AsyncRequest(storage.write_file, ("part.bin", [b"abc"])))
        queue.maybe_finalize_async_calls(blocking=True)
    assert (second / "part.bin").read_bytes() == b"abc" and not (first / "part.bin").exists()
