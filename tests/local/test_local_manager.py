"""LocalCheckpointManager on 4 real gloo ranks: round trips, crashes, failures, corruption, retention."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tierpoint import fileformat
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.errors import CheckpointingError
from tierpoint.fileformat import writing
from tierpoint.local import (
    BasicTensorAwareStateDict,
    CheckpointingException,
    CkptID,
    LocalCheckpointManager,
)
from tierpoint.local.naming import part_name
from tierpoint.testing import run_ranks

from ..mounts import small_tmpfs
from .helpers import WarningRecords, assert_bitwise_equal, flip_tensor_byte, make_state

WORLD = 4


def save_iterations(
    root: str, rank: int, iterations: list[int], **kwargs
) -> LocalCheckpointManager:
    manager = LocalCheckpointManager(root, session_id="job", **kwargs)
    for it in iterations:
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    return manager


def load_latest(root: str, rank: int) -> int:
    manager = LocalCheckpointManager(root, session_id="job")
    iteration = manager.find_latest()
    if iteration != -1:
        ta, ckpt_id = manager.load()
        assert ckpt_id == CkptID(iteration, rank, "job")
        assert_bitwise_equal(ta.state_dict, make_state(rank, iteration))
    return iteration


def load_error(root: str) -> str:
    """``"<error class>: <message>"`` of a fresh manager's ``load()``, or ``"loaded"``."""
    try:
        LocalCheckpointManager(root, session_id="job").load()
    except CheckpointingError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _load_latest(rank: int, world: int, root: str) -> int:
    return load_latest(root, rank)


# ------------------------------------------------------------------------------------ round trip


def _save_then_load(rank: int, world: int, root: str) -> int:
    manager = save_iterations(root, rank, [5, 10])
    assert manager.find_latest() == 10
    ta, _ = manager.load()
    assert_bitwise_equal(ta.state_dict, make_state(rank, 10))
    latest = load_latest(root, rank)
    # Loaded tensors map their file: later saves (which recycle expired files) must not change them.
    for it in (11, 12, 13):
        manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
    assert_bitwise_equal(ta.state_dict, make_state(rank, 10))
    return latest


def _nvrx_usage_pattern(rank: int, world: int, root: str) -> int:
    # The seed-004 integration example, with only the import changed.
    ckpt_manager = LocalCheckpointManager(root, session_id="job")
    model = torch.nn.Linear(8, 4)
    iteration = ckpt_manager.find_latest()
    if iteration != -1:
        ta_state_dict, ckpt_part_id = ckpt_manager.load()
        model.load_state_dict(ta_state_dict.state_dict)
    else:
        iteration = 0
    first = iteration + 1
    for iteration in range(first, first + 3):  # noqa: B007 - the loop is the training loop
        with torch.no_grad():
            model.weight.add_(1.0)
        state_dict = model.state_dict()
        ta_state_dict = BasicTensorAwareStateDict(state_dict)
        ckpt_manager.save(ta_state_dict, iteration, is_async=False)
    return int(model.weight.sum().item() * 1000)


def test_round_trip_and_fresh_process_group(tmp_path):
    root = str(tmp_path)
    assert run_ranks(_save_then_load, WORLD, root) == [10] * WORLD
    # A fresh process group (new processes) finds and loads the same checkpoint.
    assert run_ranks(_load_latest, WORLD, root) == [13] * WORLD
    for rank in range(WORLD):
        rank_dir = tmp_path / "job" / str(rank)
        assert oct(rank_dir.stat().st_mode & 0o777) == "0o700"
        part = rank_dir / f"iter_0000013_{rank}_local.safetensors"
        assert oct(part.stat().st_mode & 0o777) == "0o600"
        assert sorted(p.name for p in rank_dir.iterdir()) == [part.name, "spare_0.free"]


def test_nvrx_usage_pattern_runs_and_resumes(tmp_path):
    first = run_ranks(_nvrx_usage_pattern, WORLD, str(tmp_path))
    second = run_ranks(_nvrx_usage_pattern, WORLD, str(tmp_path))  # resumes from iteration 3
    # From the weights of iteration 3, each of the 32 raised by 1.0 three more times (any other
    # start differed from the first run's end too: "s != f" held with wrong weights loaded).
    assert all(abs(s - f - 3 * 32 * 1000) <= 2 for s, f in zip(second, first)), (first, second)
    found = run_ranks(_find_latest_only, WORLD, str(tmp_path))
    assert found == [6] * WORLD


def _find_latest_only(rank: int, world: int, root: str) -> int:
    return LocalCheckpointManager(root, session_id="job").find_latest()


def test_single_process_without_distributed(tmp_path):
    manager = save_iterations(str(tmp_path), 0, [1, 2])
    assert manager.find_latest() == 2
    ta, ckpt_id = manager.load()
    assert ckpt_id == (2, 0, "job")
    assert_bitwise_equal(ta.state_dict, make_state(0, 2))
    assert CheckpointingException is CheckpointingError


