"""The pinning lifecycle on CPU: a fake runtime in place of CUDA's (the one seam,
``tierpoint.pinning.runtime``) records every registration and refuses, like CUDA, a range that
overlaps a registered one; every mapping checks, when it is unmapped (closed or garbage-collected),
that no registered range lies in it. Exercised through the public entry points: several local
managers and queues one after another, a layout change, a local tier on /dev/shm (its part files
pinned), DCP async saves (in memory and in place on /dev/shm), a registration that fails, and
interpreter exit."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import mmap
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tierpoint import CheckpointingError, pinning
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import StagingPool, async_save, step_path
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.testing import run_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

_ALREADY_REGISTERED, _NOT_REGISTERED, _OUT_OF_MEMORY = 712, 713, 2


class FakeRuntime:
    """Stands in for CUDA's runtime: serves any tensor, keeps the registered ranges, and records
    what CUDA would have refused or what would have broken it (``violations``)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.live: dict[int, int] = {}  # address -> bytes
        self.registered = 0
        self.unregistered = 0
        self.pending: int | None = None  # the error a failed call left, until cleared
        self.violations: list[str] = []

    def copy_device(self, tensors) -> int | None:
        return 0

    def register(self, address: int, nbytes: int, device: int) -> int:
        self._no_pending_error("register")
        if self.fail:
            self.pending = _OUT_OF_MEMORY
            return _OUT_OF_MEMORY
        if self._overlapping(address, nbytes):
            self.violations.append(f"registered twice: {address:#x}+{nbytes}")
            self.pending = _ALREADY_REGISTERED
            return _ALREADY_REGISTERED
        self.live[address] = nbytes
        self.registered += 1
        return 0

    def unregister(self, address: int, device: int) -> int:
        self._no_pending_error("unregister")
        if self.live.pop(address, None) is None:
            self.violations.append(f"unregistered, never registered: {address:#x}")
            self.pending = _NOT_REGISTERED
            return _NOT_REGISTERED
        self.unregistered += 1
        return 0

    def clear_error(self) -> None:
        self.pending = None

    def error_name(self, code: int) -> str:
        return f"fake error {code}"

    def unmapping(self, address: int, nbytes: int) -> None:
        if self._overlapping(address, nbytes):
            self.violations.append(f"unmapped while registered: {address:#x}+{nbytes}")

    def _overlapping(self, address: int, nbytes: int) -> bool:
        return any(a < address + nbytes and address < a + n for a, n in self.live.items())

    def _no_pending_error(self, call: str) -> None:
        if self.pending is not None:
            self.violations.append(f"{call} with error {self.pending} left pending")


@contextmanager
def fake_runtime(fail: bool = False) -> Iterator[FakeRuntime]:
    """Put a :class:`FakeRuntime` in place of CUDA's, and make every mapping made meanwhile report
    its unmapping to it (``close`` or garbage collection, whichever comes first)."""
    fake = FakeRuntime(fail)

    class CheckedMap(mmap.mmap):
        def __init__(self, *args: object, **kwargs: object) -> None:
            view = ctypes.c_char.from_buffer(self)  # an export: released again right below
            self._range = (ctypes.addressof(view), len(self))
            del view
            self._open = True

        def _unmapped(self) -> None:
            if self.__dict__.pop("_open", False):
                fake.unmapping(*self._range)

        def close(self) -> None:
            super().close()  # raises BufferError while views exist: then it stays mapped
            self._unmapped()

        def __del__(self) -> None:
            self._unmapped()

    saved_runtime, saved_map = pinning.runtime, mmap.mmap
    pinning.runtime = lambda: fake
    mmap.mmap = CheckedMap
    try:
        yield fake
    finally:
        pinning.runtime, mmap.mmap = saved_runtime, saved_map


def _state(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 64, generator=g),
        "b": torch.randn(64, generator=g),
        "step": seed,
    }


def _save_async(
    manager: LocalCheckpointManager, queue: AsyncCallsQueue, it: int, rows: int
) -> None:
    request = manager.save(BasicTensorAwareStateDict(_state(rows, it)), it, is_async=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)


def _loads(root: Path, it: int, rows: int) -> None:
    ta, ckpt_id = LocalCheckpointManager(root, session_id="job").load()
    assert ckpt_id.iteration == it
    assert torch.equal(ta.state_dict["w"], _state(rows, it)["w"])


