"""A Ctrl-C (``KeyboardInterrupt``) while an :class:`AsyncCallsQueue` works: a snapshot never
swallows it, and a ``close()`` it interrupts stops the worker at once instead of waiting for its
call to end. Signals sent to every process of the job (a terminal's Ctrl-C, Slurm's SIGTERM) leave
the worker's save in flight to finish."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .orphans import worker_parent

SLOW = 30.0


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _interrupted_snapshot() -> dict[str, Any]:
    raise KeyboardInterrupt  # a Ctrl-C while the snapshot copies the state


def _ctrl_c_in_a_snapshot(rank: int, world: int) -> dict[str, Any]:
    queue = AsyncCallsQueue()
    aborted: list[bool] = []
    request = AsyncRequest(
        _slow,
        (0.0,),
        [],
        preload_fn=_interrupted_snapshot if rank == 0 else None,
        abort_fns=[lambda: aborted.append(True)],
    )
    interrupted = False
    try:
        queue.schedule_async_request(request)
    except KeyboardInterrupt:
        interrupted = True
    start = time.monotonic()
    with pytest.raises(CheckpointingError) as failed:
        queue.close()  # every rank learns that rank 0's snapshot failed
    return {
        "interrupted": interrupted,
        "error": str(failed.value),
        "aborted": aborted,
        "closing": time.monotonic() - start,
    }


def test_a_ctrl_c_in_a_snapshot_is_raised_and_fails_the_call_on_every_rank():
    outs = run_ranks(_ctrl_c_in_a_snapshot, 2, timeout=120)
    # Before: the interrupt became a failed snapshot, and the rank went on.
    assert [o["interrupted"] for o in outs] == [True, False]
    for out in outs:
        assert "rank 0: snapshot failed: KeyboardInterrupt" in out["error"]
        assert out["aborted"] == [True]
        assert out["closing"] < 30


def _ctrl_c_while_closing(rank: int, world: int) -> dict[str, Any]:
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(_slow, (SLOW,), []))
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        queue.close()  # waits for the call, until the Ctrl-C
    return {"closing": time.monotonic() - start}


def test_a_ctrl_c_while_close_waits_stops_the_worker_at_once():
    (out,) = run_ranks(_ctrl_c_while_closing, 1, timeout=120)
    # Before: close() then asked the worker to stop and waited for its call to end (30 s).
    assert out["closing"] < SLOW / 2


def live_workers() -> list[int]:
    """This process's live background workers."""
    pids = map(int, filter(str.isdigit, os.listdir("/proc")))
    return [pid for pid in pids if worker_parent(pid) == os.getpid()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sent_to_every_process_of_the_job_lets_the_save_in_flight_finish(signum):
    """Slurm's preemption notice (SIGTERM) and a terminal's Ctrl-C (SIGINT) reach the worker too;
    the trainer handles them (``install_signal_handler``: a final save), so the worker must finish
    its call rather than die with it."""
    with AsyncCallsQueue() as queue:
        queue.wait_ready()
        queue.schedule_async_request(AsyncRequest(_slow, (2.0,), []))
        (worker,) = live_workers()
        os.kill(worker, signum)
        time.sleep(0.5)
        assert live_workers() == [worker]
        queue.maybe_finalize_async_calls(blocking=True)  # raises if the call failed