_RNG_SCRIPT = """
import sys, torch
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
manager = LocalCheckpointManager(sys.argv[1], session_id="job")
torch.manual_seed(7)
state = {"w": torch.randn(1 << 20), "rng": torch.get_rng_state(), "step": torch.tensor(5)}
expected = torch.rand(4)
manager.save(BasicTensorAwareStateDict(state), 1)
ta, _ = LocalCheckpointManager(sys.argv[1], session_id="job").load()  # mmap_load=True
torch.set_rng_state(ta.state_dict["rng"])
assert torch.equal(torch.rand(4), expected)
torch.save(ta.state_dict["step"], sys.argv[1] + "/step.pt")
print("ok")
"""


def test_a_mapped_load_restores_the_rng_state_and_saves_tensors_alone(tmp_path):
    """Loaded tensors are not views into one storage of the whole file: torch.set_rng_state
    (which ignores storage offsets) would crash on them, and torch.save would write the file."""
    done = subprocess.run(
        [sys.executable, "-c", _RNG_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert (tmp_path / "step.pt").stat().st_size < 4096  # not the 4 MiB part file


def _iterations_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (root / "job" / "0").glob("iter_*"))


def test_async_saves_keep_last_counts_the_save_committed_meanwhile(tmp_path):
    """The README's loop: each request is made while the previous save is still in flight."""
    manager = LocalCheckpointManager(tmp_path, session_id="job", keep_last=2)
    with AsyncCallsQueue() as queue:
        for it in (5, 10, 20, 30):
            queue.maybe_finalize_async_calls(blocking=False)
            request = manager.save(BasicTensorAwareStateDict(make_state(0, it)), it, is_async=True)
            queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    assert _iterations_on_disk(tmp_path) == [20, 30]


def test_a_stale_async_request_never_retires_a_newer_checkpoint(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    stale = manager.save(BasicTensorAwareStateDict(make_state(0, 10)), 10, is_async=True)
    manager.save(BasicTensorAwareStateDict(make_state(0, 20)), 20)  # before 10 was scheduled
    with AsyncCallsQueue() as queue:
        with pytest.raises(CheckpointingError, match="scheduled after iteration 20 was saved"):
            queue.schedule_async_request(stale)
            queue.maybe_finalize_async_calls(blocking=True)
    assert _iterations_on_disk(tmp_path) == [20]
    ta, ckpt_id = LocalCheckpointManager(tmp_path, session_id="job").load()
    assert ckpt_id.iteration == 20
    assert_bitwise_equal(ta.state_dict, make_state(0, 20))


# ------------------------------------------------------------------------------------ crashes


def _crash_during_save(rank: int, world: int, root: str, crash_point: dict) -> int:
    manager = save_iterations(root, rank, [1, 2])
    point = crash_point.get(str(rank))
    real_replace, real_write_data = os.replace, writing._write_data

    def killing_replace(src, dst):
        if point == "before_rename" and str(dst).endswith("_local.safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)
        if point == "after_rename" and str(dst).endswith("_local.safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)

    def killing_write_data(fd, views):
        if point == "mid_write":
            os.write(fd, bytes(views[0][: len(views[0]) // 2]))
            os.kill(os.getpid(), signal.SIGKILL)
        real_write_data(fd, views)

    os.replace = killing_replace
    writing._write_data = killing_write_data
    try:
        manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 3)
    except CheckpointingError:
        return -2  # a survivor: the crash of a peer surfaced as an agreed error
    finally:
        os.replace, writing._write_data = real_replace, real_write_data
    return 3


CRASHES = {
    "all_mid_write": {str(r): "mid_write" for r in range(WORLD)},
    "all_before_rename": {str(r): "before_rename" for r in range(WORLD)},
    "some_after_rename_others_before": {
        "0": "after_rename",
        "1": "after_rename",
        "2": "before_rename",
        "3": "mid_write",
    },
    "one_rank_dies_others_survive": {"3": "mid_write"},
}


@pytest.mark.parametrize("scenario", list(CRASHES))
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, scenario):
    root = str(tmp_path)
    crash = CRASHES[scenario]
    killed = {int(r) for r in crash}
    results = run_ranks(
        _crash_during_save,
        WORLD,
        root,
        crash,
        allow_crash=killed,
        env={"TIERPOINT_TIMEOUT": "20"},
        timeout=120,
    )
    for rank in range(WORLD):
        assert results[rank] == (None if rank in killed else -2)
    # After a restart every rank agrees on iteration 2 and loads it bitwise equal.
    assert run_ranks(_load_latest, WORLD, root) == [2] * WORLD
    # The next save of iteration 3 succeeds and leaves only iteration 3 plus at most one spare.
    run_ranks(_save_three, WORLD, root)
    for rank in range(WORLD):
        names = sorted(p.name for p in (tmp_path / "job" / str(rank)).iterdir())
        assert names[0] == f"iter_0000003_{rank}_local.safetensors"
        assert all(n.startswith("spare_") for n in names[1:]) and len(names) <= 2, names


def _save_three(rank: int, world: int, root: str) -> None:
    manager = LocalCheckpointManager(root, session_id="job")
    assert manager.find_latest() == 2
    manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 3)
    assert load_latest(root, rank) == 3


# ------------------------------------------------------------------------------------ failures


def _write_fails_on_rank_two(rank: int, world: int, root: str, blocker: str) -> str:
    manager = save_iterations(root, rank, [1])
    if rank == 2:
        # The dirty file's name is taken by a directory: opening it for writing fails for real.
        os.makedirs(manager.local_ckpt_dir / blocker)
    try:
        manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2)
    except CheckpointingError as e:
        assert not (manager.local_ckpt_dir / f"iter_0000002_{rank}_local.safetensors").exists()
        if rank == 2:
            os.rmdir(manager.local_ckpt_dir / blocker)
        return str(e)
    return "no error"


def test_one_rank_write_fails_all_raise_and_previous_stays(tmp_path):
    root = str(tmp_path)
    results = run_ranks(
        _write_fails_on_rank_two, WORLD, root, "iter_0000002_2_local.safetensors.dirty", timeout=120
    )
    assert len(set(results)) == 1, results
    assert "rank 2" in results[0] and "iteration 2" in results[0]
    assert run_ranks(_load_latest, WORLD, root) == [1] * WORLD


def _full_disk(rank: int, world: int, root: str) -> str:
    manager = LocalCheckpointManager(root, session_id="job")
    small = {"x": torch.ones(10)}
    manager.save(BasicTensorAwareStateDict(small), 1)
    big = {"x": torch.ones(10)} if rank != 1 else {"x": torch.ones(2**20)}  # 4 MiB > the 1 MiB disk
    try:
        manager.save(BasicTensorAwareStateDict(big), 2)
    except CheckpointingError as e:
        return str(e)
    return "no error"


def test_full_disk_on_one_rank(tmp_path):
    with small_tmpfs(tmp_path / "job" / "1") as mount_point:
        results = run_ranks(_full_disk, WORLD, str(tmp_path))
        assert (
            len(set(results)) == 1 and "rank 1" in results[0] and "No space left" in results[0]
        ), results
        assert sorted(p.name for p in mount_point.iterdir()) == ["iter_0000001_1_local.safetensors"]


def _flip_and_load(rank: int, world: int, root: str) -> str:
    manager = save_iterations(root, rank, [4])
    if rank == 1:
        flip_tensor_byte(manager.local_ckpt_dir / "iter_0000004_1_local.safetensors")
    return load_error(root)


def test_flipped_byte_raises_corrupt_error_naming_rank_and_file(tmp_path):
    results = run_ranks(_flip_and_load, WORLD, str(tmp_path))
    assert len(set(results)) == 1
    assert results[0].startswith("CorruptCheckpointError: ")
    assert "rank 1" in results[0] and "iter_0000004_1_local.safetensors" in results[0]
    assert "checksum mismatch" in results[0]


def _keep_three(rank: int, world: int, root: str) -> list[str]:
    manager = save_iterations(root, rank, [1, 2, 3, 4, 5, 6], keep_last=3)
    return sorted(p.name for p in manager.local_ckpt_dir.iterdir() if p.name.startswith("iter_"))


def test_keep_last_three(tmp_path):
    results = run_ranks(_keep_three, WORLD, str(tmp_path))
    for rank, names in enumerate(results):
        assert names == [f"iter_000000{i}_{rank}_local.safetensors" for i in (4, 5, 6)]


def _bad_iterations(rank: int, world: int, root: str) -> list[str]:
    manager = save_iterations(root, rank, [7])
    errors = []
    for it in (7, 3, 8 + rank):  # same, older, and disagreeing across ranks
        try:
            manager.save(BasicTensorAwareStateDict(make_state(rank, it)), it)
            errors.append("saved")
        except CheckpointingError as e:
            errors.append(str(e))
    return errors


def test_same_older_or_disagreeing_iteration_is_a_clear_error_everywhere(tmp_path):
    results = run_ranks(_bad_iterations, WORLD, str(tmp_path))
    same, older, disagree = zip(*results)
    assert len(set(same)) == 1 and "iteration 7 is already saved" in same[0]
    assert len(set(older)) == 1 and "cannot save iteration 3" in older[0]
    assert len(set(disagree)) == 1 and "disagree" in disagree[0]


def _two_jobs_in_one_session(rank: int, world: int, root: str) -> str:
    """Two jobs on one node, both with the default session: job B's steps are job A's too."""
    job_a = LocalCheckpointManager(root, keep_last=2)
    job_a.save(BasicTensorAwareStateDict(make_state(rank, 100)), 100)
    job_b = LocalCheckpointManager(root, keep_last=2)
    job_b.save(BasicTensorAwareStateDict(make_state(rank, 200)), 200)
    with pytest.raises(CheckpointingError) as refused:
        job_a.save(BasicTensorAwareStateDict(make_state(rank, 101)), 101)
    return str(refused.value)


def test_a_save_refused_because_another_job_shares_the_session_says_so(tmp_path):
    """Job A's iterations did increase (100, 101): "iterations must increase" alone sent its user
    looking for a bug of theirs; the error names the likely cause, a shared session_id."""
    messages = run_ranks(_two_jobs_in_one_session, 2, str(tmp_path))
    assert len(set(messages)) == 1 and "iteration 200 is already saved" in messages[0]
    assert "another job" in messages[0] and "session_id" in messages[0], messages[0]


def _arguments_refused_on_one_rank(rank: int, world: int, root: str) -> list[tuple[str, float]]:
    """Rank 1 alone passes a bad iteration, then a plain dict; every rank catches the error and
    goes on, as a training loop would, and then saves iteration 1."""
    manager = LocalCheckpointManager(root, session_id="job")
    state = make_state(rank, 1)
    errors = []
    for bad in ({"iteration": -1}, {"state": state}):
        arguments = {"state": BasicTensorAwareStateDict(state), "iteration": 1}
        if rank == 1:
            arguments.update(bad)
        start = time.perf_counter()
        with pytest.raises(CheckpointingError) as caught:
            manager.save(arguments["state"], arguments["iteration"])
        errors.append((str(caught.value), time.perf_counter() - start))
    manager.save(BasicTensorAwareStateDict(state), 1)
    assert manager.find_latest() == 1
    return errors


def test_an_argument_refused_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path):
    """Refused before the save's first collective, on rank 1 alone: the other ranks waited in
    it until the timeout. The refusal travels in the iteration's agreement now."""
    env = {"TIERPOINT_TIMEOUT": "30"}
    results = run_ranks(_arguments_refused_on_one_rank, WORLD, str(tmp_path), env=env)
    iteration, state = zip(*results)
    for errors, text in ((iteration, "got -1"), (state, "expects a TensorAwareStateDict")):
        assert len({message for message, _ in errors}) == 1  # the same error on every rank
        assert "failed on rank 1" in errors[0][0] and text in errors[0][0]
        assert all(seconds < 10 for _, seconds in errors), errors  # well before the timeout


def _save_world(rank: int, world: int, root: str) -> None:
    save_iterations(root, rank, [9])


def _load_other_world(rank: int, world: int, root: str) -> str:
    return load_error(root)


def test_world_size_mismatch_is_named(tmp_path):
    run_ranks(_save_world, WORLD, str(tmp_path))
    results = run_ranks(_load_other_world, 2, str(tmp_path))
    assert "world size 4" in results[0] and "world size 2" in results[0]


def test_bad_arguments(tmp_path):
    with pytest.raises(CheckpointingError, match="session_id"):
        LocalCheckpointManager(tmp_path, session_id="../escape")
    with pytest.raises(CheckpointingError, match="keep_last"):
        LocalCheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(CheckpointingError, match="keep_last"):
        LocalCheckpointManager(tmp_path, keep_last=True)
    with pytest.raises(CheckpointingError, match="verify must be True or False, got None"):
        LocalCheckpointManager(tmp_path, verify=None)
    with pytest.raises(CheckpointingError, match="recycle must be True or False"):
        LocalCheckpointManager(tmp_path, recycle="no")
    with pytest.raises(CheckpointingError, match="root_local_ckpt_dir must be a path"):
        LocalCheckpointManager(123)  # type: ignore[arg-type]
    manager = LocalCheckpointManager(tmp_path)
    with pytest.raises(CheckpointingError, match="TensorAwareStateDict"):
        manager.save({"x": torch.ones(1)}, 1)  # type: ignore[arg-type]
    with pytest.raises(CheckpointingError, match="non-negative"):
        manager.save(BasicTensorAwareStateDict({}), -3)
    with pytest.raises(CheckpointingError, match="no complete local checkpoint"):
        manager.load()
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        manager.wait_for_restore("60")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite number of seconds > 0, got -1"):
        manager.wait_for_restore(-1)


def test_stale_dirty_file_never_blocks_a_save(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.local_ckpt_dir.mkdir(parents=True)
    stale = manager.local_ckpt_dir / "iter_0000001_0_local.safetensors.dirty"
    stale.write_bytes(b"half a file from a crashed run")
    manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1)
    assert not stale.exists()
    assert load_latest(str(tmp_path), 0) == 1
    assert Path(manager.local_ckpt_dir / "iter_0000001_0_local.safetensors").exists()


# ------------------------------------------------------------------------------------ misuse


def _save_after_destroying_the_group(rank: int, world: int, root: str) -> str:
    manager = save_iterations(root, rank, [1])
    dist.destroy_process_group()  # e.g. a final save in a shutdown hook after teardown
    os.environ.pop("WORLD_SIZE")  # not launched by torchrun: only the manager can tell
    try:
        manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2)
    except CheckpointingError as e:
        return str(e)
    return "saved"


def test_a_save_after_the_process_group_is_gone_refuses_and_keeps_the_checkpoint(tmp_path):
    results = run_ranks(_save_after_destroying_the_group, 2, str(tmp_path))
    assert all("world size 2" in r and "now has world size 1" in r for r in results), results
    assert run_ranks(_load_latest, 2, str(tmp_path)) == [1, 1]


def test_several_launched_processes_without_a_process_group_refuse(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    with pytest.raises(CheckpointingError, match="WORLD_SIZE=2 is set but torch.distributed"):
        manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1)
    assert not any(tmp_path.rglob("*.safetensors*"))


def _async_twice(rank: int, world: int, root: str) -> str:
    manager = LocalCheckpointManager(root, session_id="job")
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(
            manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2, is_async=True)
        )
        try:
            manager.save(BasicTensorAwareStateDict(make_state(rank, 3)), 2, is_async=True)
            outcome = "accepted"
        except CheckpointingError as e:
            outcome = str(e)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    return outcome


