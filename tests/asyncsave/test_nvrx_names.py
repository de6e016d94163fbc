"""NVRx's async names used the way NVRx code uses them: queue arguments, requests built by NVRx's
own NamedTuple, TorchAsyncCheckpoint and abort_nvrx_checkpoint."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tierpoint.asyncsave import (
    AsyncCallsQueue,
    AsyncRequest,
    TorchAsyncCheckpoint,
    abort_nvrx_checkpoint,
)
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks


class NVRxAsyncRequest(NamedTuple):
    """The shape of NVRx's own ``AsyncRequest`` (a NamedTuple), as NVRx code builds it."""

    async_fn: Callable | None
    async_fn_args: tuple
    finalize_fns: list
    async_fn_kwargs: dict = {}
    preload_fn: Callable | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> NVRxAsyncRequest:
        return self._replace(is_frozen=True)


def write_priorities(path: str) -> None:
    """Runs in the worker: record its nice value."""
    Path(path).write_text(str(os.nice(0)))


def write_args(path: str, payload: object) -> None:
    Path(path).write_text(repr(payload))


def test_queue_takes_nvrx_arguments_and_nvrx_built_requests(tmp_path):
    with pytest.raises(TypeError, match="is_daemon must be a bool"):
        AsyncCallsQueue(is_daemon="yes")
    with pytest.raises(ValueError, match="cpu_priority must be between 0 and 19"):
        AsyncCallsQueue(cpu_priority=25)
    AsyncCallsQueue.warmup_persistent_caller(0, is_daemon=True)  # NVRx's; a queue starts its own
    queue = AsyncCallsQueue(
        persistent=True, is_daemon=True, cpu_priority=12, io_priority=3, sigterm_timeout=5.0
    )
    done: list[str] = []
    # Built the NVRx way, by NVRx's own class: positional fields, add_finalize_fn, freeze.
    request = NVRxAsyncRequest(
        write_priorities, (str(tmp_path / "nice"),), [lambda: done.append("a")]
    )
    request.add_finalize_fn(lambda: done.append("b"))
    queue.schedule_async_request(request.freeze())
    # NVRx's preload_fn: its result replaces async_fn_args[1] in the worker.
    preloaded = NVRxAsyncRequest(
        write_args, (str(tmp_path / "args"), "placeholder"), [], preload_fn=lambda: "staged"
    )
    queue.schedule_async_request(preloaded)
    # tierpoint's own AsyncRequest, built the same way.
    ours = AsyncRequest(write_args, (str(tmp_path / "ours"), 1), [lambda: done.append("c")])
    ours.add_finalize_fn(lambda: done.append("d"))
    ours = ours.freeze()
    with pytest.raises(CheckpointingError, match="frozen"):
        ours.add_finalize_fn(lambda: None)
    queue.schedule_async_request(ours)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False, finalize_timeout=60)
    assert done == ["a", "b", "c", "d"]
    assert int((tmp_path / "nice").read_text()) >= min(12, 19)
    assert (tmp_path / "args").read_text() == "'staged'"
    with pytest.raises(TypeError, match="must be an AsyncRequest, got tuple .accepted: tierpoint"):
        queue.schedule_async_request(("not", "a", "request"))
    queue.close()


def test_torch_async_checkpoint_saves_the_snapshot(tmp_path):
    ckpt = TorchAsyncCheckpoint()
    state = {"w": torch.arange(6.0), "nested": {"step": 3, "t": torch.ones(2, dtype=torch.int8)}}
    ckpt.async_save(state, tmp_path / "a.pt")
    state["w"].add_(100)  # after async_save returns, the state may change
    ckpt.finalize_async_save(blocking=True)
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["nested"]["step"] == 3
    with pytest.raises(TypeError, match="needs a file path"):
        ckpt.async_save(state, object())
    ckpt.async_torch_save(state, str(tmp_path / "b.pt"))  # the name some guides use
    ckpt.finalize_async_save(blocking=True, terminate=True)
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.arange(6.0) + 100)


def test_abort_nvrx_checkpoint_undoes_pending_calls_and_the_queue_goes_on(tmp_path):
    queue = AsyncCallsQueue(max_in_flight=2)
    with pytest.raises(ValueError, match="max_in_flight=1"):
        TorchAsyncCheckpoint(queue=queue)  # its one staging buffer could be overwritten
    undone: list[int] = []
    queue.schedule_async_request(
        AsyncRequest(time.sleep, (30.0,), [], abort_fns=[lambda: undone.append(1)])
    )
    abort_nvrx_checkpoint()
    assert undone == [1] and queue.get_num_unfinalized_calls() == 0
    queue.schedule_async_request(AsyncRequest(write_args, (str(tmp_path / "after"), 2)))
    queue.maybe_finalize_async_calls(blocking=True)
    assert (tmp_path / "after").read_text() == "2"
    queue.close()