@pytest.mark.parametrize("overlap", [False, True])
def test_managers_and_queues_one_after_another_unpin_before_unmapping(tmp_path, overlap):
    """The issue's sequence: four managers, each with its own queue, saved through, closed, dropped,
    collected; then a fifth. Each buffer is pinned once and unpinned before it is unmapped; none
    overlaps a registration left behind."""
    with fake_runtime() as fake:
        for k in range(5):
            root = tmp_path / str(k)
            manager = LocalCheckpointManager(root, session_id="job", recycle=False)
            queue = AsyncCallsQueue(overlap_snapshot=overlap)
            for it in (1, 2):
                _save_async(manager, queue, it, rows=256)
            queue.close()
            assert len(fake.live) == 1  # the manager's buffer, pinned once for both saves
            del manager, queue
            gc.collect()
            assert fake.live == {}, "a dropped manager's buffer is still registered"
            _loads(root, 2, rows=256)
    assert fake.violations == [] and fake.pending is None
    assert fake.registered == fake.unregistered == 5


def test_a_layout_change_unpins_the_old_buffer_before_unmapping_it(tmp_path):
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(tmp_path, session_id="job", recycle=False)
        with AsyncCallsQueue() as queue:
            _save_async(manager, queue, 1, rows=256)
            _save_async(manager, queue, 2, rows=512)  # a new layout: a new buffer
            _save_async(manager, queue, 3, rows=512)
            assert (fake.registered, fake.unregistered, len(fake.live)) == (2, 1, 1)
        _loads(tmp_path, 3, rows=512)
        del manager
        gc.collect()
    assert fake.violations == [] and fake.live == {} and fake.pending is None


def test_warm_up_pins_the_staging_buffer_before_the_first_save_which_reuses_it(tmp_path):
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(tmp_path, session_id="job", recycle=False)
        manager.warm_up(BasicTensorAwareStateDict(_state(256, 0)), wait=True)
        assert (fake.registered, len(fake.live)) == (1, 1)  # pinned ahead, off the save
        with AsyncCallsQueue() as queue:
            for it in (1, 2):
                _save_async(manager, queue, it, rows=256)
        assert fake.registered == 1  # the saves found it pinned
        _loads(tmp_path, 2, rows=256)
        del manager
        gc.collect()
    assert fake.violations == [] and fake.live == {} and fake.pending is None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_ram_tier_pins_each_part_file_once_and_unpins_it_before_unmapping(shm_dir, overlap):
    """On /dev/shm the snapshot goes into the part files: warm-up pins the spares it makes, the
    saves cycle through those files without pinning again, a layout change resizes them (the old
    mappings unpinned before they go), and a dropped manager leaves nothing registered."""
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=2)
        manager.warm_up(BasicTensorAwareStateDict(_state(256, 0)), wait=True)
        spares = fake.registered
        assert spares == 3 and len(fake.live) == 3  # keep_last + 1 files, pinned ahead
        with AsyncCallsQueue(overlap_snapshot=overlap) as queue:
            for it in (1, 2, 3, 4, 5):
                _save_async(manager, queue, it, rows=256)
            assert fake.registered == spares  # the files came back, pinned already
            _save_async(manager, queue, 6, rows=512)  # another layout: files resized
            _save_async(manager, queue, 7, rows=512)
            assert fake.unregistered >= 1 and len(fake.live) <= 3
        _loads(shm_dir, 7, rows=512)
        del manager, queue
        gc.collect()
    assert fake.violations == [] and fake.live == {} and fake.pending is None
    assert fake.registered == fake.unregistered


def test_a_sync_save_that_resizes_a_pinned_spare_drops_its_mapping_first(shm_dir):
    """A sync save writes a spare without the kept mapping (and may shrink it): that mapping is
    unpinned and unmapped first, so a later async save of the old size maps and pins the file
    anew instead of copying through a registration over pages the file no longer has."""
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(shm_dir, session_id="job")
        manager.warm_up(BasicTensorAwareStateDict(_state(256, 0)), wait=True)
        with AsyncCallsQueue() as queue:
            _save_async(manager, queue, 1, rows=256)
            before = fake.unregistered
            manager.save(BasicTensorAwareStateDict(_state(128, 2)), 2)  # sync, smaller
            assert fake.unregistered == before + 1  # the spare's mapping went first
            _save_async(manager, queue, 3, rows=256)
            _save_async(manager, queue, 4, rows=256)
        _loads(shm_dir, 4, rows=256)
        del manager, queue
        gc.collect()
    assert fake.violations == [] and fake.live == {} and fake.pending is None