def test_an_async_save_of_an_iteration_in_flight_is_refused(tmp_path):
    results = run_ranks(_async_twice, 2, str(tmp_path))
    assert len(set(results)) == 1 and "async save of iteration 2 was requested" in results[0]
    assert run_ranks(_load_latest, 2, str(tmp_path)) == [2, 2]  # the first one, intact


def _root_is_a_file_on_rank_one(rank: int, world: int, root: str) -> str:
    mine = Path(root) / str(rank)
    if rank == 1:
        mine.write_text("not a directory")
    else:
        mine.mkdir()
    try:
        save_iterations(str(mine), rank, [1])
    except CheckpointingError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_a_rank_that_cannot_create_its_directory_fails_every_rank_at_once(tmp_path):
    results = run_ranks(_root_is_a_file_on_rank_one, 2, str(tmp_path))
    assert len(set(results)) == 1, results  # the same error, not a timeout on rank 0
    assert results[0].startswith("CheckpointingError: save: agreeing on the iteration failed")
    assert "rank 1:" in results[0] and "not a directory" in results[0].lower()


def _directory_gone_before_the_commit(rank: int, world: int, root: str) -> list[str]:
    manager = LocalCheckpointManager(root, session_id="job")
    errors = []
    with AsyncCallsQueue() as queue:
        for it in (1, 2, 3):
            state = BasicTensorAwareStateDict(make_state(rank, it))
            queue.schedule_async_request(manager.save(state, it, is_async=True))
            if rank == 1 and it == 2:  # the part is written; its directory vanishes before commit
                deadline = time.monotonic() + 60
                while not queue._calls.ready_count() and time.monotonic() < deadline:
                    queue._pump(0.05)
                shutil.rmtree(manager.local_ckpt_dir)
            try:
                queue.maybe_finalize_async_calls(blocking=True)
            except CheckpointingError as e:
                errors.append(str(e))
    return errors


