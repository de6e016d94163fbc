"""The DCP Writer produces standard checkpoints: torch's own FileSystemReader loads them, on 1, 2 and
4 ranks (DTensor shards, replicated tensors, non-tensor values); the commit protocol runs in order;
failures are clear and leave nothing committed."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tierpoint import storage
from tierpoint.dcp import Writer, get_latest_complete_checkpoint, load, save, step_path
from tierpoint.dcp.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from tierpoint.dcp.torch_save_bytes import record_template
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .file_names import data_file, fix_file_token, untokened

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def local_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(8, 12, generator=g)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
            "t": wide.t(),  # non-contiguous
            "mask": torch.rand(17, generator=g) > 0.5,
            "idx": torch.randint(0, 1000, (5, 3), generator=g),
            "c": torch.randn(4, 2, generator=g, dtype=torch.complex64),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        },
        "step": 1234,
        "name": "run-α",
        "opts": {"lr": 0.1, "betas": (0.9, 0.99)},
    }


def zeros_like_state(state: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v.contiguous())
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        return None

    return z(state)


def assert_same(loaded: dict, expected: dict) -> None:
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, dict):
            assert_same(got, value)
        elif isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert torch.equal(got, value), key
        else:
            assert got == value, key


def test_torch_reader_loads_every_dtype_and_value(tmp_path):
    state = local_state()
    path = step_path(tmp_path, 7)
    save(state, path, thread_count=3)
    assert untokened(os.listdir(path)) == [
        ".checksums-0.json",
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__0_2.distcp",
    ]
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert_same(out, state)
    assert get_latest_complete_checkpoint(tmp_path) == path


def test_plain_dcp_save_with_writer_commits_and_clears_markers(tmp_path):
    state = local_state(1)
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=Writer(path, thread_count=2))
    assert ".metadata" in os.listdir(path)
    assert not [n for n in os.listdir(path) if n.startswith(".unfinished")]
    out = zeros_like_state(state)
    dcp.load(out, checkpoint_id=path)
    assert_same(out, state)


def test_lazy_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {"conj": c.conj(), "neg": c.conj().imag, "plain": torch.arange(3.0)}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=Writer(path))
    out = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    dcp.load(out, checkpoint_id=path)
    for key, value in state.items():
        assert torch.equal(out[key], value.resolve_conj().resolve_neg()), key


def test_tensor_records_are_what_torch_load_reads():
    for dtype, shape in [(torch.float16, (3, 5)), (torch.int8, (0,)), (torch.float64, ())]:
        t = torch.arange(max(1, int(torch.tensor(shape).prod().item()) if shape else 1)).to(dtype)
        t = t[: int(torch.tensor(shape).prod().item()) if shape else 1].reshape(shape)
        tpl = record_template(dtype, shape)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        back = torch.load(io.BytesIO(tpl.head + raw + tpl.tail), weights_only=True)
        assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
        assert len(tpl.head) % 64 == 0 or tpl.nbytes == 0  # data 64-byte aligned in the record


def test_data_is_64_byte_aligned_in_files(tmp_path):
    path = str(tmp_path / "c")
    save({"a": torch.randn(3), "b": torch.randn(100), "c": torch.randn(7)}, path, thread_count=1)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        assert info.offset % 64 == 0


def test_commit_protocol_order(tmp_path, monkeypatch):
    """Marker before any data; .metadata after all data; marker removed after .metadata."""
    events: list[tuple[str, str]] = []
    for name in ("touch", "publish", "remove", "write_file"):
        original = getattr(storage, name)

        def recording(url, *a, _name=name, _original=original, **k):
            events.append((_name, os.path.basename(os.fspath(url))))
            return _original(url, *a, **k)

        monkeypatch.setattr(storage, name, recording)
    original_bulk = storage.remove_files

    def recording_bulk(directory, names, **k):
        events.extend(("remove", name) for name in names)
        return original_bulk(directory, names, **k)

    monkeypatch.setattr(storage, "remove_files", recording_bulk)
    save(local_state(), str(tmp_path / "c"), thread_count=2)
    order = [f"{op}:{name}" for op, name in events]
    assert order[0] == "touch:.unfinished-0"
    data = [i for i, e in enumerate(order) if e.startswith("write_file:__0_")]
    assert len(data) == 2
    commit = order.index("publish:.metadata")
    unmark = order.index("remove:.unfinished-0", commit)
    assert max(data) < commit < unmark


def test_a_committed_directory_is_kept_unless_overwrite_is_asked_for(tmp_path):
    path = step_path(tmp_path, 1)
    save({"a": torch.zeros(4)}, path)
    with pytest.raises(CheckpointingError, match="already holds a complete checkpoint"):
        save({"a": torch.ones(4)}, path)
    assert get_latest_complete_checkpoint(tmp_path) == path  # untouched, still committed
    assert untokened(os.listdir(path)) == [".checksums-0.json", ".metadata", "__0_0.distcp"]
    w = Writer(path, overwrite=True)
    w.set_up_storage_writer(True, rank=0)  # a new save starts: marker in, old commit out
    assert untokened(os.listdir(path)) == [".checksums-0.json", ".unfinished-0", "__0_0.distcp"]
    assert get_latest_complete_checkpoint(tmp_path) is None
    save({"a": torch.ones(4)}, path, overwrite=True)
    loaded = {"a": torch.zeros(4)}
    load(loaded, path)
    assert torch.equal(loaded["a"], torch.ones(4))


def _resave_complete_then_interrupted(rank: int, world: int, base: str) -> list[str]:
    path = step_path(base, 1)
    save({"a": torch.full((4,), float(rank))}, path)
    outcomes = []
    try:  # complete: refused on every rank, whichever rank checks first
        save({"a": torch.full((4,), 9.0)}, path)
        outcomes.append("saved")
    except CheckpointingError as e:
        outcomes.append("refused" if "already holds a complete checkpoint" in str(e) else str(e))
    outcomes.append(str(get_latest_complete_checkpoint(base)))
    dist.barrier()
    if rank == 1:  # a save killed after its commit, before rank 1's marker was removed
        open(os.path.join(path, ".unfinished-1"), "w").close()
    dist.barrier()
    outcomes.append(str(get_latest_complete_checkpoint(base)))
    save({"a": torch.full((4,), 7.0)}, path)  # not complete: saved into again
    loaded = {"a": torch.zeros(4)}
    load(loaded, path)
    outcomes.append(f"{get_latest_complete_checkpoint(base) == path} {loaded['a'].tolist()}")
    return outcomes


def test_only_a_complete_directory_is_kept_from_a_new_save(tmp_path):
    """Two ranks: a complete step is refused on both (no rank's new marker makes it look
    unfinished to the other); a step whose save was killed between its commit and the removal of
    its markers is not offered by get_latest and is saved into again without overwrite."""
    path = step_path(tmp_path, 1)
    results = run_ranks(_resave_complete_then_interrupted, 2, str(tmp_path), timeout=120)
    for rank, outcomes in enumerate(results):  # (the replicated tensor is stored once, rank 0's)
        assert outcomes == ["refused", path, "None", f"True {[7.0] * 4}"], (rank, outcomes)
    # Rank 1's file holds no item .metadata refers to: the commit removed it, and its manifest.
    assert untokened(os.listdir(path)) == [".checksums-0.json", ".metadata", "__0_0.distcp"]


def test_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path, fixed_token):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    save({"a": torch.ones(1000)}, step_path(tmp_path, 1))
    os.makedirs(step_path(tmp_path, 2))
    os.symlink("/dev/full", os.path.join(step_path(tmp_path, 2), data_file(0)))
    with pytest.raises(CheckpointingError, match=r"step-2/__0_0.t0.distcp.*ENOSPC") as info:
        save({"a": torch.ones(1000)}, step_path(tmp_path, 2), thread_count=1)
    assert "failed on rank 0: CheckpointingError: writing" in str(info.value), info.value
    assert not os.path.exists(os.path.join(step_path(tmp_path, 2), ".metadata"))
    assert get_latest_complete_checkpoint(tmp_path) == step_path(tmp_path, 1)


def test_unwritable_path_fails_clearly(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointingError, match=r"file/step-1.*ENOTDIR"):
        save({"a": torch.ones(3)}, step_path(tmp_path / "file", 1))


def test_file_size_limit_fails_clearly(tmp_path):
    """RLIMIT_FSIZE makes writes fail with EFBIG: the save raises naming the file."""
    import resource
    import signal

    save({"a": torch.ones(10)}, step_path(tmp_path, 1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # this process only, briefly
    try:
        with pytest.raises(CheckpointingError, match=r"step-2/__0_0\.[0-9a-f]{12}\.distcp.*EFBIG"):
            save({"a": torch.ones(1 << 20)}, step_path(tmp_path, 2), thread_count=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert get_latest_complete_checkpoint(tmp_path) == step_path(tmp_path, 1)


# ------------------------------------------------------------------------------ several ranks


def _mesh_state(rank: int, world: int, seed: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(world * 6, 5, generator=g)
    replicated = torch.randn(11, generator=g)
    return {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": replicated,
        "meta": {"step": seed, "tag": f"seed-{seed}"},
    }, full


def _round_trip(rank: int, world: int, root: str, use_torch_save: bool) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    state, full = _mesh_state(rank, world, 3)
    path = os.path.join(root, f"w{world}")
    if use_torch_save:
        dcp.save(state, storage_writer=Writer(path, thread_count=2))
    else:
        save(state, path, thread_count=2)
    names = os.listdir(path)
    assert ".metadata" in names and not [n for n in names if n.startswith(".unfinished")]
    assert f"__{rank}_0.distcp" in untokened(names)
    mesh = init_device_mesh("cpu", (world,))
    out = {
        "sharded": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
        "replicated": torch.zeros(11),
        "meta": {"step": 0, "tag": ""},
    }
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert torch.equal(out["sharded"].full_tensor(), full)
    assert torch.equal(out["replicated"], state["replicated"])
    assert out["meta"] == {"step": 3, "tag": "seed-3"}
    dist.barrier()
    return True


@pytest.mark.parametrize("world", [1, 4])
def test_ranks_round_trip_through_torchs_reader(tmp_path, world):
    assert run_ranks(_round_trip, world, str(tmp_path), False, timeout=120) == [True] * world


def _two_ranks(rank: int, world: int, root: str) -> str:
    assert _round_trip(rank, world, os.path.join(root, "torch-flow"), True)
    return _one_rank_fails(rank, world, os.path.join(root, "failing"))


def _one_rank_fails(rank: int, world: int, root: str) -> str:
    save({"x": torch.full((100,), float(rank))}, step_path(root, 1))
    target = step_path(root, 2)
    token = fix_file_token()  # every rank: a save names its files with one token
    if rank == 1:
        os.makedirs(target, exist_ok=True)
        os.symlink("/dev/full", os.path.join(target, data_file(1, token=token)))
    state = {f"r{rank}": torch.full((1000,), float(rank))}  # each rank saves its own tensor
    try:
        save(state, target, thread_count=1)
    except CheckpointingError as e:
        message = str(e)
    else:
        message = "no error"
    latest = get_latest_complete_checkpoint(root)
    return f"{message}|{latest}"


def test_two_ranks_round_trip_and_a_failing_rank_fails_the_save_everywhere(tmp_path):
    """torch's own dcp.save with Writer on 2 ranks loads with torch's reader; then rank 1's disk
    is full: every rank raises the same error, nothing is committed, the previous step stays."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=180)
    root = tmp_path / "failing"
    messages = {r.split("|")[0] for r in results}
    assert len(messages) == 1, results  # the same error on every rank
    message = messages.pop()
    assert "rank 1" in message and data_file(1) in message and "ENOSPC" in message
    assert {r.split("|")[1] for r in results} == {step_path(root, 1)}
    assert not os.path.exists(os.path.join(step_path(root, 2), ".metadata"))
    assert not os.path.exists(step_path(root, 2))  # cleaned up: files, markers, the directory


