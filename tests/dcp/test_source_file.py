"""Async DCP saves from a source file (:class:`tierpoint.staging.SourceFile`): when every tensor of
the state views the pages of a file whose bytes stay as they are, the snapshot copies nothing (no
staging buffer, no call into the copy engine) and the worker writes the tensors' bytes from the
file, read through its own descriptor; the checkpoint loads bit for bit with tierpoint's loader and
torch's. A tensor outside the file makes the save copy as usual."""

from __future__ import annotations

import mmap
import os
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from tierpoint import dcp
from tierpoint.asyncsave import AsyncCallsQueue, AsyncRequest
from tierpoint.dcp import StagingPool, async_save_request, step_path
from tierpoint.dcp import snapshot as dcp_snapshot
from tierpoint.errors import CheckpointingError
from tierpoint.staging import SourceFile

from .test_writer import assert_same, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300, 70, generator=g),
        "b": torch.arange(10, dtype=torch.int64),
        "h": torch.randn(33, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def _source(path: Path, reference: dict[str, torch.Tensor]) -> tuple[dict, SourceFile]:
    """Write ``reference``'s bytes into ``path`` (after a header, 64-byte aligned) and map them as
    the local tier maps a part: tensors over a private mapping, and the file as their source."""
    blob, offsets = bytearray(b"header" * 20), {}
    for name, t in reference.items():
        blob += bytes(-len(blob) % 64)
        offsets[name] = len(blob)
        blob += t.reshape(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(blob)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = mmap.mmap(fd, len(blob), mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        views, regions = {}, []
        for name, t in reference.items():
            n = t.numel() * t.element_size()
            if not n:
                views[name] = torch.empty(t.shape, dtype=t.dtype)
                continue
            raw = torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=offsets[name])
            views[name] = raw.view(t.dtype).view(t.shape)
            regions.append((raw.data_ptr(), n, offsets[name]))
        return views, SourceFile(fd, regions, owner=views)
    finally:
        os.close(fd)


def _counting_copies(monkeypatch) -> list[int]:
    """Count the snapshot's calls into the copy engine (the tensors it copies each time)."""
    calls: list[int] = []
    engine = dcp_snapshot.copy_tensors

    def counted(sources, targets, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(len(sources))
        return engine(sources, targets, *args, **kwargs)

    monkeypatch.setattr(dcp_snapshot, "copy_tensors", counted)
    return calls


def _assert_loads(path: str, expected: dict) -> None:
    """tierpoint's loader (checksums verified) and torch's own both load ``expected``."""
    for load in (dcp.load, lambda out, p: torch_dcp.load(out, checkpoint_id=p)):
        out = zeros_like_state(expected)
        load(out, path)
        assert_same(out, expected)


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_the_snapshot_copies_nothing_and_the_checkpoint_loads_bit_equal(
    where, tmp_path, shm_dir, monkeypatch
):
    base = tmp_path if where == "disk" else shm_dir  # ram: a save that would stage in place
    reference = _reference()
    views, source = _source(tmp_path / "part", reference)
    copies = _counting_copies(monkeypatch)
    pool = StagingPool()
    path = step_path(base, 1)
    with AsyncCallsQueue() as queue:
        request = async_save_request(
            {"model": views, "step": 7}, path, staging_pool=pool, source_file=source
        )
        queue.schedule_async_request(request)
        assert copies == [] and pool.allocations == 0  # nothing copied, nothing staged
        queue.maybe_finalize_async_calls(blocking=True)
    source.close()
    _assert_loads(path, {"model": reference, "step": 7})
    assert dcp.verify_checkpoint(path).verified  # every item against its checksum


def test_the_worker_reads_the_source_through_its_descriptor(tmp_path, monkeypatch):
    """The file is removed, and another one takes its name, before the busy worker gets to the
    save: the checkpoint still holds the source's bytes."""
    reference = _reference()
    part = tmp_path / "part"
    views, source = _source(part, reference)
    path = step_path(tmp_path, 1)
    with AsyncCallsQueue(max_in_flight=2) as queue:
        queue.schedule_async_request(AsyncRequest(time.sleep, (1.0,), []))  # the worker is busy
        queue.schedule_async_request(async_save_request({"model": views}, path, source_file=source))
        part.unlink()
        _source(part, {k: torch.zeros_like(t) for k, t in reference.items()})[1].close()
        queue.maybe_finalize_async_calls(blocking=True)
    source.close()
    _assert_loads(path, {"model": reference})


def test_a_tensor_outside_the_source_makes_the_snapshot_copy(tmp_path, monkeypatch):
    reference = _reference()
    views, source = _source(tmp_path / "part", reference)
    extra = torch.randn(5, 5)
    copies = _counting_copies(monkeypatch)
    pool = StagingPool()
    path = step_path(tmp_path, 1)
    state = {"model": {**views, "extra": extra}}
    with AsyncCallsQueue() as queue:
        request = async_save_request(state, path, staging_pool=pool, source_file=source)
        queue.schedule_async_request(request)
        assert copies and pool.allocations == 1  # copied as usual
        queue.maybe_finalize_async_calls(blocking=True)
    source.close()
    _assert_loads(path, {"model": {**reference, "extra": extra}})


def test_a_transposed_view_has_no_place_in_the_source(tmp_path):
    views, source = _source(tmp_path / "part", _reference())
    w = views["w"]
    assert source.offset_of(w) is not None
    assert source.offset_of(w[1:]) == source.offset_of(w) + 70 * 4  # a view of it, further on
    assert source.offset_of(w.t()) is None  # not its bytes back to back
    assert source.offset_of(torch.randn(3)) is None  # elsewhere in memory
    source.close()
    source.close()  # idempotent


def test_a_synchronous_save_takes_no_source_file(tmp_path):
    with pytest.raises(TypeError, match="source_file"):
        dcp.save({"a": torch.zeros(2)}, step_path(tmp_path, 1), source_file=None)


def test_the_worker_unmaps_the_source_once_the_save_is_finalized(tmp_path):
    """A source file is read by one save only: its mapping leaves the worker at finalize (else it
    would keep a retired part's pages, RAM on /dev/shm, until the next save)."""
    views, source = _source(tmp_path / "part", _reference())
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(
            async_save_request({"model": views}, step_path(tmp_path, 1), source_file=source)
        )
        queue.maybe_finalize_async_calls(blocking=True)
        source.close()
        worker_maps = Path(f"/proc/{queue._worker.process.pid}/maps")
        part = str(tmp_path / "part")
        deadline = time.monotonic() + 30
        while part in worker_maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert part not in worker_maps.read_text()


def test_a_worker_killed_before_the_save_is_finalized_fails_the_save_not_the_queue(tmp_path):
    """The worker dies (the OOM killer) with a save from a source file pending: finalizing raises
    that save's error, and the next save runs on a new worker (before: unmapping the source in
    the dead worker raised BrokenPipeError out of the queue, the save popped and never concluded)."""
    reference = _reference()
    views, source = _source(tmp_path / "part", reference)
    with AsyncCallsQueue(max_in_flight=2) as queue:
        queue.schedule_async_request(AsyncRequest(time.sleep, (30.0,), []))  # the worker is busy
        queue.schedule_async_request(
            async_save_request({"model": views}, step_path(tmp_path, 1), source_file=source)
        )
        os.kill(queue._worker.process.pid, signal.SIGKILL)
        for failed in ("async checkpoint call", "DCP save"):  # each raises its own error
            with pytest.raises(CheckpointingError, match=f"{failed}.*worker process died"):
                queue.maybe_finalize_async_calls(blocking=True)
        queue.schedule_async_request(
            async_save_request({"model": views}, step_path(tmp_path, 2), source_file=source)
        )
        queue.maybe_finalize_async_calls(blocking=True)
    source.close()
    _assert_loads(step_path(tmp_path, 2), {"model": reference})
