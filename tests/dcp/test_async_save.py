"""Async DCP saves: the snapshot is what gets saved even if training changes the state right away;
staging buffers are allocated once per layout and reused; files are written by the queue's
background worker; a failure on one rank fails the save on every rank and commits nothing."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import (
    StagingPool,
    async_save,
    async_save_request,
    default_queue,
    get_latest_complete_checkpoint,
    step_path,
)
from tierpoint.dcp.jobs import write_staged
from tierpoint.dcp.writer import Writer
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .file_names import data_file, fix_file_token, untokened
from .test_writer import assert_same, local_state, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(world: int, step: int, bigger: bool = False):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(step)
    full = torch.randn(world * 64, 32, generator=g)
    state = {
        "model": {
            "w": distribute_tensor(full, mesh, [Shard(0)]),
            "b": torch.randn(32, generator=g),
        },
        "step": step,
    }
    if bigger:  # every rank's layout grows (a shard each)
        state["model"]["new"] = distribute_tensor(
            torch.randn(world * 10, generator=g), mesh, [Shard(0)]
        )
    return state


def _snapshot(state: dict) -> dict:
    model = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for k, v in state["model"].items()
    }
    return {"model": model, "step": state["step"]}


def _load_and_compare(path: str, world: int, expected: dict) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {"model": {}, "step": -1}
    for k, v in expected["model"].items():
        z = torch.zeros_like(v)
        out["model"][k] = distribute_tensor(z, mesh, [Shard(0)]) if k != "b" else z
    dcp.load(out, storage_reader=FileSystemReader(path))
    got = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in out["model"].items()
    }
    return out["step"] == expected["step"] and all(
        torch.equal(got[k], expected["model"][k]) for k in got
    )


def _async_saves(rank: int, world: int, root: str) -> dict:
    queue = AsyncCallsQueue()
    pool = StagingPool()
    results = {"equal": [], "allocations": [], "buffers": set()}
    try:
        for step in range(1, 6):
            state = _state(world, step, bigger=step >= 4)
            expected = _snapshot(state)
            path = step_path(root, step)
            if step == 2:  # NVRx style: build the request, schedule it yourself
                request = async_save_request(state, path, staging_pool=pool)
                assert request.async_fn is write_staged
                queue.schedule_async_request(request)
            else:
                future = async_save(state, path, queue=queue, staging_pool=pool)
            # Training goes on at once: the saved checkpoint must still be the snapshot.
            with torch.no_grad():
                state["model"]["w"].add_(1.0)
                state["model"]["b"].mul_(-3.0)
            state["step"] = -step
            assert os.path.exists(os.path.join(path, f".unfinished-{rank}"))  # in flight
            if step == 2:
                queue.maybe_finalize_async_calls(blocking=True)
            else:
                assert future.result(timeout=120) == path
            assert not [n for n in os.listdir(path) if n.startswith(".unfinished")]
            dist.barrier()
            results["equal"].append(_load_and_compare(path, world, expected))
            results["allocations"].append(pool.allocations)
            results["buffers"].add(pool._free[0][1].id)
        # Then rank 1's disk is full for step 6: the save fails on every rank, nothing commits.
        target = step_path(root, 6)
        token = fix_file_token()  # every rank: a save names its files with one token
        if rank == 1:
            os.makedirs(target, exist_ok=True)
            os.symlink("/dev/full", os.path.join(target, data_file(1, token=token)))
        dist.barrier()
        future = async_save(_state(world, 6, True), target, queue=queue, thread_count=1)
        try:
            future.result(timeout=120)
            results["failure"] = "no error"
        except CheckpointingError as e:
            results["failure"] = str(e)
        # The worker outlives the failure: the next save (another layout, so the failed save's
        # staging buffer leaves the worker) succeeds.
        async_save(_state(world, 7), step_path(root, 7), queue=queue).result(timeout=120)
    finally:
        queue.close()
    results["buffers"] = len(results["buffers"])
    results["latest"] = get_latest_complete_checkpoint(root)
    return results


def test_async_saves_write_the_snapshot_reuse_staging_and_fail_together(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    results = run_ranks(_async_saves, 2, str(tmp_path), timeout=240)
    for r in results:
        assert r["equal"] == [True] * 5
        # One buffer for steps 1-3, a second one when the layout grew at step 4, reused at 5.
        assert r["allocations"] == [1, 1, 1, 2, 2]
        assert r["buffers"] == 2
    # Step 6 failed on rank 1: the same error on every rank; step 7 saved after it.
    assert len({r["failure"] for r in results}) == 1, results
    message = results[0]["failure"]
    assert "rank 1" in message and data_file(1) in message and "ENOSPC" in message
    # Each failing rank and each error class is named once.
    assert message.count("rank 1") == 1 and "CheckpointingError: CheckpointingError" not in message
    assert not os.path.exists(step_path(tmp_path, 6))  # aborted: files, markers, directory removed
    assert {r["latest"] for r in results} == {step_path(tmp_path, 7)}


def _large_async_save(rank: int, world: int, root: str) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    state = _state(world, 7)
    g = torch.Generator().manual_seed(rank)
    uneven = torch.randn(world * (5 << 20) + 7, generator=g)  # > 16 MiB per rank, unaligned tail
    dist.broadcast(uneven, 0)
    state["model"]["big"] = distribute_tensor(uneven, init_device_mesh("cpu", (world,)), [Shard(0)])
    expected = _snapshot(state)
    queue = AsyncCallsQueue()
    try:
        async_save(state, step_path(root, 7), queue=queue, thread_count=1).result(timeout=120)
    finally:
        queue.close()
    return _load_and_compare(step_path(root, 7), world, expected)


def test_large_files_on_a_disk_go_past_the_page_cache_and_load_with_plain_dcp(tmp_path):
    """Staged files this large are written with O_DIRECT on a disk file system (tierpoint's
    direct_write); the result is a standard checkpoint all the same."""
    assert run_ranks(_large_async_save, 2, str(tmp_path), timeout=240) == [True, True]


def test_saves_in_flight_get_own_buffers_and_every_dtype_is_staged(tmp_path):
    pool = StagingPool()
    state = {"a": torch.arange(1000.0), "n": 1}
    with AsyncCallsQueue(max_in_flight=2) as queue:
        f1 = async_save(state, step_path(tmp_path, 1), queue=queue, staging_pool=pool)
        state["a"].add_(1)
        state["n"] = 2
        f2 = async_save(state, step_path(tmp_path, 2), queue=queue, staging_pool=pool)
        state["a"].add_(1)
        with pytest.raises(TypeError, match="timeout must be a number of seconds"):
            f1.result("120")  # type: ignore[arg-type]
        f1.result(timeout=120)
        f2.result(timeout=120)
        assert pool.allocations == 2
        async_save(state, step_path(tmp_path, 3), queue=queue, staging_pool=pool).result(120)
        assert pool.allocations == 2  # a free buffer of the same layout is reused
        every_dtype = local_state(4)
        expected = copy.deepcopy(every_dtype)
        future = async_save(every_dtype, step_path(tmp_path, 4), queue=queue, thread_count=3)
        for v in every_dtype["model"].values():
            v.zero_()
        future.result(120)
    out = zeros_like_state(expected)
    dcp.load(out, checkpoint_id=step_path(tmp_path, 4))
    assert_same(out, expected)
    for step in (1, 2, 3):
        out = {"a": torch.zeros(1000), "n": 0}
        dcp.load(out, checkpoint_id=step_path(tmp_path, step))
        assert torch.equal(out["a"], torch.arange(1000.0) + step - 1) and out["n"] == min(step, 2)


def test_a_directory_with_a_save_in_flight_is_not_saved_into_again(tmp_path):
    """A second save (async or sync) into the step an async save is still writing is refused; the
    first one commits and loads intact, and the step takes saves again once it is finalized."""
    path = step_path(tmp_path, 200)
    with AsyncCallsQueue(max_in_flight=2) as queue:
        first = async_save({"w": torch.full((1000,), 1.0)}, path, queue=queue)
        with pytest.raises(CheckpointingError, match="an async save into it is still in flight"):
            async_save({"w": torch.full((1000,), 2.0)}, path, queue=queue, overwrite=True)
        with pytest.raises(CheckpointException, match="an async save into it is still in flight"):
            dcp.save({"w": torch.full((1000,), 3.0)}, storage_writer=Writer(path, overwrite=True))
        first.result(timeout=120)
        assert get_latest_complete_checkpoint(tmp_path) == path
        out = {"w": torch.zeros(1000)}
        dcp.load(out, checkpoint_id=path)
        assert torch.equal(out["w"], torch.full((1000,), 1.0))
        async_save({"w": torch.full((1000,), 4.0)}, path, queue=queue, overwrite=True).result(120)
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], torch.full((1000,), 4.0))


def test_a_save_the_queue_cannot_take_releases_its_directory(tmp_path):
    """Making room for a save finalizes the one before; when that one failed, the new save is not
    taken and must release what planning took (its step directory, markers, staging): saving
    that step again then works."""
    w = torch.arange(1000.0)
    state = {"w": w}
    with AsyncCallsQueue(max_in_flight=1) as queue:
        failing = async_save_request(state, step_path(tmp_path, 2))
        w.data = torch.zeros(10)  # the state changes between planning and snapshot
        queue.schedule_async_request(failing)
        w.data = torch.arange(1000.0)
        with pytest.raises(
            CheckpointingError, match="step-2 failed on rank 0: snapshot failed"
        ) as e:
            async_save(state, step_path(tmp_path, 3), queue=queue)
        changed = "w: planned torch.float32 [1000], found torch.float32 [10] (the state changed"
        assert changed in str(e.value)
        assert not os.path.exists(step_path(tmp_path, 3))  # nothing of it is left
        async_save(state, step_path(tmp_path, 3), queue=queue).result(timeout=120)
    out = {"w": torch.zeros(1000)}
    dcp.load(out, checkpoint_id=step_path(tmp_path, 3))
    assert torch.equal(out["w"], torch.arange(1000.0))


def test_async_save_after_the_default_queue_was_closed_uses_a_new_one(tmp_path):
    """The docs have users close ``default_queue()`` before destroying the process group; a later
    ``async_save`` without ``queue=`` (a new process group, an in-process restart) must not find it
    closed for good."""
    first = default_queue()
    async_save({"w": torch.ones(4)}, step_path(tmp_path, 1)).result(timeout=120)
    first.close()
    assert first.closed
    async_save({"w": torch.full((4,), 2.0)}, step_path(tmp_path, 2)).result(timeout=120)
    assert default_queue() is not first and not default_queue().closed
    out = {"w": torch.zeros(4)}
    dcp.load(out, checkpoint_id=step_path(tmp_path, 2))
    assert torch.equal(out["w"], torch.full((4,), 2.0))


def _poll_between_training_collectives(rank: int, world: int, root: str) -> list[str | None]:
    """The README's loop: a training collective and a non-blocking poll every step, an async
    save every 4th; rank 1's saves take longer, so the ranks see them finish at different polls."""
    state = {f"w{rank}": torch.randn((8 if rank == 1 else 1) << 20), "trainer": {"step": 0}}
    queue = AsyncCallsQueue()
    queue.wait_ready()
    try:
        for step in range(1, 61):
            state[f"w{rank}"].add_(1.0)
            time.sleep(0.01)
            dist.all_reduce(torch.ones(1))  # the gradient all-reduce, on the training group
            queue.maybe_finalize_async_calls(blocking=False)
            if step % 4 == 0:
                state["trainer"]["step"] = step
                async_save(state, step_path(root, step), queue=queue)
    finally:
        queue.close()
    return [get_latest_complete_checkpoint(root)] + sorted(os.listdir(root))


