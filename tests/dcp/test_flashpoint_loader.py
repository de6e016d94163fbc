"""ML Flashpoint's loader names: a resume the way its users write it finds checkpoints in its
``step-N_ckpt`` layout (an unfinished marker skips the newest), reads the metadata as stored and
loads; tierpoint's own ``step-N`` layout is found beside it."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tierpoint.cli import main
from tierpoint.dcp import (
    CheckpointContainerId,
    CheckpointObjectId,
    DefaultMLFlashpointCheckpointLoader,
    MLFlashpointCheckpointLoader,
    async_save,
    get_latest_complete_checkpoint,
    load,
    save,
)
from tierpoint.dcp.flashpoint import default_metadata_object_name
from tierpoint.errors import UnsupportedStateError
from tierpoint.testing import run_ranks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(rank: int, step: int) -> dict:
    return {
        "model": {"w": torch.full((4, 8), float(step)), f"own{rank}": torch.arange(3) + 10 * step},
        "step": step,
    }


def _resume(rank: int, world: int, base: str) -> list:
    # Saved the ML Flashpoint way: one step-N_ckpt directory per checkpoint.
    for step in (1, 2, 3):
        path = os.path.join(base, f"step-{step}_ckpt")
        save(_state(rank, step), checkpoint_id=path, sync_files=False)
    if rank == 1:  # step 3's node crashed before its local rank 1 finished: its marker stays
        open(os.path.join(base, "step-3_ckpt__1__unfinished"), "wb").close()
    torch.distributed.barrier()

    loader = DefaultMLFlashpointCheckpointLoader()
    candidates = loader.get_candidate_checkpoints(CheckpointContainerId(base))
    latest = loader.get_latest_complete_checkpoint(CheckpointContainerId(base))
    metadata = loader.read_metadata(latest)
    again = loader.read_metadata(latest, object_name=default_metadata_object_name())
    objects = loader.get_checkpoint_objects_by_rank(latest)
    target = _state(rank, 0)
    load(target, checkpoint_id=latest.data)
    return [
        [os.path.basename(c.data) for c in candidates],
        os.path.basename(latest.data),
        metadata == again,
        sorted(metadata.state_dict_metadata),
        {
            r: default_metadata_object_name() in [os.path.basename(o.data) for o in objs]
            for r, objs in objects.items()
        },
        target["step"],
        target["model"]["w"][0, 0].item(),
        target["model"][f"own{rank}"].tolist(),
    ]


def test_a_flashpoint_style_resume_on_two_ranks_skips_the_unfinished_newest(tmp_path):
    results = run_ranks(_resume, 2, str(tmp_path), timeout=120)
    for got in results:
        candidates, latest, equal, keys, first_object, step, w, own = got
        assert candidates == ["step-2_ckpt", "step-1_ckpt"]
        assert latest == "step-2_ckpt"
        assert equal  # no random load_id added: two reads of one file compare equal
        assert keys == ["model.own0", "model.own1", "model.w", "step"]
        assert first_object == {0: True, 1: True}  # every rank sees the metadata object
        assert (step, w, own) == (2, 2.0, [20, 21, 22])
    # The marker is ML Flashpoint's sibling file; tierpoint's own discovery skips it the same way.
    assert get_latest_complete_checkpoint(tmp_path).endswith("step-2_ckpt")


def test_both_layouts_are_found_and_tierpoints_wins_a_tie(tmp_path, caplog, capsys):
    save(_state(0, 4), checkpoint_id=tmp_path / "step-4_ckpt")
    save(_state(0, 4), checkpoint_id=tmp_path / "step-4")
    save(_state(0, 5), checkpoint_id=tmp_path / "step-5_ckpt")
    (tmp_path / "step-5_ckpt__0__unfinished").touch()
    save(_state(0, 3), checkpoint_id=tmp_path / "step-3")
    latest = DefaultMLFlashpointCheckpointLoader().get_latest_complete_checkpoint(str(tmp_path))
    assert latest == CheckpointContainerId(str(tmp_path / "step-4"))
    marked = "step-5_ckpt has a .metadata but unfinished markers of rank(s) 0 (global ranks"
    assert marked in caplog.text  # its sibling markers name a rank on the node, not a global one
    assert "ranks on that node for ML Flashpoint's beside it" in caplog.text
    # The command line lists both layouts, names the marker and agrees on the newest.
    assert main(["ls", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {os.path.basename(r["path"]): r for r in doc["checkpoints"]}
    assert rows["step-5_ckpt"]["status"] == "incomplete"
    assert "unfinished on ranks [0]" in rows["step-5_ckpt"]["detail"]
    assert rows["step-4_ckpt"]["step"] == 4 and rows["step-4_ckpt"]["status"] == "complete"
    assert doc["newest_restorable"] == {str(tmp_path): str(tmp_path / "step-4")}


def test_read_data_per_object_and_refusals(tmp_path):
    path = tmp_path / "step-7_ckpt"
    state = _state(0, 7)
    save(state, checkpoint_id=path)
    loader = DefaultMLFlashpointCheckpointLoader()
    assert isinstance(loader, MLFlashpointCheckpointLoader)
    container = CheckpointContainerId(str(path))
    assert CheckpointContainerId.parse_version_container_step("step-7_ckpt") == 7
    assert container.get_parent() == CheckpointContainerId(str(tmp_path))
    metadata = loader.read_metadata(container)

    # What ML Flashpoint's storage reader does: plan, then read_data once per object.
    target = _state(0, 0)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, True)
    plan = planner.create_local_plan()
    by_object: dict[str, list] = {}
    for item in plan.items:
        by_object.setdefault(metadata.storage_data[item.storage_index].relative_path, []).append(
            item
        )
    for name, items in by_object.items():
        obj = CheckpointObjectId.from_container(container, name)
        assert obj.get_parent() == container
        loader.read_data(obj, items, planner, metadata.storage_data)
    assert target["step"] == 7 and torch.equal(target["model"]["w"], state["model"]["w"])

    with pytest.raises(FileNotFoundError, match="does not exist here"):
        loader.read_data(
            CheckpointObjectId.from_container(container, "__9_0.distcp"), [], planner, {}
        )
    with pytest.raises(UnsupportedStateError, match="pickled header"):
        loader.read_tensor(open(os.devnull, "rb"), plan.items[0], use_optimized_loader=True)


def _save_again_over_a_flashpoint_marker(rank: int, world: int, root: str, use_async: bool) -> list:
    # Each rank its own node's disk; ML Flashpoint's save of step 2 was killed on node 1: its
    # directory has no .metadata and its sibling marker stays.
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"
    base = os.path.join(root, f"node{rank}")
    save(_state(rank, 1), checkpoint_id=os.path.join(base, "step-1_ckpt"), sync_files=False)
    os.makedirs(os.path.join(base, "step-2_ckpt"))
    if rank == 1:
        open(os.path.join(base, "step-2_ckpt__1__unfinished"), "wb").close()
    open(os.path.join(base, "step-20_ckpt__0__unfinished"), "wb").close()  # another step's
    torch.distributed.barrier()
    loader = DefaultMLFlashpointCheckpointLoader()
    before = loader.get_latest_complete_checkpoint(CheckpointContainerId(base))
    path = os.path.join(base, "step-2_ckpt")
    if use_async:
        async_save(_state(rank, 2), checkpoint_id=path).result()
    else:
        save(_state(rank, 2), checkpoint_id=path, sync_files=False)
    after = loader.get_latest_complete_checkpoint(CheckpointContainerId(base))
    target = _state(rank, 0)
    load(target, checkpoint_id=after.data)
    return [os.path.basename(before.data), os.path.basename(after.data), target["step"]] + [
        sorted(n for n in os.listdir(base) if n.endswith("unfinished"))
    ]


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_a_new_save_into_a_flashpoint_directory_removes_its_stale_markers(tmp_path, use_async):
    results = run_ranks(
        _save_again_over_a_flashpoint_marker, 2, str(tmp_path), use_async, timeout=180
    )
    for got in results:
        # Before the fix the marker stayed: the new save was committed but never counted.
        assert got == ["step-1_ckpt", "step-2_ckpt", 2, ["step-20_ckpt__0__unfinished"]]


def test_get_parent_of_names_at_the_root_and_bare_names() -> None:
    assert CheckpointContainerId("/step-1_ckpt").get_parent() == CheckpointContainerId("/")
    assert CheckpointObjectId("/a/step-1_ckpt/.metadata").get_parent().data == "/a/step-1_ckpt"
    assert CheckpointContainerId("step-1_ckpt").get_parent() == CheckpointContainerId(".")
    assert CheckpointContainerId("s3://bucket/run/step-1_ckpt/").get_parent().data == (
        "s3://bucket/run"
    )


class ContextLoader(DefaultMLFlashpointCheckpointLoader):
    """A subclass as ML Flashpoint's NeMo adapter writes one: every node needs ``context/``."""

    def _get_extra_local_objects(self, container_path):
        context = container_path / "context"
        return [os.path.join("context", n) for n in os.listdir(context)] if context.is_dir() else []

    def _get_extra_needed_objects(self, checkpoint, available_objects_by_rank):
        prefix = os.path.join(checkpoint.data, "context") + os.sep
        return {
            o.data
            for objects in available_objects_by_rank.values()
            for o in objects
            if o.data.startswith(prefix)
        }


def _resume_with_context(rank: int, world: int, base: str) -> list:
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank}"  # two nodes, each with its own disk
    node_base = os.path.join(base, f"node{rank}")
    step = os.path.join(node_base, "step-5_ckpt")
    save(_state(rank, 5), checkpoint_id=step)
    if rank == 0:  # written by one node only, as NeMo writes its context
        os.makedirs(os.path.join(step, "context"))
        with open(os.path.join(step, "context", "model.yaml"), "w") as f:
            f.write("layers: 2\n")
    torch.distributed.barrier()
    latest = ContextLoader().get_latest_complete_checkpoint(CheckpointContainerId(node_base))
    with open(os.path.join(latest.data, "context", "model.yaml")) as f:
        return [os.path.basename(latest.data), f.read()]


def test_a_subclass_hooks_bring_extra_objects_to_every_node(tmp_path):
    # ML Flashpoint's subclass hooks (_get_extra_local_objects, _get_extra_needed_objects) were
    # never called: node 1 resumed without the context/ files only node 0 held.
    results = run_ranks(_resume_with_context, 2, str(tmp_path), timeout=120)
    assert results == [["step-5_ckpt", "layers: 2\n"]] * 2
