"""get_latest_complete_checkpoint: newest committed step without unfinished markers, the same answer
on every rank; saves interrupted by SIGKILL are never returned."""

from __future__ import annotations

import logging
import os
import signal
import warnings

import pytest
import torch
import torch.distributed as dist

from tierpoint import storage
from tierpoint.dcp import get_latest_complete_checkpoint, save, step_path
from tierpoint.dcp.step_dirs import choose_latest, local_view, marker_name, step_of
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .file_names import untokened

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make(base, step: int, *names: str) -> None:
    d = step_path(base, step)
    os.makedirs(d, exist_ok=True)
    for n in names:
        open(os.path.join(d, n), "wb").close()


def test_names_and_markers():
    assert step_of("step-12") == 12 and step_of("step-abc") is None and step_of("step-1x") is None
    assert step_of("step-\u0661\u0662") is None  # other scripts' digits: int() would read 12
    assert step_path("s3://b/run", 3) == "s3://b/run/step-3"
    assert marker_name(4) == ".unfinished-4"


def test_newest_committed_unmarked_step_wins(tmp_path):
    make(tmp_path, 3, ".metadata", "__0_0.distcp")
    make(tmp_path, 5, ".metadata", ".unfinished-1")  # committed earlier, being re-saved
    make(tmp_path, 6, "__0_0.distcp")  # no .metadata: never committed
    make(tmp_path, 4, ".metadata")
    os.makedirs(tmp_path / "step-abc")
    open(tmp_path / "step-abc" / ".metadata", "wb").close()
    (tmp_path / "step-9").write_bytes(b"a file, not a checkpoint")
    (tmp_path / "notes.txt").write_bytes(b"")
    (tmp_path / "step-10").symlink_to(tmp_path / "nowhere")  # leads nowhere: no checkpoint
    (tmp_path / "step-11_ckpt").symlink_to(tmp_path / "step-11_ckpt")  # a link loop: neither
    assert get_latest_complete_checkpoint(tmp_path) == step_path(tmp_path, 4)
    assert [v[0] for v in local_view(tmp_path)] == [3, 4, 5, 6, 9, 10]  # tierpoint's names


def test_nothing_complete(tmp_path):
    assert get_latest_complete_checkpoint(tmp_path / "missing") is None
    make(tmp_path, 1, ".unfinished-0")
    assert get_latest_complete_checkpoint(tmp_path) is None


def test_choose_latest_combines_every_ranks_view():
    rank0 = [[1, True, []], [2, True, []], [3, True, []]]
    rank1 = [[1, False, []], [2, False, [1]], [3, False, []]]
    assert choose_latest([rank0, rank1]) == 3
    assert choose_latest([rank0, [[3, False, [1]]]]) == 2
    assert choose_latest([[], []]) is None


def _views_differ(rank: int, world: int, root: str) -> list:
    base = os.path.join(root, f"node{rank}")  # each rank sees its own "node-local" disk
    first = get_latest_complete_checkpoint(base)
    dist.barrier()
    if rank == 1:  # a step committed where only rank 1 can see the .metadata
        make(base, 5, ".metadata")
    dist.barrier()
    second = get_latest_complete_checkpoint(base)
    return [os.path.relpath(first, base), os.path.relpath(second, base)]


def _views_then_killed_mid_write(rank: int, world: int, root: str) -> list:
    """First: ranks with different views agree; then: rank 1 is killed while writing step 2."""
    views = _views_differ(rank, world, os.path.join(root, "views"))
    root = os.path.join(root, "killed")
    save({"a": torch.full((1 << 16,), float(rank)), "step": 1}, step_path(root, 1))
    if rank == 1:
        original = storage.local._write_local

        def die_halfway(path, views, fsync):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, bytes(memoryview(views[0]))[:100])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
            return original(path, views, fsync)  # never reached

        storage.local._write_local = die_halfway
    try:
        save({f"r{rank}": torch.full((1 << 16,), float(rank)), "step": 2}, step_path(root, 2))
    except CheckpointingError as e:
        return [views, f"raised: {e}"]
    return [views, "no error"]


def test_views_agree_and_a_rank_killed_mid_write_never_yields_a_checkpoint(tmp_path):
    views = tmp_path / "views"
    for step in (1, 2, 3, 4):
        make(views / "node0", step, ".metadata")
    make(views / "node1", 3, ".unfinished-1")  # rank 1 never finished step 3 ...
    make(views / "node1", 4, ".unfinished-1")  # ... nor step 4
    make(views / "node1", 5)
    results = run_ranks(
        _views_then_killed_mid_write,
        2,
        str(tmp_path),
        timeout=180,
        allow_crash={1},
        env={"TIERPOINT_TIMEOUT": "30"},
    )
    # Ranks that see different things still return the same step, decided from all views
    # (rank 1 is checked through rank 0's copy of the same broadcast decision).
    assert results[0][0] == ["step-2", "step-5"]
    # Rank 1 was SIGKILLed mid-write (no result); rank 0 learned it from the failed collective.
    assert results[1] is None
    assert results[0][1].startswith("raised") and "peer" in results[0][1], results
    killed = tmp_path / "killed"
    left = untokened(os.listdir(step_path(killed, 2)))
    assert ".metadata" not in left and ".unfinished-1" in left and "__1_0.distcp" in left
    assert get_latest_complete_checkpoint(killed) == step_path(killed, 1)


def test_a_crash_after_commit_before_unmarking_is_not_returned(tmp_path, monkeypatch, caplog):
    """Even a committed .metadata does not count while a marker says a rank may still write; a
    WARNING says why the older step is returned."""
    save({"a": torch.ones(8)}, step_path(tmp_path, 1))
    original = storage.remove_files

    def crash_on_markers(directory, names, **kw):
        if any(name.startswith(".unfinished") for name in names):
            raise OSError(5, "crashed here")
        return original(directory, names, **kw)

    monkeypatch.setattr(storage, "remove_files", crash_on_markers)
    with pytest.raises(CheckpointingError, match="unfinished markers"):
        save({"a": torch.ones(8) * 2}, step_path(tmp_path, 2))
    left = untokened(os.listdir(step_path(tmp_path, 2)))
    assert left == [".checksums-0.json", ".metadata", ".unfinished-0", "__0_0.distcp"]
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        assert get_latest_complete_checkpoint(tmp_path) == step_path(tmp_path, 1)
    assert f"{step_path(tmp_path, 2)} has a .metadata but unfinished markers of rank(s) 0" in (
        caplog.text
    )


def test_a_marker_in_a_flashpoint_named_step_is_not_called_ml_flashpoint_s(tmp_path, caplog):
    """tierpoint's own marker inside a ``step-N_ckpt`` directory (what dcp.save writes there) names
    a global rank; the WARNING called every marker of such a directory ML Flashpoint's, of ranks on
    that node."""
    save({"a": torch.ones(8)}, tmp_path / "step-1_ckpt")
    save({"a": torch.ones(8)}, tmp_path / "step-2_ckpt")
    (tmp_path / "step-2_ckpt" / ".unfinished-0").touch()  # killed after its commit
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        assert get_latest_complete_checkpoint(tmp_path) == str(tmp_path / "step-1_ckpt")
    text = caplog.text
    assert "unfinished markers of rank(s) 0" in text
    assert "(ML Flashpoint's markers: ranks on that node)" not in text
    assert "global ranks for tierpoint's markers inside the directory" in text