def test_a_directory_gone_before_the_commit_fails_no_rank_alone(tmp_path):
    # The commit's retirement of older files raised FileNotFoundError on rank 1 alone, after every
    # rank had agreed on the commit: rank 0 went on and waited for rank 1 until the timeout.
    results = run_ranks(
        _directory_gone_before_the_commit,
        2,
        str(tmp_path),
        env={"TIERPOINT_TIMEOUT": "20"},
        timeout=90,
    )
    assert results == [[], []]
    assert run_ranks(_load_latest, 2, str(tmp_path)) == [3, 3]


def _mixed_calls(rank: int, world: int, root: str) -> str:
    manager = save_iterations(root, rank, [1])
    try:
        if rank == 0:
            manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2)
        else:
            LocalCheckpointManager(root, session_id="job").find_latest()
    except CheckpointingError as e:
        return str(e)
    return "ok"


def test_ranks_in_different_calls_get_one_clear_error(tmp_path):
    results = run_ranks(_mixed_calls, 2, str(tmp_path))
    assert len(set(results)) == 1 and "ranks are at different tierpoint steps" in results[0]
    assert "rank 0: 'save" in results[0] and "rank 1: 'find_latest" in results[0]


def test_pickled_state_loads_only_when_allowed(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job")
    manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1)
    state = {"w": torch.ones(3), "ratio": Fraction(1, 3)}
    manager.save(BasicTensorAwareStateDict(state, allow_pickle=True), 2)
    with pytest.raises(CheckpointingError, match="allow_pickle=True") as info:
        LocalCheckpointManager(tmp_path, session_id="job").load()  # no fallback to iteration 1
    assert type(info.value).__name__ == "UnsupportedStateError"
    ta, ckpt_id = LocalCheckpointManager(tmp_path, session_id="job").load(allow_pickle=True)
    assert ckpt_id.iteration == 2 and ta.state_dict["ratio"] == Fraction(1, 3)


