"""Misuse of AsyncCallsQueue: wrong arguments are refused before anything changes, a request is
scheduled once, and a call dropped before it was finalized is named in a WARNING."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from tierpoint.asyncsave import queue as queue_module
from tierpoint.errors import CheckpointingError, CoordinationTimeoutError

HINT = "maybe_finalize_async_calls(blocking=True) or close()"


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    """One queue (one worker process) for the tests that leave nothing pending; a queue a test
    breaks then fails the next ones within ``timeout`` rather than hanging."""
    q = AsyncCallsQueue(timeout=30)
    yield q
    q.close()


def _no_worker() -> None:
    pytest.fail("a worker was started before the arguments were checked")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_in_flight": "2"}, TypeError, "max_in_flight must be an int, got str"),
        ({"max_in_flight": True}, TypeError, "max_in_flight must be an int"),
        ({"max_in_flight": 0}, ValueError, "max_in_flight must be >= 1, got 0"),
        ({"timeout": -1}, ValueError, "timeout must be a finite number of seconds > 0, got -1"),
        ({"timeout": 0}, ValueError, "timeout must be a finite number"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a finite number"),
        ({"timeout": float("inf")}, ValueError, "timeout must be a finite number"),
        ({"timeout": "60"}, TypeError, "timeout must be a number of seconds"),
        ({"overlap_snapshot": "yes"}, TypeError, "overlap_snapshot must be a bool"),
        ({"persistent": None}, TypeError, "persistent must be a bool"),
    ],
)
def test_constructor_arguments_are_checked_before_a_worker_starts(
    monkeypatch, kwargs: dict, error: type[Exception], match: str
):
    monkeypatch.setattr(queue_module, "Worker", _no_worker)
    with pytest.raises(error, match=match):
        AsyncCallsQueue(**kwargs)


def test_a_bad_timeout_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setattr(queue_module, "Worker", _no_worker)
    monkeypatch.setenv("TIERPOINT_TIMEOUT", "-5")
    with pytest.raises(CheckpointingError, match="TIERPOINT_TIMEOUT must be a positive number"):
        AsyncCallsQueue()


def _schedule_and_finalize(queue: AsyncCallsQueue) -> None:
    """A valid request still goes through: the queue was left intact."""
    done: list[bool] = []
    call_id = queue.schedule_async_request(
        AsyncRequest(time.sleep, (0.0,), [lambda: done.append(True)])
    )
    assert queue.maybe_finalize_async_calls(blocking=True) == [call_id]
    assert done == [True]


def _in_main_script() -> None:
    pass


_in_main_script.__module__ = "__main__"  # as if defined in the user's script: not importable there


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (None, "request must be an AsyncRequest, got NoneType"),
        (time.sleep, "request must be an AsyncRequest, got builtin_function_or_method"),
        (AsyncRequest("not a function"), "AsyncRequest.async_fn must be callable"),
        (AsyncRequest(time.sleep, (0.0,), None), "AsyncRequest.finalize_fns must be a list"),
        (AsyncRequest(time.sleep, 0.0), "AsyncRequest.async_fn_args must be a tuple"),
        (AsyncRequest(lambda: None), "async_fn '<lambda>' is defined inside a function or as a"),
        (AsyncRequest(_in_main_script), "defined in the script being run"),
    ],
)
def test_a_wrong_request_is_refused_and_leaves_the_queue_intact(
    queue: AsyncCallsQueue, request_: object, match: str
):
    with pytest.raises(TypeError, match=match):
        queue.schedule_async_request(request_)
    assert queue.get_num_unfinalized_calls() == 0
    _schedule_and_finalize(queue)


def test_a_request_is_scheduled_once(queue: AsyncCallsQueue):
    request = AsyncRequest(time.sleep, (0.5,), description="save 7")
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointingError, match="save 7: this AsyncRequest was scheduled already"):
        queue.schedule_async_request(request)  # while pending
    with pytest.raises(CheckpointingError, match="save 7: finalize functions cannot be added"):
        request.add_finalize_fn(lambda: None)  # it would never run if the call finished already
    assert list(request.finalize_fns) == []
    queue.maybe_finalize_async_calls(blocking=True)
    with pytest.raises(CheckpointingError, match="scheduled already"):
        queue.schedule_async_request(request)  # and after it was finalized
    assert queue.get_num_unfinalized_calls() == 0
    _schedule_and_finalize(queue)


def test_add_finalize_fn_takes_callables_only():
    request = AsyncRequest(time.sleep, (0.0,))
    with pytest.raises(TypeError, match="finalize function must be callable, got 'x'"):
        request.add_finalize_fn("x")
    assert list(request.finalize_fns) == []


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        ("5", TypeError, "timeout must be a number of seconds"),
        (-1, ValueError, "timeout must be a finite number of seconds > 0, got -1"),
        (float("nan"), ValueError, "timeout must be a finite number"),
    ],
)
def test_waits_check_their_timeout(
    queue: AsyncCallsQueue, timeout: object, error: type[Exception], match: str
):
    with pytest.raises(error, match=match):
        queue.wait_ready(timeout)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        queue.wait_for_snapshot(timeout)  # type: ignore[arg-type]
    queue.wait_ready(30)
    queue.wait_for_snapshot(30)


def test_the_worker_start_up_does_not_count_against_the_timeout_and_a_timeout_undoes_the_call():
    """The worker imports torch (about a second) after the queue is created; a 0.3 s timeout still
    lets the first save finish, and a call slower than the timeout still fails, at about the
    timeout. (The worker runs at nice 0 here: at its default nice 19 a parallel test run can
    starve it of the CPU for longer than 0.3 s between its start and its first result.)"""
    queue = AsyncCallsQueue(timeout=0.3, cpu_priority=0)
    started = time.monotonic()
    queue.schedule_async_request(AsyncRequest(time.sleep, (0.0,), description="quick save"))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    assert time.monotonic() - started > 0.3, "the worker started faster than this test assumes"

    aborted: list[bool] = []
    queue.schedule_async_request(
        AsyncRequest(
            time.sleep, (30.0,), abort_fns=[lambda: aborted.append(True)], description="slow save"
        )
    )
    started = time.monotonic()
    with pytest.raises(
        CoordinationTimeoutError, match="slow save: not finished on every rank within 0.3 s"
    ):
        queue.maybe_finalize_async_calls(blocking=True)
    assert time.monotonic() - started < 10
    # Every rank timed out together: the worker is killed, the call undone (abort_fns) and
    # dropped, and the queue goes on with a new worker.
    assert queue._worker is not None and queue._worker.exitcode is not None
    assert queue.get_num_unfinalized_calls() == 0 and aborted == [True]
    queue.schedule_async_request(AsyncRequest(time.sleep, (0.0,), description="next save"))
    assert queue.maybe_finalize_async_calls(blocking=True) == [2]
    queue.close()


def _dropped(caplog: pytest.LogCaptureFixture, description: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and description in r.getMessage()
    ]


def test_closing_with_abort_names_the_dropped_call(caplog):
    queue = AsyncCallsQueue()
    aborted: list[bool] = []
    queue.schedule_async_request(
        AsyncRequest(
            time.sleep, (30.0,), abort_fns=[lambda: aborted.append(True)], description="save A"
        )
    )
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        queue.close(abort=True)
    assert aborted == [True]
    (message,) = _dropped(caplog, "save A")
    assert "closed with abort=True" in message and HINT in message


def test_a_garbage_collected_queue_names_its_pending_call(caplog):
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(time.sleep, (30.0,), description="save B"))
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        del queue
        gc.collect()
    (message,) = _dropped(caplog, "save B")
    assert "garbage-collected" in message and HINT in message


def _raise_in_worker() -> None:
    raise OSError("disk full")


def test_a_failing_close_names_the_calls_it_leaves(caplog):
    queue = AsyncCallsQueue(max_in_flight=2)
    queue.schedule_async_request(AsyncRequest(_raise_in_worker, description="save C"))
    queue.schedule_async_request(AsyncRequest(time.sleep, (0.0,), description="save D"))
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        with pytest.raises(CheckpointingError, match="save C failed"):
            queue.close()
    (message,) = _dropped(caplog, "save D")
    assert "close() raised" in message and HINT in message


_EXIT_SCRIPT = """
import logging, time
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
logging.basicConfig(format="%(levelname)s %(message)s")
queue = AsyncCallsQueue()
queue.schedule_async_request(AsyncRequest(time.sleep, (60.0,), description="save at exit"))
"""


def test_exiting_with_a_pending_save_names_it_once():
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    dropped = [line for line in out.stderr.splitlines() if "save at exit" in line]
    assert len(dropped) == 1, out.stderr
    assert dropped[0].startswith("WARNING") and "the process exited" in dropped[0], dropped
    assert HINT in dropped[0]


_FORK_SCRIPT = """
import os, pathlib, sys, time
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest, abort_nvrx_checkpoint
from tierpoint.errors import CheckpointingError
out = pathlib.Path(sys.argv[1])
queue = AsyncCallsQueue()
queue.wait_ready()
queue.schedule_async_request(AsyncRequest(
    time.sleep, (2.0,), [(out / "finalized").touch], abort_fns=[(out / "aborted").touch]
))
child = os.fork()
if child == 0:  # a helper process forked while the save is in flight, which returns normally
    for use in (
        lambda: queue.schedule_async_request(AsyncRequest(time.sleep, (0.0,))),
        lambda: queue.maybe_finalize_async_calls(blocking=True),
    ):
        try:
            use()
            print("used in the child")
        except CheckpointingError as e:
            print("refused:", e)
    abort_nvrx_checkpoint()
    queue.close()
    sys.exit(0)
