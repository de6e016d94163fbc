"""Files beside a step: names checked and the plan of which node fetches what (the fetch itself
runs on two ranks in tests/dcp/test_flashpoint_loader.py)."""

import pytest

from tierpoint.dcp.extra_objects import name_in, plan_extra_moves
from tierpoint.dist import NodeLayout
from tierpoint.errors import CheckpointingError


def test_names_are_taken_relative_to_the_step_and_never_outside_it() -> None:
    step = "/ckpt/node0/step-5_ckpt"
    assert name_in(step, f"{step}/context/model.yaml") == "context/model.yaml"
    assert name_in(step, "context/model.yaml") == "context/model.yaml"
    for outside in ("/etc/passwd", "../step-4_ckpt/.metadata", "context/../../x", f"{step}/"):
        with pytest.raises(CheckpointingError, match="is not inside"):
            name_in(step, outside)


def test_a_step_spelled_otherwise_than_the_hooks_paths_names_the_same_files() -> None:
    # The hooks build paths with pathlib ("./" and doubled slashes gone, file:// stripped): they
    # were refused as outside the step (every rank raised) or taken for names inside it.
    for step, path in (
        ("/ckpt//node0/step-5_ckpt", "/ckpt/node0/step-5_ckpt/context/model.yaml"),
        ("./ckpt/step-5_ckpt", "ckpt/step-5_ckpt/context/model.yaml"),
        ("file:///ckpt/step-5_ckpt/", "/ckpt/step-5_ckpt/context/model.yaml"),
        ("/ckpt/step-5_ckpt", "file:///ckpt/step-5_ckpt/context/model.yaml"),
    ):
        assert name_in(step, path) == "context/model.yaml", (step, path)
    with pytest.raises(CheckpointingError, match="is not inside"):
        name_in("./ckpt/step-5_ckpt", "/elsewhere/context/model.yaml")


def test_each_node_lacking_a_file_fetches_it_once_into_its_lowest_rank() -> None:
    layout = NodeLayout(("a", "a", "b", "b", "c", "c"), 0)
    held = [["ctx/m.yaml"], [], [], ["ctx/m.yaml"], [], []]
    plan = plan_extra_moves({"ctx/m.yaml", "ctx/gone.yaml"}, held, layout)
    assert plan == [[0, 4, "ctx/m.yaml"]]  # node b holds it already; nobody holds gone.yaml