def _find_latest_then_save(rank: int, world: int, root: str) -> tuple[int, list[str], int]:
    records = WarningRecords()
    manager = LocalCheckpointManager(root, session_id="job")
    latest = manager.find_latest()
    # e.g. resumed from a persistent checkpoint at step 0: the old world's iteration 9 must not
    # block the new world's saves
    manager.save(BasicTensorAwareStateDict(make_state(rank, 0)), 0)
    return latest, records.messages, LocalCheckpointManager(root, session_id="job").find_latest()


def test_a_checkpoint_of_another_world_size_is_not_offered_nor_blocks_saves(tmp_path):
    run_ranks(_save_world, 2, str(tmp_path))
    results = run_ranks(_find_latest_then_save, WORLD, str(tmp_path))
    assert [latest for latest, _, _ in results] == [-1] * WORLD
    warnings = results[0][1]
    assert any(
        "iteration 9 was saved with world size 2, this job has 4 ranks" in m for m in warnings
    )
    assert any("saving local iteration 0 removes iteration(s) 9" in m for m in warnings)
    assert [after for _, _, after in results] == [0] * WORLD


def _keep_two(rank: int, world: int, root: str) -> None:
    save_iterations(root, rank, [1, 2], keep_last=2)


def _save_three_keeping_two(rank: int, world: int, root: str) -> list[str]:
    records = WarningRecords()
    save_iterations(root, rank, [3], keep_last=2)
    return records.messages