def test_wrong_arguments_are_named(tmp_path):
    with pytest.raises(CheckpointingError, match="get_latest_complete_checkpoint returns None"):
        load({"a": torch.zeros(1)}, None)
    with pytest.raises(CheckpointingError, match="step must be a non-negative int"):
        step_path(tmp_path, "5")
    with pytest.raises(CheckpointingError, match="state_dict must be a dict"):
        save(torch.ones(2), step_path(tmp_path, 1))
    with pytest.raises(CheckpointingError, match="state_dict must be a dict"):
        load([torch.ones(2)], step_path(tmp_path, 1))
    with pytest.raises(CheckpointingError, match="thread_count must be an int >= 1, got '2'"):
        Writer(step_path(tmp_path, 1), thread_count="2")
    with pytest.raises(CheckpointingError, match="base must be a path or URL string"):
        get_latest_complete_checkpoint(None)
    assert not os.path.exists(step_path(tmp_path, 1))


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_a_launch_without_a_process_group_is_refused_before_writing(tmp_path, monkeypatch, how):
    """Several processes started by a launcher but no init_process_group(): each would save as
    "rank 0 of 1" into the same files; refused, as the local tier and the loader refuse it."""
    from tierpoint import dcp as tp_dcp

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(CheckpointingError, match="WORLD_SIZE=2 is set but torch.distributed"):
        getattr(tp_dcp, how)({"w": torch.ones(4)}, step_path(tmp_path, 1))
    assert not os.path.exists(step_path(tmp_path, 1))


