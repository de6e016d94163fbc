"""The local tier with CUDA states: sync, async and overlapped saves load back bit for bit, on the
devices they came from, also when training changes the state right after the snapshot; a layout
change between saves; mixed CPU/CUDA states."""

from __future__ import annotations

import pytest
import torch

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager

from .helpers import (
    DEVICE,
    assert_same,
    clone,
    cuda_still_works,
    model_state,
    needs_gpu,
    odd_state,
    scribble,
)

pytestmark = needs_gpu


@pytest.fixture(scope="module")
def queue_for():
    """``queue_for(overlap)``: one queue (and worker process) of each kind for this module's many
    round trips; a worker started per test would take most of their time on a GPU machine."""
    queues: dict[bool, AsyncCallsQueue] = {}

    def get(overlap: bool) -> AsyncCallsQueue:
        if overlap not in queues:
            queues[overlap] = AsyncCallsQueue(overlap_snapshot=overlap)
        return queues[overlap]

    yield get
    for queue in queues.values():
        queue.close()


def _save(manager, queue, state: dict, iteration: int, mode: str) -> None:
    """``mode``: sync, async, overlapped, or device (``device_snapshot``: ``save`` returns with
    the state copied on its device; the queue is overlapped, with nothing to wait for)."""
    ta = BasicTensorAwareStateDict(state)
    if mode == "sync":
        manager.save(ta, iteration)
        return
    queue.schedule_async_request(manager.save(ta, iteration, is_async=True))
    if mode == "overlapped":
        queue.wait_for_snapshot()
    scribble(state)  # training goes on: the checkpoint must hold the snapshot
    queue.maybe_finalize_async_calls(blocking=True)


def _load(root, iteration: int) -> dict:
    ta, ckpt_id = LocalCheckpointManager(root, session_id="job").load()
    assert ckpt_id.iteration == iteration
    return ta.state_dict


@pytest.mark.parametrize("mode", ["sync", "async", "overlapped", "device"])
@pytest.mark.parametrize("state_of", [model_state, odd_state], ids=["model", "odd"])
def test_round_trip(tier_root, mode, state_of, queue_for):
    """On a disk tier (staged in pinned memory) and on a RAM tier (the snapshot copied into the
    recycled part files' pinned pages), three saves (the third rewrites a spare) load back bit for
    bit on the devices they came from. The odd state holds non-contiguous views, an expanded one,
    tied weights, 0-dim and empty tensors, small dtypes and a CPU tensor beside them (the device
    snapshot's image takes strided sources on the device)."""
    manager = LocalCheckpointManager(tier_root, session_id="job", device_snapshot=mode == "device")
    queue = queue_for(mode in ("overlapped", "device"))
    for it in (1, 2, 3):
        state = state_of(it)
        want = clone(state)
        _save(manager, queue, state, it, mode)
        assert_same(_load(tier_root, it), want)  # device types included
    cuda_still_works()


@pytest.mark.parametrize("mode", ["async", "overlapped", "device"])
def test_layout_change_between_saves(tmp_path, mode, queue_for):
    manager = LocalCheckpointManager(tmp_path, session_id="job", device_snapshot=mode == "device")
    queue = queue_for(mode in ("overlapped", "device"))
    for it, layers, width in ((1, 2, 256), (2, 3, 256), (3, 3, 512), (4, 2, 128)):
        state = model_state(it, layers=layers, width=width)
        want = clone(state)
        _save(manager, queue, state, it, mode)
        assert_same(_load(tmp_path, it), want)
    cuda_still_works()


def test_mixed_cpu_and_cuda_tensors_keep_their_devices(tmp_path):
    state = model_state(5)
    state["model"]["embed.cpu"] = torch.randn(1000, 64)  # an embedding kept on the host
    state["rng"] = {"cpu": torch.get_rng_state()}
    if DEVICE == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state()
    want = clone(state)
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    with AsyncCallsQueue() as queue:
        _save(manager, queue, state, 5, "async")
    got = _load(tmp_path, 5)
    assert_same(got, want)
    assert got["model"]["embed.cpu"].device.type == "cpu"
    cuda_still_works()