def test_older_iterations_of_another_world_size_are_named_when_a_save_removes_them(tmp_path):
    """NVRx's retention removes what this job cannot load; the WARNING names older iterations of
    another world size too, not only the newer ones."""
    run_ranks(_keep_two, 2, str(tmp_path))
    warnings = run_ranks(_save_three_keeping_two, WORLD, str(tmp_path))[0]
    assert any("saving local iteration 3 removes iteration(s) 1, 2" in m for m in warnings)


def _write_part(root: Path, holder: int, iteration: int, origin: int, world: int) -> None:
    """A part file whose metadata says what the arguments say (true or not)."""
    part = root / "job" / str(holder) / part_name(iteration, origin)
    part.parent.mkdir(parents=True)
    extra = {"iteration": iteration, "rank": origin, "world_size": world}
    fileformat.write(part, {"w": torch.ones(2)}, extra=extra)


def test_a_forged_world_size_is_refused_not_allocated(tmp_path):
    """A part whose header (checksum intact) claims 10**30 ranks is reported, never counted up to."""
    _write_part(tmp_path, holder=0, iteration=1, origin=0, world=10**30)
    records = WarningRecords()
    assert LocalCheckpointManager(tmp_path, session_id="job").find_latest() == -1
    assert any("bad world size in metadata" in m for m in records.messages)


def test_parts_only_in_other_ranks_directories_are_named(tmp_path):
    """After a restart that numbered this node's ranks anew, the node's parts sit in directories of
    other global ranks: not used (the root may be shared), but the warning says where and why."""
    _write_part(tmp_path, holder=3, iteration=9, origin=3, world=4)
    records = WarningRecords()
    assert LocalCheckpointManager(tmp_path, session_id="job").find_latest() == -1
    assert any("rank 0 holds no local parts" in m and "rank(s) 3" in m for m in records.messages)


# ------------------------------------------------------------------------------------ staged saves


def _async_staged_saves(root: Path, states: list[dict]) -> list[str]:
    """Async saves that are staged (no recycling: not in place), each finalized before the next;
    the errors they raised."""
    manager = LocalCheckpointManager(root, session_id="job", recycle=False, keep_last=2)
    errors = []
    with AsyncCallsQueue() as queue:
        for it, state in enumerate(states, start=1):
            try:
                request = manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
            except CheckpointingError as e:
                errors.append(str(e))
    return errors


def test_staged_async_saves_on_a_ram_tier_load_bit_equal_with_their_checksums(shm_dir):
    """Without recycling, a snapshot on tmpfs is staged and the worker writes and hashes it."""
    states = [make_state(0, it) for it in (1, 2, 3)]
    states[2]["model"]["big"] = torch.randn(300_000)  # several hash pieces
    assert _async_staged_saves(shm_dir, states) == []
    part = shm_dir / "job" / "0" / part_name(3, 0)
    fileformat.verify(part)  # every recorded checksum matches the bytes
    ta, ckpt_id = LocalCheckpointManager(shm_dir, session_id="job").load()
    assert ckpt_id.iteration == 3
    assert_bitwise_equal(ta.state_dict, states[2])
    assert sorted(p.name for p in part.parent.iterdir()) == [part_name(2, 0), part_name(3, 0)]