@pytest.mark.parametrize("aborted", ["its own save", "another save"])
def test_an_abort_while_a_snapshot_copies_into_a_part_file_leaves_it_mapped(shm_dir, aborted):
    """A save aborted while its snapshot still copies into the part file (a stuck device copy the
    queue gave up on): the file's name goes, its mapping stays mapped and pinned. The abort of
    another iteration leaves that snapshot's mapping to the cache as usual."""
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(shm_dir, session_id="job")
        manager.warm_up(BasicTensorAwareStateDict(_state(256, 0)), wait=True)
        in_place, mappings = manager._saver.in_place, manager._store.mappings
        with AsyncCallsQueue() as queue:
            _save_async(manager, queue, 1, rows=256)
            spare = next(p for p in (shm_dir / "job" / "0").iterdir() if p.suffix == ".free")
            copying = mappings.map(str(spare), spare.stat().st_size, writable=True)
            mappings.pin(copying, 0)
            live = len(fake.live)
            in_place._copying = (2, copying)  # as while iteration 2's snapshot copies
            manager._saver.abort(2 if aborted == "its own save" else 3)
            spare.unlink()
            manager._store.forget_removed_files()
            if aborted == "its own save":
                assert copying[0] is not None and not copying[0].closed
                assert len(fake.live) == live  # still registered
                assert not in_place.busy
            else:
                assert copying[0] is not None and copying[0].closed
                assert len(fake.live) == live - 1
                in_place._copying = None
            _save_async(manager, queue, 2, rows=256)
        _loads(shm_dir, 2, rows=256)
    assert fake.violations == [] and fake.pending is None


def _pin_then_abort(entry, device, pin, in_place):
    pinned = pin(entry, device)
    in_place.abort(1)  # as the training thread would, the queue having given up on the snapshot
    return pinned


def test_a_snapshot_aborted_before_it_copies_copies_nothing(shm_dir):
    """The abort lands while the snapshot maps and pins the part file: it copies nothing, and the
    save fails on its own (the file is removed with the aborted iteration)."""
    with fake_runtime() as fake:
        manager = LocalCheckpointManager(shm_dir, session_id="job")
        mappings = manager._store.mappings
        mappings.pin = functools.partial(
            _pin_then_abort, pin=mappings.pin, in_place=manager._saver.in_place
        )
        with AsyncCallsQueue() as queue:
            request = manager.save(BasicTensorAwareStateDict(_state(256, 1)), 1, is_async=True)
            queue.schedule_async_request(request)
            with pytest.raises(CheckpointingError, match="iteration 1 was aborted: nothing copied"):
                queue.maybe_finalize_async_calls(blocking=True)
            assert fake.registered == 1 and fake.live == {}  # removed with iteration 1, unpinned
            del mappings.pin
            _save_async(manager, queue, 2, rows=256)
        _loads(shm_dir, 2, rows=256)
    assert fake.violations == [] and fake.pending is None


def test_dcp_warm_up_pins_ahead_and_the_pool_unpins_before_unmapping(tmp_path):
    from tierpoint.dcp import warm_up

    with fake_runtime() as fake:
        pool = StagingPool()
        warm_up(_state(256, 1), step_path(tmp_path, 1), staging_pool=pool)
        assert pool.wait_for_spare(60)
        assert fake.registered == 1  # pinned ahead of the first save
        with AsyncCallsQueue() as queue:
            for step in (1, 2):
                async_save(
                    _state(256, step), step_path(tmp_path, step), queue=queue, staging_pool=pool
                ).result(timeout=120)
        assert fake.registered == 1 and pool.allocations == 1  # the saves took that buffer
        pool.close()
        gc.collect()
    assert fake.violations == [] and fake.live == {} and fake.pending is None