@pytest.mark.parametrize("mode", ["async", "overlapped"])
def test_warm_up_pins_ahead_and_the_first_saves_use_its_buffer(tmp_path, mode):
    state = model_state(7)
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.warm_up(BasicTensorAwareStateDict(state), wait=True)
    warmed = manager._stager.buffer
    assert warmed is not None
    assert warmed.pinned == (DEVICE == "cuda")  # pinned ahead, not inside the first save
    with AsyncCallsQueue(overlap_snapshot=mode == "overlapped") as queue:
        for it in (7, 8):
            want = clone(state)
            _save(manager, queue, state, it, mode)
            assert manager._stager.buffer is warmed
            assert_same(_load(tmp_path, it), want)
    cuda_still_works()


@pytest.mark.parametrize("mode", ["async", "overlapped"])
def test_a_ram_tier_pins_its_part_files_ahead_and_the_snapshots_land_in_them(shm_dir, mode):
    """On /dev/shm the part files are the staging memory: warm_up makes, maps and pins the spares
    (keep_last + 1 files), no staging buffer is made, and the saves cycle through those files."""
    state = model_state(21)
    manager = LocalCheckpointManager(shm_dir, session_id="job")
    manager.warm_up(BasicTensorAwareStateDict(state), wait=True)
    mappings = manager._store.mappings
    pinned = mappings.pinned_bytes
    assert len(mappings) == 2
    assert (pinned > 0) == (DEVICE == "cuda")  # pinned ahead, not inside the first saves
    with AsyncCallsQueue(overlap_snapshot=mode == "overlapped") as queue:
        for it in (21, 22, 23, 24):
            want = clone(state)
            _save(manager, queue, state, it, mode)
            # Copied out: tensors viewing a part file would keep it from becoming a spare.
            reader = LocalCheckpointManager(shm_dir, session_id="job", mmap_load=False)
            assert_same(reader.load()[0].state_dict, want)
            assert manager._stager.buffer is None  # no second host copy of the state
    assert len(mappings) == 2 and mappings.pinned_bytes == pinned  # the same files, still pinned
    cuda_still_works()


@pytest.mark.skipif(DEVICE != "cuda", reason="streams are CUDA's")
@pytest.mark.parametrize("mode", ["async", "overlapped"])
def test_the_snapshot_waits_for_work_queued_on_the_training_threads_own_stream(tmp_path, mode):
    """Training on a stream of its own: the snapshot (on another thread when overlapped, whose
    current stream is the default one) still copies what that stream's kernels wrote."""
    state = model_state(9)
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    training = torch.cuda.Stream()
    with AsyncCallsQueue(overlap_snapshot=mode == "overlapped") as queue:
        with torch.cuda.stream(training):
            torch.cuda._sleep(200_000_000)  # the stream is busy a while...
            state["model"]["layer0.attn.w"].fill_(3.0)  # ...before this write lands
            want = clone(state)  # queued after the write, on the same stream
            ta = BasicTensorAwareStateDict(state)
            queue.schedule_async_request(manager.save(ta, 9, is_async=True))
            queue.wait_for_snapshot()
        queue.maybe_finalize_async_calls(blocking=True)
    got = _load(tmp_path, 9)
    assert_same(got, want)
    assert bool((got["model"]["layer0.attn.w"] == 3.0).all())
    cuda_still_works()


@pytest.mark.parametrize("mode", ["async", "overlapped"])
def test_a_device_snapshot_frees_the_state_when_save_returns(tier_root, mode):
    """``device_snapshot``: the copy on the device is queued on the training stream behind the work
    before it (a busy stream here) and ahead of the changes after it, so changing the state right
    after ``save`` (before the snapshot to host memory even starts) loses nothing."""
    state = model_state(11)
    manager = LocalCheckpointManager(tier_root, session_id="job", device_snapshot=True)
    with AsyncCallsQueue(overlap_snapshot=mode == "overlapped") as queue:
        for it in (11, 12, 13):
            if DEVICE == "cuda":
                torch.cuda._sleep(100_000_000)  # queued kernels the copy must wait for
            state["model"]["layer0.attn.w"].fill_(float(it))
            want = clone(state)
            request = manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
            scribble(state)  # the optimizer step, right away
            queue.schedule_async_request(request)
            scribble(state)
            queue.maybe_finalize_async_calls(blocking=True)
            got = _load(tier_root, it)
            assert_same(got, want)
            assert bool((got["model"]["layer0.attn.w"] == float(it)).all())
    cuda_still_works()
