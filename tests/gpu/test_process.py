"""A process stays healthy with CUDA across many checkpointing objects: several local managers and
queues used one after another, on disk and RAM tiers (closed, dropped, collected; some warmed up,
pinning on a background thread), DCP async saves in between (some pools warmed up), then CUDA
still works; a registration CUDA refuses leaves no error pending."""

from __future__ import annotations

import gc
import logging

from tierpoint import pinning
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import StagingPool, async_save, step_path, warm_up
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.staging import StagingBuffer

from .helpers import DEVICE, assert_same, clone, cuda_still_works, model_state, needs_gpu

pytestmark = needs_gpu


def test_many_managers_and_persistent_saves_in_one_process(tmp_path, shm_dir):
    for k in range(4):
        # disk tiers stage in a pinned buffer; RAM tiers pin their part files
        root = (tmp_path if k % 2 == 0 else shm_dir) / f"local{k}"
        manager = LocalCheckpointManager(root, session_id="job")
        queue = AsyncCallsQueue(overlap_snapshot=k % 2 == 1)
        if k >= 2:  # pinned ahead, on a background thread
            manager.warm_up(BasicTensorAwareStateDict(model_state(0, width=128 + 64 * k)))
        for it in (1, 2):
            state = model_state(10 * k + it, width=128 + 64 * k)  # each manager its own layout
            want = clone(state)
            queue.schedule_async_request(
                manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
            )
            queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        ta, _ = LocalCheckpointManager(root, session_id="job").load()
        assert_same(ta.state_dict, want)
        del manager, queue, ta
        gc.collect()
        cuda_still_works()
        pool = StagingPool()
        if k % 2:
            warm_up(model_state(0), step_path(tmp_path / "dcp", 0), staging_pool=pool)
        with AsyncCallsQueue() as dcp_queue:
            for base in (tmp_path / "dcp", shm_dir):  # memfd staging, and in place on /dev/shm
                for step in (2 * k + 1, 2 * k + 2):
                    state = model_state(step, width=128 + 64 * (step % 3))
                    async_save(state, step_path(base, step), queue=dcp_queue, staging_pool=pool)
                    dcp_queue.maybe_finalize_async_calls(blocking=True)
        pool.close()
        del pool
        gc.collect()
        cuda_still_works()


def test_a_refused_registration_leaves_no_cuda_error_pending(caplog):
    caplog.set_level(logging.WARNING, logger="tierpoint")
    buf = StagingBuffer(64 << 20)
    device = pinning.copy_device(model_state(0)["model"].values())
    assert buf.pin(device) == (DEVICE == "cuda")
    second = pinning.PinnedRange()  # the same memory again: CUDA refuses (already registered)
    assert not second.register(buf.tensor.data_ptr(), buf.nbytes, device or 0)
    if DEVICE == "cuda":
        assert [r for r in caplog.records if "page-lock" in r.getMessage()]
    cuda_still_works()
    second.release()  # never pinned: nothing to undo
    buf.close()
    cuda_still_works()