def _rank_zero_saves_alone(rank: int, world: int, directory: str) -> list[float]:
    ckpt = TorchAsyncCheckpoint()
    path = Path(directory) / "model.pt"
    if rank == 0:  # NVRx's no_dist=True default: rank 0 saves and finalizes, the others do not
        for step in range(3):  # the second and third saves wait for the previous one
            ckpt.async_save({"w": torch.arange(4.0) + step}, path)
        ckpt.finalize_async_save(blocking=True)
    ckpt.finalize_async_save(blocking=True, terminate=True)
    torch.distributed.barrier()
    return torch.load(path)["w"].tolist()


def _every_rank_agrees(rank: int, world: int, directory: str) -> int:
    ckpt = TorchAsyncCheckpoint()
    for step in range(2):
        ckpt.async_save({"w": torch.full((4,), float(rank + step))}, Path(directory) / f"{rank}.pt")
        ckpt.finalize_async_save(blocking=False, no_dist=False)
    ckpt.finalize_async_save(blocking=True, no_dist=False, terminate=True)
    return int(torch.load(Path(directory) / f"{rank}.pt")["w"][0])


def test_torch_async_checkpoint_on_some_ranks_alone_needs_no_collective(tmp_path):
    # The queue made a gloo group (collective) at its first schedule and waited for a previous save
    # with a collective round: rank 0 saving alone hung, then failed with torch's DistStoreError.
    env = {"TIERPOINT_TIMEOUT": "15"}
    results = run_ranks(_rank_zero_saves_alone, 2, str(tmp_path), env=env, timeout=60)
    assert results == [[2.0, 3.0, 4.0, 5.0]] * 2
    assert run_ranks(_every_rank_agrees, 2, str(tmp_path), env=env, timeout=60) == [1, 2]


def test_a_torch_save_killed_midway_leaves_the_previous_file_intact(tmp_path):
    # torch.save wrote in place: a worker killed midway (it dies with its trainer) left a truncated
    # file where the previous save's good one was.
    ckpt = TorchAsyncCheckpoint()
    path = tmp_path / "latest.pt"
    ckpt.async_save({"w": torch.arange(4.0)}, path)
    ckpt.finalize_async_save(blocking=True)
    good_size = path.stat().st_size
    ckpt.async_save({"w": torch.ones(50_000_000)}, str(path))  # 200 MB
    dirty = tmp_path / "latest.pt.dirty"
    deadline = time.monotonic() + 60
    while not dirty.exists() and path.stat().st_size == good_size:
        assert time.monotonic() < deadline, "the save never started writing"
        time.sleep(0.001)
    os.kill(ckpt._async_calls_queue._worker.process.pid, signal.SIGKILL)
    with pytest.raises(CheckpointingError, match="worker process died"):
        ckpt.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]  # the dirty file undone
    ckpt.async_save({"w": torch.zeros(3)}, f=path)  # torch.save's keyword works too
    ckpt.finalize_async_save(blocking=True, terminate=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(3))


def _rank_zero_terminates_without_waiting(rank: int, world: int, directory: str) -> list[Any]:
    ckpt = TorchAsyncCheckpoint()
    path = Path(directory) / "model.pt"
    start = time.monotonic()
    if rank == 0:  # the save may still run: terminate waits for it on this rank alone
        ckpt.async_save({"w": torch.arange(1 << 18, dtype=torch.float32)}, path)
        ckpt.finalize_async_save(blocking=False, terminate=True)
    torch.distributed.barrier()
    return [time.monotonic() - start < 8, torch.load(path)["w"][-1].item()]


def test_terminate_with_no_dist_makes_no_collective_either(tmp_path):
    # finalize_async_save(terminate=True) closed the queue, whose close() finalized the save still
    # in flight with a collective round: rank 0 alone waited TIERPOINT_TIMEOUT for the others to
    # create the queue's group, then the queue gave up and dropped the save.
    env = {"TIERPOINT_TIMEOUT": "10"}
    results = run_ranks(
        _rank_zero_terminates_without_waiting, 2, str(tmp_path), env=env, timeout=90
    )
    assert results == [[True, float((1 << 18) - 1)]] * 2


def test_torch_async_checkpoint_saves_again_after_terminate(tmp_path):
    # finalize_async_save(terminate=True) closed the queue for good: the next async_save raised
    # "the AsyncCallsQueue is closed", where NVRx's TorchAsyncCheckpoint starts a new worker.
    ckpt = TorchAsyncCheckpoint()
    ckpt.async_save({"w": torch.arange(3.0)}, tmp_path / "a.pt")
    ckpt.finalize_async_save(blocking=True, terminate=True)
    ckpt.async_save({"w": torch.ones(3)}, tmp_path / "b.pt")
    assert ckpt.finalize_async_save(blocking=True, terminate=True) != []
    assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["w"], torch.ones(3))
    queue = AsyncCallsQueue()
    given = TorchAsyncCheckpoint(queue=queue)
    given.finalize_async_save(blocking=True, terminate=True)  # closes the caller's queue
    with pytest.raises(CheckpointingError, match="closed"):
        given.async_save({"w": torch.ones(3)}, tmp_path / "c.pt")
