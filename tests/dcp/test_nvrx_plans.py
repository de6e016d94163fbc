"""NVRx's cached planning across jobs: ``Metadata.all_local_plans`` read (allow-listed plan classes
only) and written, and a resumed job reusing the loaded plans from its first save."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tierpoint.dcp import (
    CorruptDCPError,
    Writer,
    get_metadata_caching_status,
    init_checkpoint_metadata_cache,
    load,
    read_metadata,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    step_path,
    verify_global_md_reuse,
)
from tierpoint.testing import run_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(rank: int, step: int) -> dict:
    return {"w": torch.arange(8.0) + step, f"own{rank}": torch.full((3,), float(rank)), "n": step}


def _nvrx_save(state: dict, path: str) -> tuple:
    """The seed-002 call sequence, with tierpoint's writer in place of FileSystemWriterAsync."""
    writer, metadata, wrapper = save_state_dict_async_plan(state, Writer(path), enable_cache=True)
    writer.write_now()
    save_state_dict_async_finalize(writer, metadata, wrapper)
    return writer, wrapper


def _first_job(rank: int, world: int, base: str) -> bool:
    _nvrx_save(_state(rank, 1), step_path(base, 1))
    return get_metadata_caching_status() == (False, False)


def _resumed_job(rank: int, world: int, base: str) -> list:
    loaded = read_metadata(step_path(base, 1))
    init_checkpoint_metadata_cache(loaded)
    writer, wrapper = _nvrx_save(_state(rank, 2), step_path(base, 2))
    reused = get_metadata_caching_status()
    local_plan = writer.metadata_cache.cached_local_plan
    verified = verify_global_md_reuse(loaded.all_local_plans, local_plan, rank, wrapper)
    out = {"w": torch.zeros(8), f"own{rank}": torch.zeros(3), "n": 0}
    load(out, step_path(base, 2))
    ok = torch.equal(out["w"], torch.arange(8.0) + 2) and out["n"] == 2
    return [list(reused), verified, ok, len(read_metadata(step_path(base, 2)).all_local_plans)]


def test_a_resumed_job_reuses_the_plans_stored_in_the_metadata(tmp_path):
    assert run_ranks(_first_job, 2, str(tmp_path)) == [True, True]
    # New processes: nothing cached but what the checkpoint's metadata carries.
    assert run_ranks(_resumed_job, 2, str(tmp_path)) == [[[False, True], True, True, 2]] * 2
    # torch's own reader still reads the metadata (all_local_plans is an ordinary attribute).
    out = {"w": torch.zeros(8), "own0": torch.zeros(3), "own1": torch.zeros(3), "n": 0}
    dcp.load(out, storage_reader=FileSystemReader(step_path(tmp_path, 2)), no_dist=True)
    assert torch.equal(out["own1"], torch.ones(3)) and out["n"] == 2


def _add_nvrx_plans(path: Path, state: dict, planner_data: object = None) -> None:
    """Rewrite a torch-written ``.metadata`` the way NVRx's cached planning writes it."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    writer = FileSystemWriter(str(path))
    writer.set_up_storage_writer(True)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    if planner_data is not None:
        local_plan = type(local_plan)(local_plan.items, planner_data=planner_data)
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file
    metadata.all_local_plans = [local_plan]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_checkpoints_nvrx_saved_with_cached_planning_load(tmp_path):
    state = {"w": torch.arange(6.0), "b": {"n": 3}}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ok")), no_dist=True)
    _add_nvrx_plans(tmp_path / "ok", state)
    metadata = read_metadata(tmp_path / "ok")
    assert metadata.all_local_plans[0].items[0].index.fqn == "w"
    out = {"w": torch.zeros(6), "b": {"n": 0}}
    load(out, tmp_path / "ok")
    assert torch.equal(out["w"], torch.arange(6.0)) and out["b"]["n"] == 3
    # A plan carrying anything but plain data is refused, naming the global; nothing runs.
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "bad")), no_dist=True)
    _add_nvrx_plans(tmp_path / "bad", state, planner_data={"w": print})
    with pytest.raises(CorruptDCPError, match="forbidden global builtins.print"):
        read_metadata(tmp_path / "bad")


def test_torchs_file_system_writer_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="needs a tierpoint.dcp.Writer.*FileSystemWriter"):
        save_state_dict_async_plan({"w": torch.ones(2)}, FileSystemWriter(str(tmp_path)))
    assert not any(tmp_path.iterdir())
