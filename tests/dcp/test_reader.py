"""tierpoint's DCP Reader: loads what torch's writer wrote, validates before reading, and turns every
damaged, missing or hostile file into a clear CorruptCheckpointError (never a hang, never code)."""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import tierpoint.dcp.read_files as reader_mod
from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint.dcp import Reader, load, read_metadata
from tierpoint.dcp.read_files import File as _File
from tierpoint.dcp.read_files import _read_into
from tierpoint.dcp.verified_read import _region_is_contiguous
from tierpoint.errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError
from tierpoint.testing import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def source_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "big": torch.randn(300, 1000, generator=g),
            "bf": torch.randn(17, generator=g).to(torch.bfloat16),
            "cl": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
        },
        "ids": torch.randint(0, 1 << 40, (50,), generator=g),
        "mask": torch.rand(11, generator=g) > 0.5,
        "step": 41,
        "name": "run-7",
        "blob": b"\x00\xff",
        "hyper": {"lr": 0.1, "betas": (0.9, 0.95), "groups": [1, 2]},
    }


def zeros_like_state(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = zeros_like_state(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = None
    return out


def assert_state_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_state_equal(a[k], b[k])
    else:
        assert a == b and type(a) is type(b)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict]:
    state = source_state()
    path = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path, state


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("thread_count", [1, 4])
def test_load_matches_what_torch_saved(checkpoint: tuple[Path, dict], thread_count: int) -> None:
    path, state = checkpoint
    target = zeros_like_state(state)
    load(target, path, thread_count=thread_count)
    assert_state_equal(state, target)


def test_reader_plugs_into_torch_load(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    target = zeros_like_state(state)
    dcp.load(target, storage_reader=Reader(path), no_dist=True)
    assert_state_equal(state, target)


def test_tensors_are_read_into_place(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    target = zeros_like_state(state)
    before = target["model"]["big"].data_ptr()
    load(target, path)
    assert target["model"]["big"].data_ptr() == before
    assert torch.equal(target["model"]["big"], state["model"]["big"])


def test_large_tensors_are_cut_into_pieces_shared_by_threads(
    checkpoint: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, state = checkpoint
    monkeypatch.setattr(reader_mod, "PIECE_BYTES", 4096)
    seen: set[str] = set()
    sizes: list[int] = []
    real = reader_mod._read_into

    def spy(file: _File, offset: int, view: memoryview) -> None:
        seen.add(threading.current_thread().name)
        sizes.append(len(view))
        real(file, offset, view)
        time.sleep(0.001)  # (as a slow disk: on a loaded machine one thread took every piece)

    monkeypatch.setattr(reader_mod, "_read_into", spy)
    target = zeros_like_state(state)
    load(target, path, thread_count=3)
    assert_state_equal(state, target)
    assert len({name for name in seen if name.startswith("tierpoint-read")}) > 1
    # The 1.2 MB tensor arrived in 4 KiB pieces (the few larger reads are archive headers).
    assert max(sizes) <= 64 * 1024 and sizes.count(4096) >= 300 * 1000 * 4 // 4096


def test_destinations_of_other_layouts_and_dtypes(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    target = {
        "model": {
            "w": torch.zeros(33, 64).t(),  # non-contiguous destination
            "big": torch.zeros(300, 1000, dtype=torch.float64),  # converted on copy
        }
    }
    load(target, path)
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert torch.equal(target["model"]["big"], state["model"]["big"].double())


def test_conjugate_views_go_through_the_weights_only_fallback(tmp_path: Path) -> None:
    c = torch.randn(6, dtype=torch.complex64)
    dcp.save({"c": c.conj()}, checkpoint_id=tmp_path, no_dist=True)
    target = {"c": torch.zeros(6, dtype=torch.complex64)}
    load(target, tmp_path)
    assert torch.equal(target["c"], c.conj().resolve_conj())


@pytest.mark.parametrize("numel", [6, 300 * 1000])  # read whole, and read in place in pieces
def test_destinations_that_are_conjugate_or_negative_views(tmp_path: Path, numel: int) -> None:
    """A lazy conjugate or negation is filled through ``copy_`` as torch's reader does (its
    memory holds other values than it shows: reading the bytes into it failed)."""
    g = torch.Generator().manual_seed(5)
    c, r = torch.randn(numel, dtype=torch.complex64, generator=g), torch.randn(numel, generator=g)
    dcp.save({"c": c, "r": r}, checkpoint_id=tmp_path, no_dist=True)
    target = {
        "c": torch.zeros(numel, dtype=torch.complex64).conj(),
        "r": torch.zeros(numel)._neg_view(),
    }
    load(target, tmp_path)
    assert target["c"].is_conj() and torch.equal(target["c"], c)
    assert target["r"].is_neg() and torch.equal(target["r"], r)


def test_read_metadata_equals_torchs(checkpoint: tuple[Path, dict]) -> None:
    path, _ = checkpoint
    ours = read_metadata(path)
    theirs = pickle.loads((path / ".metadata").read_bytes())  # our own fresh file: trusted here
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_files_needed(checkpoint: tuple[Path, dict]) -> None:
    path, _ = checkpoint
    reader = Reader(path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(zeros_like_state(source_state()), md, True)
    names = reader.files_needed(planner.create_local_plan())
    assert names and names <= {p.name for p in path.glob("*.distcp")}


def test_region_contiguity() -> None:
    assert _region_is_contiguous([8, 4], [8, 4])
    assert _region_is_contiguous([8, 4], [3, 4])  # rows: one run
    assert _region_is_contiguous([8, 4, 2], [1, 2, 2])
    assert not _region_is_contiguous([8, 4], [8, 2])  # columns: strided
    assert not _region_is_contiguous([8, 4, 2], [2, 2, 2])


# ------------------------------------------------------------------------------ damaged files


def distcp_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [0.0, 0.5, 0.999])
def test_truncated_data_file_is_refused_before_reading(
    checkpoint: tuple[Path, dict], keep: float
) -> None:
    path, state = checkpoint
    data_file = distcp_files(path)[0]
    size = data_file.stat().st_size
    os.truncate(data_file, int(size * keep))
    target = zeros_like_state(state)
    with pytest.raises(CorruptCheckpointError, match="truncated") as err:
        load(target, path)
    assert data_file.name in str(err.value)
    if keep:
        # Every item is checked before any is read: nothing was loaded.
        assert not target["model"]["w"].any() and not target["model"]["big"].any()


def test_file_shrinking_during_the_read_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "short"
    f.write_bytes(b"x" * 100)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            _read_into(_File(str(f), 1000, fd=fd), 50, memoryview(bytearray(200)))
    finally:
        os.close(fd)


def test_missing_data_file(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    victim = distcp_files(path)[0]
    victim.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing DCP data file") as err:
        load(zeros_like_state(state), path)
    assert victim.name in str(err.value)


def test_missing_metadata(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    (path / ".metadata").unlink()
    for attempt in (lambda: load(zeros_like_state(state), path), lambda: read_metadata(path)):
        with pytest.raises(CheckpointingError, match="no committed DCP checkpoint") as err:
            attempt()
        assert not isinstance(err.value, CorruptCheckpointError)  # nothing is damaged
    with pytest.raises(CheckpointingError, match="no such checkpoint directory") as err:
        load(zeros_like_state(state), path.parent / "step-999")
    assert not isinstance(err.value, CorruptCheckpointError)


@pytest.mark.timeout(30)
def test_fifo_in_place_of_a_data_file_does_not_hang(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    victim = distcp_files(path)[0]
    victim.unlink()
    os.mkfifo(victim)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        load(zeros_like_state(state), path)


def rewrite_metadata(path: Path, edit) -> None:
    md = pickle.loads((path / ".metadata").read_bytes())
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def test_item_beyond_the_end_of_its_file(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint

    def stretch(md) -> None:
        index = max(md.storage_data, key=lambda i: md.storage_data[i].offset)
        md.storage_data[index].length += 10**9

    rewrite_metadata(path, stretch)
    with pytest.raises(CorruptCheckpointError, match=r"truncated: item .* needs bytes"):
        load(zeros_like_state(state), path)


def test_bytes_item_truncated(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    md = pickle.loads((path / ".metadata").read_bytes())
    blob = next(info for index, info in md.storage_data.items() if index.fqn == "step")
    os.truncate(path / blob.relative_path, blob.offset + blob.length // 2)
    with pytest.raises(CorruptCheckpointError, match="truncated") as err:
        load(zeros_like_state(state), path)
    assert blob.relative_path in str(err.value)


def test_an_unknown_stream_transform_is_refused_by_name_not_as_corrupt(
    checkpoint: tuple[Path, dict],
) -> None:
    path, state = checkpoint

    def add_transform(md) -> None:
        next(iter(md.storage_data.values())).transform_descriptors = ["stream.rot13/1"]

    rewrite_metadata(path, add_transform)
    with pytest.raises(UnsupportedStateError, match="stream transform 'stream.rot13/1'") as err:
        load(zeros_like_state(state), path)
    assert not isinstance(err.value, CorruptCheckpointError)


def test_dtype_contradicting_the_metadata(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint

    def retype(md) -> None:
        md.state_dict_metadata["model.w"].properties.dtype = torch.float64

    rewrite_metadata(path, retype)
    target = zeros_like_state(state)
    target["model"]["w"] = torch.zeros(64, 33, dtype=torch.float64)
    with pytest.raises(CorruptCheckpointError, match="holds torch.float32, the metadata says"):
        load(target, path)


def item_range(path: Path, fqn: str) -> tuple[Path, int, int]:
    md = pickle.loads((path / ".metadata").read_bytes())
    info = next(info for index, info in md.storage_data.items() if index.fqn == fqn)
    return path / info.relative_path, info.offset, info.length


def test_damaged_archive_structure(checkpoint: tuple[Path, dict]) -> None:
    path, state = checkpoint
    file, offset, length = item_range(path, "model.w")
    with open(file, "r+b") as f:  # smash the zip end-of-directory record of this item
        f.seek(offset + length - 22)
        f.write(b"\x00" * 22)
    with pytest.raises(CorruptCheckpointError, match=r"item 'model.w': no zip end-of-directory"):
        load(zeros_like_state(state), path)


class RunsCommand:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_hostile_tensor_header_is_refused_and_nothing_runs(
    checkpoint: tuple[Path, dict], tmp_path: Path
) -> None:
    path, state = checkpoint
    marker = tmp_path / "pwned"
    file, offset, length = item_range(path, "model.w")
    data = bytearray(file.read_bytes())
    archive = zipfile.ZipFile(io.BytesIO(bytes(data[offset : offset + length])))
    entry = next(e for e in archive.infolist() if e.filename.endswith("/data.pkl"))
    local = offset + entry.header_offset
    name_len, extra_len = struct.unpack("<2H", data[local + 26 : local + 30])
    start = local + 30 + name_len + extra_len
    evil = pickle.dumps(RunsCommand(f"touch {marker}"), protocol=2)
    assert len(evil) <= entry.file_size
    data[start : start + entry.file_size] = evil.ljust(entry.file_size, b" ")
    file.write_bytes(bytes(data))
    target = zeros_like_state(state)
    with pytest.raises(CorruptCheckpointError, match="forbidden global posix.system"):
        load(target, path)
    assert not marker.exists()
    # Found before anything was written: the items read before it are not in place either.
    assert_state_equal(target, zeros_like_state(state))


def test_hostile_non_tensor_value_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.ones(3), "x": RunsCommand(f"touch {marker}")}, checkpoint_id=path, no_dist=True
    )
    target = {"w": torch.zeros(3), "x": None}
    with pytest.raises(UnsupportedStateError, match="x: this non-tensor value needs code") as err:
        load(target, path)
    assert "\x1b" not in str(err.value)  # torch's colour codes are stripped
    assert not marker.exists()
    assert not target["w"].any(), "the tensors were written although the load failed"
    # The danger is real: torch's default planner would have run it.
    dcp.load(target, storage_reader=Reader(path), planner=DefaultLoadPlanner(), no_dist=True)
    assert marker.exists()
    marker.unlink()


def test_a_refused_non_tensor_value_names_what_weights_only_refused(tmp_path: Path) -> None:
    """The error gave the first line of torch's message alone ("... you have two options, do those
    steps only if you trust the source"), never what was refused nor the options."""
    path = tmp_path / "ckpt"
    dcp.save({"x": RunsCommand("true")}, checkpoint_id=path, no_dist=True)
    with pytest.raises(UnsupportedStateError) as err:
        load({"x": None}, path)
    message = str(err.value)
    assert "GLOBAL posix.system" in message, message
    assert "two options" not in message and "DefaultLoadPlanner()" in message


def test_numpy_values_load_as_torch_dcp_loads_them(tmp_path: Path) -> None:
    """numpy's RNG state, arrays and scalars (what training scripts keep beside their tensors)
    load by default, saved by tierpoint or by torch; they were refused as needing trust."""
    import numpy as np

    from tierpoint.dcp import save

    state = {
        "w": torch.ones(4),
        "rng": np.random.RandomState(3).get_state(),
        "index": np.arange(5, dtype=np.int16),
        "seen": np.float32(2.5),
    }
    for name, write in (("tierpoint", save), ("torch", dcp.save)):
        path = str(tmp_path / name)
        write(state, checkpoint_id=path)
        loaded = {"w": torch.zeros(4), "rng": None, "index": None, "seen": None}
        load(loaded, path)
        assert torch.equal(loaded["w"], state["w"])
        assert all(np.array_equal(a, b) for a, b in zip(loaded["rng"], state["rng"]))
        assert loaded["index"].dtype == np.int16 and np.array_equal(loaded["index"], np.arange(5))
        assert type(loaded["seen"]) is np.float32 and loaded["seen"] == 2.5


def test_a_load_leaves_the_globals_the_user_allowed_for_torch_load(tmp_path: Path) -> None:
    """numpy's classes the user allowed with ``add_safe_globals`` (as torch's own error advises)
    for their ``torch.load(weights_only=True)``: a load decoding a plain value took them away."""
    import numpy as np

    mine = [np.ndarray, np.dtype, type(np.dtype(np.int64))]
    added = [g for g in mine if g not in torch.serialization.get_safe_globals()]
    torch.serialization.add_safe_globals(added)
    try:
        path = tmp_path / "ckpt"
        dcp.save({"w": torch.ones(2), "step": 3}, checkpoint_id=path, no_dist=True)
        loaded = {"w": torch.zeros(2), "step": 0}
        load(loaded, path)
        assert loaded["step"] == 3
        allowed = torch.serialization.get_safe_globals()
        assert all(g in allowed for g in mine), [g for g in mine if g not in allowed]
    finally:
        for g in added:
            torch.serialization._weights_only_unpickler._remove_safe_globals([g])


def test_hostile_metadata_is_refused(checkpoint: tuple[Path, dict], tmp_path: Path) -> None:
    path, state = checkpoint
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    with pytest.raises(CorruptCheckpointError, match="forbidden global posix.system"):
        load(zeros_like_state(state), path)
    # Plugged straight into torch's load, the refusal still stops the load.
    with pytest.raises(CheckpointException) as err:
        dcp.load(zeros_like_state(state), storage_reader=Reader(path), no_dist=True)
    assert "forbidden global posix.system" in str(err.value.failures[0][0])
    assert not marker.exists()


# ------------------------------------------------------------------------------ object storage


def upload(path: Path, url: str, options: dict) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **options)
    for f in path.iterdir():
        fs.put_file(str(f), f"{root}/{f.name}")


@pytest.mark.timeout(120)
def test_load_from_s3(checkpoint: tuple[Path, dict], s3_bucket: tuple[str, dict]) -> None:  # noqa: F811
    path, state = checkpoint
    bucket, options = s3_bucket
    url = f"{bucket}/step-1"
    upload(path, url, options)
    target = zeros_like_state(state)
    load(target, url, storage_options=options, thread_count=3)
    assert_state_equal(state, target)
    assert (
        read_metadata(url, storage_options=options).storage_data == read_metadata(path).storage_data
    )


@pytest.mark.timeout(120)
def test_damaged_objects_on_s3(
    checkpoint: tuple[Path, dict],
    s3_bucket: tuple[str, dict],  # noqa: F811 - the fixture
) -> None:
    path, state = checkpoint
    bucket, options = s3_bucket
    data_file = distcp_files(path)[0]
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])
    upload(path, f"{bucket}/truncated", options)
    with pytest.raises(CorruptCheckpointError, match="truncated") as err:
        load(zeros_like_state(state), f"{bucket}/truncated", storage_options=options)
    assert data_file.name in str(err.value)
    data_file.unlink()
    upload(path, f"{bucket}/missing", options)
    with pytest.raises(CorruptCheckpointError, match="missing DCP data file"):
        load(zeros_like_state(state), f"{bucket}/missing", storage_options=options)
    with pytest.raises(CheckpointingError, match="no committed DCP checkpoint"):
        read_metadata(f"{bucket}/nothing-here", storage_options=options)


# ------------------------------------------------------------------------------ several ranks


def _sharded_target(world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.zeros(40, 6), mesh, [Shard(0)])}


def _load_expecting_error(path: str, world: int) -> tuple[str, str]:
    target = _sharded_target(world)
    try:
        load(target, path)
    except CheckpointingError as e:
        # No rank wrote anything, although only rank 1's items are damaged.
        assert not target["w"].to_local().any(), "a failed load wrote into the state"
        return type(e).__name__, str(e)
    raise AssertionError("load succeeded on a damaged checkpoint")


def _damage_one_ranks_file_then_the_metadata(rank: int, world: int, path: str, marker: str) -> list:
    state = _sharded_target(world)
    state["w"].to_local().copy_(torch.arange(240.0).reshape(40, 6).chunk(world)[rank])
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    rank_1_file = Path(path) / "__1_0.distcp"  # only rank 1's shard lives there
    if rank == 0:
        intact = rank_1_file.read_bytes()
        damaged = bytearray(intact)
        damaged[damaged.find(b"OrderedDict") + 3] ^= 0xFF  # in the record's header
        rank_1_file.write_bytes(damaged)
    dist.barrier()
    outcomes = [_load_expecting_error(path, world)]
    dist.barrier()
    if rank == 0:
        rank_1_file.write_bytes(intact)
        os.truncate(rank_1_file, 100)
    dist.barrier()
    outcomes.append(_load_expecting_error(path, world))
    dist.barrier()
    if rank == 0:
        (Path(path) / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    dist.barrier()
    outcomes.append(_load_expecting_error(path, world))
    dist.barrier()
    return outcomes


@pytest.mark.timeout(180)
def test_damaged_files_fail_every_rank_alike(tmp_path: Path) -> None:
    """A data file only rank 1 reads (a damaged record header, then a truncation), then a hostile
    .metadata: every rank raises the same CorruptCheckpointError naming the file, no rank wrote
    into its state, nobody hangs, nothing runs."""
    marker = tmp_path / "pwned"
    path = str(tmp_path / "ckpt")
    results = run_ranks(_damage_one_ranks_file_then_the_metadata, 2, path, str(marker), timeout=150)
    assert results[0] == results[1]
    (header_kind, header_message), (kind, message), (meta_kind, meta_message) = results[0]
    assert header_kind == "CorruptCheckpointError"
    assert "failed on rank 1:" in header_message and "__1_0.distcp" in header_message
    assert kind == "CorruptCheckpointError"
    assert "failed on rank 1:" in message
    assert "__1_0.distcp" in message and "truncated" in message
    assert meta_kind == "CorruptCheckpointError"
    assert "forbidden global posix.system" in meta_message
    assert not marker.exists()


def test_a_state_whose_keys_mix_int_and_str_loads(tmp_path):
    """torch DCP names an int key by its str; sorting the keys themselves (as torch's load does)
    failed with a TypeError when int and str keys mix."""
    from tierpoint.dcp import save

    save({7: torch.ones(2), "a": torch.full((2,), 3.0)}, tmp_path / "s")
    state = {7: torch.empty(2), "a": torch.empty(2)}
    load(state, tmp_path / "s")
    assert state[7].tolist() == [1.0, 1.0] and state["a"].tolist() == [3.0, 3.0]


def test_plain_values_under_int_keys_load_into_their_keys(tmp_path):
    """torch names the key 3 "3": a plain value there came back beside the live key, under "3",
    leaving the live one as it was (also at the top and inside a list)."""
    from tierpoint.dcp import save

    saved = {"w": torch.ones(2), 0: 5, "p": {3: 7, "q": {1: "x"}}, "l": [{2: 8}, torch.ones(1)]}
    save(saved, tmp_path / "s")
    state = {"w": torch.empty(2), 0: 0, "p": {3: 0, "q": {1: "y"}}, "l": [{2: 0}, torch.empty(1)]}
    load(state, tmp_path / "s")
    assert {k: v for k, v in state.items() if k not in ("w", "l")} == {0: 5, "p": saved["p"]}
    assert state["l"][0] == {2: 8} and state["l"][1].tolist() == [1.0]


def _load_other_steps(rank: int, world: int, base: str) -> tuple[str, list[float]]:
    from tierpoint.dcp import save, step_path

    for step in (1, 2):
        save({"w": torch.full((4,), float(rank + 10 * step))}, step_path(base, step))
    state = {"w": torch.zeros(4)}
    try:
        load(state, step_path(base, 1 + rank))  # each rank "found" another latest step
        error = ""
    except CheckpointingError as e:
        error = str(e)
    return error, state["w"].tolist()


def test_ranks_loading_different_saves_are_refused_before_anything_is_written(tmp_path):
    """Rank 0 loading step 1 while rank 1 loads step 2 loaded a mix of the two, silently."""
    results = run_ranks(_load_other_steps, 2, str(tmp_path))
    for error, values in results:
        assert "the ranks read different saves" in error and "nothing was loaded" in error
        assert values == [0.0] * 4
