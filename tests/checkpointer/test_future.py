"""The future ``save_async`` returns, in one process: a wait past its timeout raises
``TimeoutError`` and leaves the save pending; a save whose commit fails raises from ``result()``,
reports through ``done()``, ``exception()`` and its callbacks, and leaves no finished checkpoint;
the next save works."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

from tierpoint import Checkpointer
from tierpoint.errors import CheckpointingError

from .conftest import fresh_module, trained_module


@pytest.fixture(autouse=True)
def _close_the_default_queue():
    yield
    from tierpoint.dcp import saving

    saving._close_default_queue()  # the queue save_async uses ends with the test, as at exit


def test_a_failed_async_save_and_a_timed_out_wait(tmp_path, checkpointer):
    run = f"{tmp_path}/run"
    called = []
    future = checkpointer.save_async(f"{run}/step1", trained_module(), {"step": 1})
    assert isinstance(future, concurrent.futures.Future) and not future.cancel()
    future.add_done_callback(called.append)
    os.makedirs(f"{run}/step1/.metadata.json")  # the commit will fail: a directory in its way
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)  # the worker is still starting: nothing finished yet
    assert called == []
    with pytest.raises(CheckpointingError, match=r"step1/\.metadata\.json"):
        future.result(timeout=120)
    assert future.done() and called == [future]
    assert isinstance(future.exception(), CheckpointingError)
    with pytest.raises(FileNotFoundError):
        Checkpointer.latest_checkpoint(run)  # step1 is not a finished checkpoint

    second = checkpointer.save_async(f"{run}/step2", trained_module(), {"step": 2})
    assert second.result(timeout=120) is None and second.done()
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step2"
    assert checkpointer.load(f"{run}/step2", fresh_module()) == {"step": 2}