def test_non_blocking_polls_finalize_on_every_rank_in_the_same_round(tmp_path, monkeypatch):
    """Finalizing a DCP save runs collectives (the commit): every rank must finalize at the same
    poll, or one rank waits in the commit while the other waits in the training all-reduce."""
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "20")
    results = run_ranks(_poll_between_training_collectives, 2, str(tmp_path), timeout=200)
    steps = [os.path.basename(step_path(tmp_path, s)) for s in range(4, 61, 4)]
    assert results == [[step_path(tmp_path, 60), *sorted(steps)]] * 2


def _result_with_a_timeout(rank: int, world: int, root: str) -> list[str]:
    import signal

    from tierpoint.errors import CoordinationTimeoutError

    queue = AsyncCallsQueue()
    queue.wait_ready()
    worker = queue._worker.process.pid
    if rank == 1:
        os.kill(worker, signal.SIGSTOP)  # rank 1's write is held up
    future = async_save({"w": torch.ones(1000) * rank}, step_path(root, 1), queue=queue)
    seen = []
    try:
        future.result(timeout=2)
    except CoordinationTimeoutError as e:
        seen.append(str(e))
    if rank == 1:
        os.kill(worker, signal.SIGCONT)
    seen.append(future.result(timeout=120))  # still pending, not undone: it commits now
    queue.close()
    return seen