assert os.waitpid(child, 0)[1] == 0
print("parent finalized", queue.maybe_finalize_async_calls(blocking=True))
print("worker alive after the child", queue._worker.exitcode is None)
queue.close()
"""


def test_a_forked_process_cannot_use_its_parents_queue_nor_disturb_it(tmp_path):
    """A process forked from a trainer holds a copy of its queue: using or closing that copy stole
    the parent's worker results, ran its calls' ``abort_fns`` in the child (a save's files
    removed), stopped the parent's worker and hung in a collective on the inherited group. The
    copy now refuses calls and touches nothing; the parent's save goes on."""
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 2 and all("forked from it" in line for line in refused), out.stdout
    assert "parent finalized [0]" in lines and "worker alive after the child True" in lines
    assert (tmp_path / "finalized").exists() and not (tmp_path / "aborted").exists()
    assert "dropped" not in out.stderr, out.stderr  # the child's exit names nothing


_SYS_EXIT_SCRIPT = """
import pathlib, sys, time
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
out = pathlib.Path(sys.argv[1])
with AsyncCallsQueue() as queue:
    for name in ("committed", "aborted"):
        (out / name).unlink(missing_ok=True)
    queue.schedule_async_request(
        AsyncRequest(time.sleep, (0.5,), [(out / "committed").touch], abort_fns=[(out / "aborted").touch])
    )
    sys.exit(int(sys.argv[2]))  # a graceful stop (an exit interval, a SIGTERM handler)
"""


@pytest.mark.parametrize(("code", "kept"), [(0, True), (3, False)])
def test_sys_exit_0_leaves_a_with_block_as_cleanly_as_its_end(tmp_path, code, kept):
    """``sys.exit(0)`` inside ``with AsyncCallsQueue()`` aborted the save in flight (as any
    exception does); it ends the block cleanly now, as with ``TieredCheckpointManager``."""
    out = subprocess.run(
        [sys.executable, "-c", _SYS_EXIT_SCRIPT, str(tmp_path), str(code)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == code, out.stderr
    assert (tmp_path / "committed").exists() is kept, out.stderr
    assert (tmp_path / "aborted").exists() is not kept, out.stderr