def test_a_staged_async_save_that_fills_a_ram_tier_fails_cleanly(tmp_path):
    with small_tmpfs(tmp_path / "job" / "0") as mount_point:
        states = [make_state(0, 1), {"x": torch.ones(2**20)}]  # 4 MiB > the 1 MiB tmpfs
        errors = _async_staged_saves(tmp_path, states)
        assert len(errors) == 1 and "No space left" in errors[0], errors
        assert sorted(p.name for p in mount_point.iterdir()) == [part_name(1, 0)]


# ------------------------------------------------------------------------------------ device snapshot


@pytest.mark.parametrize("overlap", [False, True])
def test_with_a_device_snapshot_the_state_may_change_as_soon_as_save_returns(tier_root, overlap):
    """Staged (disk) or copied into the part files (RAM); in one piece from the snapshot's image
    on the training thread, tensor by tensor with checksums on the overlapped thread."""
    manager = LocalCheckpointManager(tier_root, session_id="job", device_snapshot=True)
    with AsyncCallsQueue(overlap_snapshot=overlap) as queue:
        for it in (1, 2, 3):
            state = make_state(0, it)
            want = make_state(0, it)
            request = manager.save(BasicTensorAwareStateDict(state), it, is_async=True)
            state["model"]["w"].add_(1)  # before the snapshot runs: the save holds its own copy
            state["optimizer"]["exp_avg"][0].zero_()
            queue.schedule_async_request(request)
            queue.wait_for_snapshot()
            queue.maybe_finalize_async_calls(blocking=True)
            ta, ckpt_id = LocalCheckpointManager(tier_root, session_id="job").load()
            assert ckpt_id.iteration == it
            assert_bitwise_equal(ta.state_dict, want)


def test_a_device_snapshot_request_never_scheduled_fails_cleanly_when_scheduled_late(tmp_path):
    manager = LocalCheckpointManager(tmp_path, session_id="job", device_snapshot=True)
    stale = manager.save(BasicTensorAwareStateDict(make_state(0, 1)), 1, is_async=True)
    with AsyncCallsQueue() as queue:
        request = manager.save(BasicTensorAwareStateDict(make_state(0, 2)), 2, is_async=True)
        queue.schedule_async_request(request)  # did not wait for the unscheduled one
        queue.maybe_finalize_async_calls(blocking=True)
        with pytest.raises(CheckpointingError, match="overwritten by a later save"):
            queue.schedule_async_request(stale)
            queue.maybe_finalize_async_calls(blocking=True)
    ta, ckpt_id = LocalCheckpointManager(tmp_path, session_id="job").load()
    assert ckpt_id.iteration == 2
    assert_bitwise_equal(ta.state_dict, make_state(0, 2))


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_steady_async_saves_make_no_staging_views(where, tmp_path, shm_dir, monkeypatch):
    """The views of the tensors' places in staging memory are made once per memory and layout
    (the reused staging buffer on a disk tier, each recycled part file on a RAM tier), not at
    every save; each save still loads back as it was saved."""
    from tierpoint import staging
    from tierpoint.local import in_place

    made: list[int] = []
    planned_views = staging.planned_views

    def counted(data: torch.Tensor, plan: fileformat.PartPlan) -> list[torch.Tensor]:
        made.append(data.data_ptr())
        return planned_views(data, plan)

    monkeypatch.setattr(staging, "planned_views", counted)
    monkeypatch.setattr(in_place, "planned_views", counted)
    root = tmp_path if where == "disk" else shm_dir
    manager = LocalCheckpointManager(root, session_id="job")
    with AsyncCallsQueue() as queue:
        for it in range(1, 9):
            state = {"w": torch.full((64, 32), float(it)), "steps": torch.arange(it, it + 5)}
            ta = BasicTensorAwareStateDict(state)
            queue.schedule_async_request(manager.save(ta, it, is_async=True))
            queue.maybe_finalize_async_calls(blocking=True)
            reader = LocalCheckpointManager(root, session_id="job", mmap_load=False)
            loaded, ckpt_id = reader.load()  # copied out: a viewed part file is not recycled
            assert ckpt_id.iteration == it
            assert_bitwise_equal(loaded.state_dict, state)
    # one buffer on disk; on RAM the part files take turns (one set of views each)
    assert len(made) == len(set(made)) <= (1 if where == "disk" else 3), made


def _settings_differ(rank: int, world: int, root: str, setting: str) -> tuple[str, list[str]]:
    session = f"job-{rank}" if setting == "session_id" else "job"
    keep_last = 2 + rank if setting == "keep_last" else 2
    manager = LocalCheckpointManager(root, session_id=session, keep_last=keep_last)
    with pytest.raises(CheckpointingError, match=setting) as raised:
        manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1)
    directory = Path(root) / session / str(rank)
    return str(raised.value), [f for f in os.listdir(directory) if f.startswith("iter_")]


