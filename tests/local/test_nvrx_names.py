"""The local manager used the way NVRx scripts use it: numpy iterations, the file-name helpers, and a
replication strategy of the user's own (NVRx's ``replicate``)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch.distributed as dist

from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CkptID,
    LocalCheckpointManager,
    ReplicationStrategy,
)
from tierpoint.testing import run_ranks

from .helpers import assert_bitwise_equal, make_state


def test_numpy_iterations_and_nvrx_file_name_helpers(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.save(BasicTensorAwareStateDict(make_state(0, 5)), np.int64(5))
    for bad in (np.float32(6.0), True, np.bool_(True), 7.0, -1):
        with pytest.raises(CheckpointingError, match="iteration must be a non-negative integer"):
            manager.save(BasicTensorAwareStateDict(make_state(0, 6)), bad)
    assert manager.find_latest() == 5 and manager.latest_iteration == 5
    assert manager._ckpt_id(np.int64(5)) == CkptID(5, 0, "job") == (5, 0, "job")
    name = manager._filename_from_template(5, 0)
    assert (manager.local_ckpt_dir / name).is_file()
    assert manager._local_ckpt_path_from_id(manager._ckpt_id(5)) == manager.local_ckpt_dir / name
    assert manager._filename_to_id(name) == (5, 0, "job")
    assert manager._my_ckpt_ids() == [(5, 0, "job")]
    # NVRx scripts build globs and regexes from the template.
    assert [
        p.name for p in manager.local_ckpt_dir.glob(manager._filename_from_template("*", "*", "*"))
    ] == [name]
    assert re.fullmatch(manager._filename_from_template("\\d+", "\\d+", "\\"), name)
    dirty = manager._local_ckpt_path_from_id((5, 0, "job"), is_dirty=True)
    assert dirty.name == name + ".dirty"
    with pytest.raises(CheckpointingError, match="session 'other'"):
        manager._local_ckpt_path_from_id((5, 0, "other"))


class AllGatherReplication(ReplicationStrategy):
    """A user's strategy written for NVRx: every rank keeps every other rank's checkpoint."""

    def replicate(self, local_ckpt, id_):
        world = dist.get_world_size()
        tensors = local_ckpt.pop_tensors()
        hollow, data, ids = [None] * world, [None] * world, [None] * world
        dist.all_gather_object(hollow, local_ckpt)
        dist.all_gather_object(data, tensors)
        dist.all_gather_object(ids, id_)
        for ckpt, ckpt_tensors in zip(hollow, data):
            ckpt.insert_tensors(ckpt_tensors)
        return hollow, ids

    def retrieve_plan(self, globally_available_ids, wanted):
        raise AssertionError("tierpoint plans retrieval itself")

    def retrieve_execute(self, *args, **kwargs):
        raise AssertionError("tierpoint retrieves parts itself")


def _save_with_user_strategy(rank: int, world: int, root: str) -> list[str]:
    manager = LocalCheckpointManager(root, session_id="job", repl_strategy=AllGatherReplication())
    manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1)
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2, is_async=True)
        )
        queue.maybe_finalize_async_calls(blocking=True)
    return sorted(p.name for p in manager.local_ckpt_dir.glob("iter_*"))


def _lose_rank1_part_and_load(rank: int, world: int, root: str) -> int:
    manager = LocalCheckpointManager(root, session_id="job", repl_strategy=AllGatherReplication())
    if rank == 1:
        manager._local_ckpt_path_from_id(manager._ckpt_id(2)).unlink()
    ta, ckpt_id = manager.load()
    assert ckpt_id == (2, rank, "job")
    assert_bitwise_equal(ta.state_dict, make_state(rank, 2))
    return manager.last_load.iteration if manager.last_load.from_peers else -1


def test_a_users_replication_strategy_saves_replicas_and_a_lost_part_comes_back(tmp_path):
    listings = run_ranks(_save_with_user_strategy, 2, str(tmp_path))
    assert (
        listings == [["iter_0000002_0_local.safetensors", "iter_0000002_1_local.safetensors"]] * 2
    )
    assert run_ranks(_lose_rank1_part_and_load, 2, str(tmp_path)) == [2, 2]
    with pytest.raises(
        CheckpointingError, match="repl_strategy must be a CliqueReplicationStrategy"
    ):
        LocalCheckpointManager(tmp_path, repl_strategy=object())
