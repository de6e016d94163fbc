"""The background worker's lifetime: it lives as long as its trainer process, whichever thread
of the trainer started it, and ends at once when that process dies, also in the middle of a call."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest

from .orphans import assert_worker_dies_with_trainer


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_queue_made_on_a_thread_that_ends_keeps_its_worker(caplog):
    # PR_SET_PDEATHSIG fires when the *thread* that started the worker exits: a queue made on a
    # set-up thread lost its worker with that thread, and the save in flight then failed.
    made: dict[str, AsyncCallsQueue] = {}
    in_flight = threading.Event()

    def setup_thread() -> None:
        made["queue"] = AsyncCallsQueue(timeout=60)
        made["queue"].wait_ready()
        made["queue"].schedule_async_request(AsyncRequest(_slow, (1.5,)))
        in_flight.set()

    thread = threading.Thread(target=setup_thread)
    thread.start()
    thread.join()
    assert in_flight.is_set()
    queue = made["queue"]
    with caplog.at_level("WARNING", logger="tierpoint"):
        queue.maybe_finalize_async_calls(blocking=True)  # the call finished in the same worker
        queue.schedule_async_request(AsyncRequest(_slow, (0.0,)))
        queue.maybe_finalize_async_calls(blocking=True)
    assert "starting a new background worker" not in caplog.text
    queue.close()


_BUSY_ORPHAN = """
import os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from asyncsave.test_worker import _slow
made = {{}}
def setup():
    made["queue"] = AsyncCallsQueue(timeout=600)
    made["queue"].wait_ready()
thread = threading.Thread(target=setup, daemon={daemon})
thread.start()
thread.join(60)
queue = made["queue"]
queue.schedule_async_request(AsyncRequest(_slow, (300.0,)))
time.sleep(1.0)  # the worker is in the call
children = [open(f"/proc/self/task/{{t}}/children").read() for t in os.listdir("/proc/self/task")]
print(*"".join(children).split(), flush=True)  # the worker is this process's only child
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("daemon", [False, True])
def test_a_worker_busy_in_a_call_dies_with_its_killed_trainer(daemon):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert_worker_dies_with_trainer(_BUSY_ORPHAN.format(tests=tests, daemon=daemon))


_NO_PIDFD_ORPHAN = """
import os, signal, subprocess, sys
child = '''
import errno, os, sys, time
def refused(pid, flags=0):
    raise OSError(errno.ENOSYS, "pidfd_open refused")  # a kernel before 5.3, a seccomp filter
os.pidfd_open = refused
from tierpoint.asyncsave import worker
worker._die_with_trainer(int(sys.argv[1]), False)
print(os.getpid(), flush=True)
time.sleep(300)  # a call in flight
'''
worker = subprocess.Popen(
    [sys.executable, "-c", child, str(os.getpid())],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,  # (the test reads this process's output to its end)
)
print(int(worker.stdout.readline()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_started_on_a_thread_dies_with_its_trainer_where_no_pidfd_can_be_had():
    """Without a pidfd of its trainer (``pidfd_open`` refused), a worker started by a thread other
    than the main one had no watch at all: it went on writing after its trainer died."""
    assert_worker_dies_with_trainer(_NO_PIDFD_ORPHAN)