def test_a_refused_save_through_a_reused_writer_keeps_the_checkpoint(tmp_path):
    """The writer of a complete save is reset and reused for another save into the same step: the
    save is refused, and the failure's clean-up must not remove the earlier save's files."""
    path = step_path(tmp_path, 1)
    state = {"a": torch.arange(1000.0)}
    writer = Writer(path)
    planned = save_state_dict_async_plan(state, writer)
    writer.write_now()
    save_state_dict_async_finalize(*planned)
    before = sorted(os.listdir(path))
    writer.reset(path)
    with pytest.raises(CheckpointingError, match="already holds a complete checkpoint"):
        save_state_dict_async_plan({"a": torch.zeros(1000)}, writer)
    assert sorted(os.listdir(path)) == before
    out = {"a": torch.zeros(1000)}
    load(out, path)
    assert torch.equal(out["a"], state["a"])


def test_wrong_save_keywords_are_refused_before_anything_is_touched(tmp_path):
    """``overwrite="no"`` un-committed the checkpoint there (a string is true), ``sync_files=None``
    skipped every fsync, an out-of-range ``coordinator_rank`` failed only at the commit, and a
    wrong ``metadata_cache`` or ``queue`` left an unfinished marker behind."""
    from tierpoint.dcp import async_save

    committed = step_path(tmp_path, 1)
    save({"w": torch.ones(4)}, committed)
    before = sorted(os.listdir(committed))
    with pytest.raises(CheckpointingError, match="overwrite must be True or False, got 'no'"):
        save({"w": torch.zeros(4)}, committed, overwrite="no")
    assert sorted(os.listdir(committed)) == before
    target = step_path(tmp_path, 2)
    for keywords, message in [
        ({"sync_files": None}, "sync_files must be True or False"),
        ({"enable_cache": "no"}, "enable_cache must be True or False"),
        ({"coordinator_rank": 3}, r"coordinator_rank must be a rank of the group \(0 to 0\)"),
        ({"coordinator_rank": "0"}, "coordinator_rank must be an int >= 0"),
        ({"metadata_cache": "cache"}, "metadata_cache must be a CheckpointMetadataCache"),
        ({"storage_options": "endpoint"}, "storage_options must be a mapping"),
    ]:
        for fn in (save, async_save):
            with pytest.raises(CheckpointingError, match=message):
                fn({"w": torch.ones(4)}, target, **keywords)
    with pytest.raises(CheckpointingError, match="queue must be an AsyncCallsQueue or None"):
        async_save({"w": torch.ones(4)}, target, queue="queue")
    assert not os.path.exists(target)