def _dcp_saves(rank: int, world: int, root: str, in_place: bool) -> dict:
    from tierpoint.dcp.writer import stages_in_place

    with fake_runtime() as fake:
        pool = StagingPool()
        with AsyncCallsQueue() as queue:
            for step, rows in ((1, 256), (2, 256), (3, 512), (4, 512)):  # a layout change at 3
                future = async_save(
                    _state(rows, step), step_path(root, step), queue=queue, staging_pool=pool
                )
                future.result(timeout=120)
                pool.wait_for_spare(60)
        pool.close()
        del pool
        gc.collect()
    return {
        "in_place": stages_in_place(root) == in_place,
        "registered": fake.registered,
        "live": len(fake.live),
        "violations": fake.violations,
        "pending": fake.pending,
    }


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_dcp_async_saves_unpin_every_buffer_before_unmapping_it(tmp_path, shm_dir, where):
    """Reused memfd buffers (disk) and the in-place files of /dev/shm, each replaced by a spare
    pinned in the background, across a layout change."""
    root = tmp_path if where == "disk" else shm_dir
    (r,) = run_ranks(_dcp_saves, 1, str(root), where == "ram", timeout=240)
    assert r["in_place"] and r["violations"] == [] and r["pending"] is None
    assert r["live"] == 0 and r["registered"] >= 2


def test_a_failed_registration_warns_once_and_saves_unpinned(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="tierpoint")
    with fake_runtime(fail=True) as fake:
        manager = LocalCheckpointManager(tmp_path, session_id="job", recycle=False)
        with AsyncCallsQueue() as queue:
            for it in (1, 2, 3):
                _save_async(manager, queue, it, rows=256)
        _loads(tmp_path, 3, rows=256)
    warned = [r for r in caplog.records if "page-lock" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "fake error 2" in warned[0].getMessage()
    assert fake.pending is None and fake.violations == [] and fake.registered == 0


def test_without_cuda_nothing_touches_the_cuda_runtime(tmp_path, monkeypatch):
    if torch.cuda.is_available():  # pragma: no cover - no GPU here
        pytest.skip("a GPU is present")
    assert pinning.runtime() is None and pinning.copy_device([torch.ones(2)]) is None

    def refuse(*args: object) -> None:
        raise AssertionError("touched CUDA")

    monkeypatch.setattr(torch.cuda, "cudart", refuse)
    manager = LocalCheckpointManager(tmp_path, session_id="job", recycle=False)
    with AsyncCallsQueue() as queue:
        _save_async(manager, queue, 1, rows=64)
    assert manager._stager.buffer is not None and not manager._stager.buffer.pinned


_EXIT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_pinning import fake_runtime
from tierpoint import fileformat, tree
from tierpoint.staging import Stager
import torch

with fake_runtime() as fake:
    stager = Stager()
    flat = tree.flatten({{"w": torch.ones(1 << 16)}})
    stager.stage(flat, fileformat.plan_part(flat))
    print("pinned", stager.buffer.pinned, flush=True)
    real_unregister = fake.unregister
    def unregister(address, device):
        print("unregistered", real_unregister(address, device), flush=True)
        return 0
    fake.unregister = unregister
# exits with the stager (and its pinned buffer) alive
"""


_EXIT_RAM_TIER_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_pinning import fake_runtime
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
import torch

with fake_runtime() as fake:
    manager = LocalCheckpointManager({root!r}, session_id="job")
    manager.warm_up(BasicTensorAwareStateDict({{"w": torch.ones(1 << 16)}}), wait=True)
    print("pinned", len(fake.live), flush=True)
    real_unregister = fake.unregister
    def unregister(address, device):
        print("unregistered", real_unregister(address, device), flush=True)
        return 0
    fake.unregister = unregister
# exits with the manager (and its pinned part files) alive
"""


@pytest.mark.parametrize("held", ["staging buffer", "ram tier files"])
def test_interpreter_exit_unpins_what_is_still_held(shm_dir, held):
    tests = str(Path(__file__).parent)
    script = (
        _EXIT_SCRIPT.format(tests=tests)
        if held == "staging buffer"
        else _EXIT_RAM_TIER_SCRIPT.format(tests=tests, root=str(shm_dir))
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split("\n")
    if held == "staging buffer":
        assert lines[:2] == ["pinned True", "unregistered 0"], done.stdout
    else:
        assert lines[:3] == ["pinned 2", "unregistered 0", "unregistered 0"], done.stdout
