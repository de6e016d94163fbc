"""The device snapshot: a save's copy of the state in reused buffers on the tensors' own devices
(CPU here; CUDA in tests/gpu), held by one save at a time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tierpoint import CheckpointingError, fileformat
from tierpoint.device_snapshot import DeviceSnapshot
from tierpoint.staging import copy_planned, planned_view
from tierpoint.tree import flatten


def _tensors(rows: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return [
        torch.randn(rows, 33, generator=g),
        torch.randn(rows, 5, generator=g).t(),  # not contiguous
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.arange(rows, dtype=torch.int64),
        torch.rand(9, generator=g) > 0.5,
        torch.empty(0, 3),
    ]


def test_copies_are_equal_and_the_buffers_reused_until_the_layout_changes():
    snap = DeviceSnapshot()
    tensors = _tensors()
    copies, ticket = snap.take(tensors, wait=5)
    for t, c in zip(tensors, copies):
        assert (c.dtype, c.shape) == (t.dtype, t.shape) and torch.equal(c, t)
        assert c.numel() == 0 or c.data_ptr() != t.data_ptr()
    where = [c.data_ptr() for c in copies if c.numel()]
    ticket.release()
    tensors[0].add_(1)  # training goes on: the next save's copy follows
    again, ticket = snap.take(tensors, wait=5)
    assert [c.data_ptr() for c in again if c.numel()] == where
    assert torch.equal(again[0], tensors[0])
    ticket.release()
    bigger = _tensors(rows=128)
    copies, ticket = snap.take(bigger, wait=5)  # a layout change: new buffers
    assert all(torch.equal(c, t) for c, t in zip(copies, bigger))
    ticket.release()
    snap.close()


def test_the_next_save_waits_for_the_reader_and_gives_up_with_a_clear_error():
    snap = DeviceSnapshot()
    tensors = _tensors()
    _, ticket = snap.take(tensors, wait=5)
    start = time.monotonic()
    with pytest.raises(CheckpointingError, match="still reads the device snapshot after 0.3 s"):
        snap.take(tensors, wait=0.3)
    assert time.monotonic() - start >= 0.3
    threading.Timer(0.2, ticket.release).start()  # the reader ends a little later
    copies, second = snap.take(tensors, wait=10)
    assert torch.equal(copies[0], tensors[0])
    second.release()


def test_a_save_never_scheduled_is_voided_by_the_next_one():
    snap = DeviceSnapshot()
    tensors = _tensors()
    _, stale = snap.take(tensors, wait=5)
    _, current = snap.take(tensors, wait=0, void_unscheduled=True)  # no wait: nothing reads
    current.check()
    with pytest.raises(CheckpointingError, match="overwritten by a later save"):
        stale.check()
    stale.release()  # a void ticket's release frees nothing
    with pytest.raises(CheckpointingError, match="still reads"):
        snap.take(tensors, wait=0.1)
    current.release()
    snap.take(tensors, wait=0.1)[1].release()


def test_prepare_makes_the_buffers_the_first_take_uses():
    snap = DeviceSnapshot()
    tensors = _tensors()
    assert snap.nbytes == 0
    snap.prepare(tensors)
    assert snap.nbytes >= sum(t.numel() * t.element_size() for t in tensors)
    first, ticket = snap.take(tensors, wait=5)
    ticket.release()
    snap.prepare(tensors)  # the same layout: kept, not made again
    second, ticket = snap.take(tensors, wait=5)
    ticket.release()
    assert [c.data_ptr() for c in first if c.numel()] == [c.data_ptr() for c in second if c.numel()]
    snap.close()
    assert snap.nbytes == 0


def test_given_a_plan_the_copies_form_an_image_of_the_data_section_reused_by_steady_takes():
    snap = DeviceSnapshot()
    tensors = _tensors()
    flat = flatten({"t": tensors})
    plan = fileformat.plan_part(flat, {"iteration": 1})
    first, ticket = snap.take(flat.tensors, wait=5, plan=plan)
    image = ticket.image
    assert image is not None and image.numel() == plan.data_size
    for k, t in enumerate(flat.tensors):
        assert torch.equal(planned_view(image, plan, k), t)  # each at its planned place
    ticket.release()
    flat.tensors[0].add_(1)
    second, ticket = snap.take(flat.tensors, wait=5, plan=plan)
    assert all(a is b for a, b in zip(first, second))  # the same views: nothing allocated
    assert ticket.image is image
    data = torch.zeros(plan.data_size, dtype=torch.uint8)
    assert copy_planned(flat, plan, data, pinned=False, image=image) is None  # in one piece
    for k, t in enumerate(flat.tensors):
        assert torch.equal(planned_view(data, plan, k), t)
    hashed = copy_planned(flat, plan, torch.zeros_like(data), pinned=False, hash=True, image=image)
    want = copy_planned(flat, plan, torch.zeros_like(data), pinned=False, hash=True)
    assert hashed is not None and hashed == want  # a host image hashed as it is copied
    ticket.release()


def test_no_memory_for_the_snapshot_is_a_clear_error_and_the_next_take_tries_again(monkeypatch):
    snap = DeviceSnapshot()
    tensors = _tensors()
    real = torch.empty

    def out_of_memory(*args, **kwargs):
        if kwargs.get("dtype") == torch.uint8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", out_of_memory)
    with pytest.raises(CheckpointingError, match="needs 0.00 GB on cpu .* without device_snapshot"):
        snap.take(tensors, wait=5)
    monkeypatch.setattr(torch, "empty", real)
    copies, ticket = snap.take(tensors, wait=5)  # not held by the failed take
    assert all(torch.equal(c, t) for c, t in zip(copies, tensors))
    ticket.release()