def test_result_with_a_timeout_raises_on_every_rank_and_the_save_goes_on(tmp_path):
    """``result(timeout)`` is agreed like the queue's rounds: every rank gives up waiting in the
    same round (no rank is left alone in a collective), and the save stays pending."""
    results = run_ranks(_result_with_a_timeout, 2, str(tmp_path), timeout=120)
    for seen in results:
        assert len(seen) == 2 and "within 2 s (still pending)" in seen[0], seen
        assert seen[1] == step_path(tmp_path, 1)
    assert get_latest_complete_checkpoint(tmp_path) == step_path(tmp_path, 1)


# ------------------------------------------------------------------ staged in place (/dev/shm)


def _async_saves_in_place(rank: int, world: int, root: str) -> dict:
    from tierpoint.dcp.writer import stages_in_place

    pool = StagingPool()
    results: dict = {"in_place": stages_in_place(root), "equal": [], "files": [], "spare": []}
    with AsyncCallsQueue() as queue:
        for step in range(1, 5):
            state = _state(world, step, bigger=step >= 3)
            expected = _snapshot(state)
            path = step_path(root, step)
            future = async_save(state, path, queue=queue, staging_pool=pool)
            with torch.no_grad():  # training goes on: the file must still hold the snapshot
                state["model"]["w"].add_(1.0)
                state["model"]["b"].mul_(-3.0)
            state["step"] = -step
            assert future.result(timeout=120) == path
            dist.barrier()
            results["equal"].append(_load_and_compare(path, world, expected))
            results["files"].append(untokened(os.listdir(path)))
            pool._join_preparing()
            results["spare"].append(pool.bytes_held > 0)
        if rank == 1:  # killed once its files are named, before the save is committed
            async_save(_state(world, 5, True), step_path(root, 5), queue=queue, staging_pool=pool)
            os.kill(os.getpid(), 9)
        future = async_save(_state(world, 5, True), step_path(root, 5), queue=queue)
        try:
            future.result(timeout=60)
            results["killed"] = "no error"
        except CheckpointingError as e:
            results["killed"] = str(e)
    pool.close()
    return results