@pytest.mark.parametrize(
    "setting, said", [("keep_last", "{0: 2, 1: 3}"), ("session_id", "{0: 'job-0', 1: 'job-1'}")]
)
def test_ranks_keeping_different_numbers_of_checkpoints_or_sessions_are_refused(
    tmp_path, setting, said
):
    """keep_last 2 on rank 0 and 3 on rank 1 was accepted: each rank retired other iterations;
    each rank in its own session would save parts no restore finds complete."""
    for message, parts in run_ranks(_settings_differ, 2, str(tmp_path), setting):
        assert said in message and parts == []


def _save_while_the_previous_one_is_written(rank: int, world: int, root: str) -> tuple:
    manager = LocalCheckpointManager(root, session_id="job", keep_last=2)
    queue = AsyncCallsQueue()
    first = manager.save(BasicTensorAwareStateDict(make_state(rank, 1)), 1, is_async=True)
    if rank == 0:  # rank 0's part of iteration 1 is written, rank 1's not yet
        queue.schedule_async_request(first)
        part, deadline = Path(manager.local_ckpt_dir) / part_name(1, 0), time.monotonic() + 60
        while not part.exists():
            assert time.monotonic() < deadline, "the worker never wrote the part"
            time.sleep(0.01)
    records = WarningRecords()
    second = manager.save(BasicTensorAwareStateDict(make_state(rank, 2)), 2, is_async=True)
    if rank == 1:
        queue.schedule_async_request(first)
    queue.schedule_async_request(second)  # waits for the first to be finalized
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    queue.close()
    kept = sorted(p.name for p in Path(manager.local_ckpt_dir).glob("iter_*"))
    return records.messages, kept


def test_a_save_requested_while_the_previous_one_is_written_keeps_it(tmp_path):
    """The previous async save, committed on some ranks only when the next one is agreed on, was
    named as removed (it is in flight: kept, and counted by keep_last)."""
    results = run_ranks(_save_while_the_previous_one_is_written, 2, str(tmp_path), timeout=120)
    for rank, (warnings, kept) in enumerate(results):
        assert not any("removes iteration" in m for m in warnings), warnings
        assert kept == [part_name(1, rank), part_name(2, rank)]


def test_allow_pickle_given_as_a_string_is_refused_not_taken_as_true(tmp_path):
    """``load(allow_pickle="no")`` loaded pickles (a non-empty string is true): refused now."""
    from collections import deque

    manager = LocalCheckpointManager(tmp_path, session_id="s")
    manager.save(BasicTensorAwareStateDict({"d": deque([1])}, allow_pickle=True), 1)
    with pytest.raises(CheckpointingError, match="allow_pickle must be True or False, got 'no'"):
        LocalCheckpointManager(tmp_path, session_id="s").load(allow_pickle="no")
    with pytest.raises(CheckpointingError, match="allow_pickle must be True or False"):
        BasicTensorAwareStateDict({"d": deque([1])}, allow_pickle="yes")
    loaded, _ = LocalCheckpointManager(tmp_path, session_id="s").load(allow_pickle=True)
    assert loaded.state_dict["d"] == deque([1])


def test_a_url_is_refused_as_the_local_root(tmp_path):
    """``s3://bucket/x`` became a local directory ``s3:/bucket/x`` under the working directory."""
    with pytest.raises(CheckpointingError, match="root_local_ckpt_dir must be a local path"):
        LocalCheckpointManager("s3://bucket/x", session_id="s")
    file_url = LocalCheckpointManager(f"file://{tmp_path}", session_id="s")
    assert file_url.root_local_ckpt_dir == tmp_path


@pytest.mark.parametrize("is_async", [False, True])
def test_steady_saves_read_no_part_headers(is_async, shm_dir, monkeypatch):
    """A save's commit lists this rank's parts (retention) without reading back the header of the
    part it just wrote: for a state of thousands of tensors that is milliseconds of JSON on the
    training thread at every save."""
    reads: list[str] = []
    read_header = fileformat.read_header

    def counted(path, *args, **kwargs):
        reads.append(str(path))
        return read_header(path, *args, **kwargs)

    monkeypatch.setattr(fileformat, "read_header", counted)
    manager = LocalCheckpointManager(shm_dir, session_id="job", keep_last=2)
    with AsyncCallsQueue() as queue:
        for it in range(1, 7):
            ta = BasicTensorAwareStateDict(make_state(0, it))
            request = manager.save(ta, it, is_async=is_async)
            if is_async:
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
    assert reads == []
    assert manager.find_latest() == 6
    assert_bitwise_equal(manager.load()[0].state_dict, make_state(0, 6))
