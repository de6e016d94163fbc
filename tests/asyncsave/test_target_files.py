"""Files the worker's jobs fill stay mapped from one save to the next, and no longer than about a
second once deleted (a deleted file's mapping would hold its RAM on tmpfs)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from tierpoint import CheckpointingError, fileformat
from tierpoint.asyncsave import AsyncCallsQueue, target_files
from tierpoint.asyncsave.worker import Worker
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.local.jobs import seal_staged_part
from tierpoint.tree import flatten


@pytest.fixture
def keeping():
    target_files.keep_mappings(True)
    try:
        yield
    finally:
        target_files.keep_mappings(False)


def _fill(path: Path, nbytes: int, value: int) -> None:
    with target_files.mapped_file(path, nbytes) as data:
        data.fill_(value)


def test_outside_the_worker_nothing_stays_mapped(shm_dir):
    f = shm_dir / "f"
    f.write_bytes(b"\0" * 8192)
    _fill(f, 8192, 3)
    assert target_files.kept_count() == 0 and f.read_bytes() == b"\3" * 8192


def test_a_kept_mapping_serves_the_same_file_under_a_new_name(shm_dir, keeping):
    f, g = shm_dir / "f", shm_dir / "g"
    f.write_bytes(b"\0" * 8192)
    _fill(f, 8192, 1)
    os.replace(f, g)  # a part retired to a spare, recycled as the next part
    _fill(g, 8192, 2)
    assert target_files.kept_count() == 1 and g.read_bytes() == b"\2" * 8192


def test_deleted_resized_or_failed_files_lose_their_mappings(shm_dir, keeping):
    files = [shm_dir / name for name in "abc"]
    for f in files:
        f.write_bytes(b"\0" * 8192)
        _fill(f, 8192, 1)
    with pytest.raises(RuntimeError), target_files.mapped_file(shm_dir / "a", 8192):
        raise RuntimeError("a failed copy")
    assert target_files.kept_count() == 2  # a's mapping went with the failure
    os.truncate(files[1], 4096)  # a layout change
    files[2].unlink()
    target_files.sweep()
    assert target_files.kept_count() == 0
    _fill(files[1], 4096, 5)  # mapped anew at its new size
    assert files[1].read_bytes() == b"\5" * 4096


def test_at_most_max_kept_mappings(shm_dir, keeping):
    for k in range(target_files.MAX_KEPT + 3):
        f = shm_dir / str(k)
        f.write_bytes(b"\0" * 4096)
        _fill(f, 4096, 1)
    assert target_files.kept_count() == target_files.MAX_KEPT


def _mapped_here(pid: int, directory: Path) -> list[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in lines if str(directory) in line]


def _seconds_until_unmapped(pids: list[int], directory: Path, limit: float = 10) -> float:
    """How long until no process of ``pids`` maps a file of ``directory`` (``limit``: given up)."""
    start = time.monotonic()
    while any(_mapped_here(pid, directory) for pid in pids):
        if time.monotonic() - start > limit:
            return float("inf")
        time.sleep(0.1)
    return time.monotonic() - start


def _one_result(worker: Worker, timeout: float = 60.0) -> tuple:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = worker.results(0.5)
        if done:
            return done[0]
    raise AssertionError("the worker did not answer")


def _seal_in_worker(worker: Worker, shm_dir: Path, saves: int) -> None:
    """``saves`` saves of one state whose snapshot filled a recycled spare in place (as on a RAM
    tier), each sealed by ``worker`` and retired to the spare again; checked as they go."""
    flat = flatten({"w": torch.randn(100_000), "b": torch.arange(10)})
    plan = fileformat.plan_part(flat, None)
    spare = shm_dir / "spare"
    spare.write_bytes(b"\0" * plan.file_size())
    for k in range(1, saves + 1):
        part = shm_dir / f"part{k}"
        dirty = fileformat.dirty_name(part)
        fileformat.prepare_planned(dirty, plan, recycle=spare)
        with open(dirty, "r+b") as f:  # the snapshot's bytes, each in its planned place
            for t, (begin, _) in zip(flat.tensors, plan.offsets):
                f.seek(plan.data_start() + begin)
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        worker.submit(k, seal_staged_part, (str(part), plan), {})
        call_id, ok, result, _ = _one_result(worker)
        assert (call_id, ok, result) == (k, True, plan.file_size())
        fileformat.verify(part)
        assert torch.equal(fileformat.read(part)["w"], flat.tensors[0])
        mapped = _mapped_here(worker.process.pid, shm_dir)
        assert len(mapped) == 1 and mapped[0].endswith(str(part)), mapped
        os.replace(part, spare)  # retired: the next save recycles it


def test_the_worker_keeps_a_spare_mapped_across_saves_and_unmaps_it_once_deleted(shm_dir):
    """The worker hashes and seals a part filled in place through a mapping it keeps for the next
    save of the same file, and unmaps it about a second after the file is deleted."""
    worker = Worker()
    try:
        worker.wait_ready(60)
        _seal_in_worker(worker, shm_dir, 2)
        (shm_dir / "spare").unlink()
        # about a second (a sweep); never without one
        assert _seconds_until_unmapped([worker.process.pid], shm_dir) < 6
    finally:
        worker.stop()


def test_a_busy_worker_unmaps_a_deleted_file_at_its_next_call(shm_dir):
    """Calls coming more often than the idle sweeps (saves under a second apart, or a failed
    save's retries on a full RAM disk) still let a deleted file's pages go: each call sweeps first
    (the worker held them as long as the calls came)."""
    worker = Worker()
    try:
        worker.wait_ready(60)
        _seal_in_worker(worker, shm_dir, 1)
        (shm_dir / "spare").unlink()
        for k in range(100, 110):
            worker.submit(k, os.getpid, (), {})
            assert _one_result(worker)[:2] == (k, True)
            if not _mapped_here(worker.process.pid, shm_dir):
                break
            time.sleep(0.3)
        assert not _mapped_here(worker.process.pid, shm_dir)
    finally:
        worker.stop()


def test_a_file_of_another_size_than_planned_is_refused_not_mapped(shm_dir):
    f = shm_dir / "f"
    f.write_bytes(b"\0" * 4096)
    with pytest.raises(CheckpointingError, match="4096 bytes where 8192 were planned"):
        _fill(f, 8192, 1)  # mapped past its end, a write there would kill the worker (SIGBUS)


def _children() -> list[int]:
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def test_a_wiped_ram_tier_leaves_no_mapping_in_the_worker(shm_dir):
    """Async saves on a RAM tier: the worker keeps the parts it sealed mapped between saves; once
    the tier's directory is wiped (a node cleaned up under a running job), their RAM is not held."""
    manager = LocalCheckpointManager(shm_dir, session_id="job")
    with AsyncCallsQueue() as queue:
        for it in (1, 2, 3):
            state = {"w": torch.randn(200_000), "step": it}
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
            )
            queue.maybe_finalize_async_calls(blocking=True)
        workers = [pid for pid in _children() if _mapped_here(pid, shm_dir)]
        assert workers, "the worker keeps no part mapped: every save maps it anew"
        shutil.rmtree(shm_dir / "job")
        assert _seconds_until_unmapped(workers, shm_dir) < 6