def test_async_saves_to_a_ram_disk_snapshot_into_the_files_themselves(shm_dir):
    """On /dev/shm the snapshot fills each rank's data file directly (one per rank); the next save's
    file is prepared in the background; a rank killed after the snapshot commits nothing."""
    results = run_ranks(
        _async_saves_in_place,
        2,
        str(shm_dir),
        timeout=240,
        allow_crash={1},
        env={"TIERPOINT_TIMEOUT": "20"},
    )
    r = results[0]
    assert r["in_place"] and r["equal"] == [True] * 4
    files = [".checksums-0.json", ".checksums-1.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert r["files"] == [files] * 4
    assert r["spare"] == [True] * 4  # ready for the next save, also after the layout grew
    assert results[1] is None and "could not agree" in r["killed"], r["killed"]
    assert get_latest_complete_checkpoint(shm_dir) == step_path(shm_dir, 4)
    left = sorted(os.listdir(step_path(shm_dir, 5)))
    assert ".metadata" not in left and ".unfinished-1" in left, left
    assert sorted(os.listdir(shm_dir)) == [f"step-{s}" for s in range(1, 6)]


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_a_relative_path_saves_where_the_caller_is_when_the_worker_started_elsewhere(
    where, tmp_path, shm_dir, monkeypatch
):
    """The queue's worker process keeps the directory it started in; the training process may
    change directory afterwards (a test fixture, the user's code). A relative path means what it
    means to the caller at the save: the worker once resolved it in its own directory and did not
    find the file the snapshot had named there (``syncing ... ENOENT`` on a RAM disk; on a disk the
    data went into the other directory and ``.metadata`` named files that were not there)."""
    first, second = (
        (tmp_path / "a", tmp_path / "b") if where == "disk" else (shm_dir, shm_dir / "b")
    )
    first.mkdir(exist_ok=True)
    second.mkdir()
    monkeypatch.chdir(first)
    with AsyncCallsQueue() as queue:
        queue.wait_ready()  # the worker runs in the first directory
        monkeypatch.chdir(second)
        state = local_state()
        expected = copy.deepcopy(state)
        future = async_save(state, "ckpt/step-1", queue=queue)
        state["model"]["w"].add_(1)
        monkeypatch.chdir(first)  # the caller moves on before the save is finalized
        future.result(timeout=120)
    out = zeros_like_state(expected)
    dcp.load(out, checkpoint_id=str(second / "ckpt/step-1"))
    assert_same(out, expected)
    assert not (first / "ckpt").exists()


_EXIT_SCRIPT = """
import logging, sys, torch
from tierpoint import dcp
logging.basicConfig(format="%(levelname)s %(message)s")
dcp.async_save({"w": torch.ones(64, 64)}, sys.argv[1])
"""


def test_a_save_left_pending_at_exit_is_named_with_what_would_have_kept_it(tmp_path):
    """``async_save`` without a queue: the user holds only the future, so the warning at exit
    says to call its ``result()``, and nothing was committed."""
    path = tmp_path / "step-1"
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    dropped = [line for line in out.stderr.splitlines() if "was dropped" in line]
    assert len(dropped) == 1, out.stderr
    assert dropped[0].startswith("WARNING") and str(path) in dropped[0]
    assert ".result()" in dropped[0] and "abort=True" not in dropped[0], dropped
    assert not (path / ".metadata").exists()


def test_a_future_whose_commit_failed_is_done_and_says_why(tmp_path, monkeypatch):
    """A commit that raises runs no finalize function after it, the future's included: done()
    stayed False for good (a loop polling it never ended) and result() said "dropped"."""

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Writer, "commit", full_disk)
    with AsyncCallsQueue() as queue:
        future = async_save(local_state(1), str(tmp_path / "step-1"), queue=queue)
        with pytest.raises(CheckpointingError, match="No space left"):
            future.result()
        assert future.done()
        with pytest.raises(CheckpointingError, match="failed: .*No space left"):
            future.result()


def test_a_save_whose_step_was_taken_over_before_its_commit_is_not_committed(tmp_path, monkeypatch):
    """A save whose process stopped before its commit (SIGSTOP, a hung node) while a restarted
    job saved the same step again: the later save's set-up cleared this one's files. Committing
    published a ``.metadata`` naming files that are gone, and removed the later save's files."""
    path = str(tmp_path / "step-6")
    original = Writer.commit

    def taken_over(self, *args, **kwargs):
        for name in os.listdir(path):
            if name.endswith(".distcp"):
                os.unlink(os.path.join(path, name))  # as the later save's set-up removes them
        with open(os.path.join(path, "__0_0.0123456789abcdef.distcp"), "wb") as f:
            f.write(b"the later save's data")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Writer, "commit", taken_over)
    with AsyncCallsQueue() as queue:
        future = async_save(local_state(1), path, queue=queue)
        with pytest.raises(CheckpointingError, match="another save into this step took it"):
            future.result(timeout=120)
    assert ".metadata" not in os.listdir(path)
    assert "__0_0.0123456789abcdef.distcp" in os.listdir(path)  # the later save's, untouched
