"""Checksums in the persistent tier: every saved item is checked when it is read back.

A byte flipped inside a tensor of a ``.distcp`` file makes ``tierpoint verify`` fail naming the
file and ``load`` raise :class:`CorruptCheckpointError` (on every rank), for sync and async saves,
on disk, on a RAM disk (staged in place) and on S3; a checkpoint written by plain torch still loads
and is reported unverified; a damaged or hostile manifest is a clear error."""

from __future__ import annotations

import glob
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint import storage
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.cli import main
from tierpoint.dcp import async_save, load, save, step_path, verify_checkpoint
from tierpoint.dcp.checksums import MAX_MANIFEST_BYTES, range_checksums
from tierpoint.errors import CorruptCheckpointError
from tierpoint.testing import run_ranks

from .test_writer import assert_same, zeros_like_state

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 300, generator=g),  # larger than one small-item read
        "b": torch.arange(10),
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def _save(kind: str, state: dict, path: str) -> None:
    if kind == "sync":
        save(state, path)
        return
    with AsyncCallsQueue() as queue:
        expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        future = async_save(state, path, queue=queue)
        state["w"].add_(1)  # training goes on: the checkpoint holds the snapshot
        future.result(timeout=120)
        state.update(expected)


def _flip_in_tensor(path: str, tensor: torch.Tensor, at: int = 1000) -> str:
    """Flip one bit of ``tensor``'s bytes where they lie in a data file; returns that file."""
    needle = tensor.contiguous().view(torch.uint8).numpy().tobytes()[:64]
    for name in glob.glob(os.path.join(path, "__*.distcp")):
        data = bytearray(Path(name).read_bytes())
        where = data.find(needle)
        if where >= 0:
            data[where + at] ^= 0x10
            Path(name).write_bytes(bytes(data))
            return name
    raise AssertionError("tensor bytes not found")


def _manifest(path: str) -> Path:
    (found,) = glob.glob(os.path.join(path, ".checksums-0.*.json"))
    return Path(found)


@pytest.mark.parametrize("kind,where", [("sync", "disk"), ("async", "disk"), ("async", "ram")])
def test_a_flipped_byte_in_a_tensor_fails_verify_and_load(kind, where, tmp_path, shm_dir, capsys):
    path = step_path(str(tmp_path if where == "disk" else shm_dir), 1)
    state = _state()
    _save(kind, state, path)
    manifest = json.loads(_manifest(path).read_bytes())
    assert manifest["algorithm"] == "xxh3-64" and manifest["files"]
    loaded = zeros_like_state(state)
    load(loaded, path)  # a good checkpoint loads, verified
    assert_same(loaded, state)
    assert main(["verify", path]) == 0
    assert "every item matches its checksum" in capsys.readouterr().out

    damaged = _flip_in_tensor(path, state["w"])
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {path}" in out and damaged in out and "checksum mismatch in item 'w'" in out
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in item 'w'") as info:
        load(zeros_like_state(state), path)
    assert damaged in str(info.value)


def test_a_flipped_byte_in_a_small_tensor_or_a_value_is_found(tmp_path):
    path = step_path(str(tmp_path), 1)
    state = {"w": torch.randn(100), "extra": {"lr": 0.5, "name": "adamw-with-a-long-name"}}
    save(state, path, thread_count=1)
    (name,) = glob.glob(os.path.join(path, "__*.distcp"))
    data = bytearray(Path(name).read_bytes())
    data[data.find(b"adamw-with") + 2] ^= 0x01  # inside the pickled value, still decodable
    Path(name).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in item 'extra.name'"):
        load(zeros_like_state(state), path)


def test_a_checkpoint_written_by_plain_torch_loads_and_is_reported_unverified(tmp_path, capsys):
    path = str(tmp_path / "torch")
    state = _state()
    dcp.save(state, checkpoint_id=path)
    assert not glob.glob(os.path.join(path, ".checksums-*"))
    loaded = zeros_like_state(state)
    load(loaded, path)
    assert_same(loaded, state)
    assert not verify_checkpoint(path).verified
    assert main(["verify", path]) == 0
    assert "unverified: no checksum manifest" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content,reason",
    [
        (b'{"format": "tierpoint-dcp-checksums", "version": 1, "algorithm"', "not a checksum"),
        (b"[" * 100_000 + b"]" * 100_000, "not a checksum manifest"),
        (b'{"format": "something else"}', "not a tierpoint checksum manifest"),
        (
            b'{"format": "tierpoint-dcp-checksums", "version": 1, "algorithm": "xxh3-64", '
            b'"files": {"__0_0.x.distcp": [[0, -5, "00"]]}}',
            "malformed entry",
        ),
        (
            b'{"format": "tierpoint-dcp-checksums", "version": 1, "algorithm": "xxh3-64", '
            b'"files": {"../../etc/passwd": []}}',
            "not a plain name",
        ),
        (
            b'{"format": "tierpoint-dcp-checksums", "version": 1, "algorithm": "xxh3-64", '
            b'"files": {}}',
            "no checksum recorded",
        ),
        (b" " * (MAX_MANIFEST_BYTES + 1), "over the limit"),
    ],
    ids=["truncated", "nesting", "foreign", "types", "names", "empty", "huge"],
)
def test_a_damaged_or_hostile_manifest_is_a_clear_error(tmp_path, capsys, content, reason):
    path = step_path(str(tmp_path), 1)
    state = _state()
    save(state, path)
    manifest = _manifest(path)
    manifest.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=reason) as info:
        load(zeros_like_state(state), path)
    assert manifest.name in str(info.value) or "__0_" in str(info.value)
    assert main(["verify", path]) == 1
    assert reason in capsys.readouterr().out


def test_a_lost_manifest_fails_verify_ls_and_load(tmp_path, capsys):
    """A tierpoint data file (a save token in its name) always has its manifest: one that is gone,
    even every one of the save, is damage, never "written without checksums" (which would let a
    damaged data file load unchecked)."""
    path = step_path(str(tmp_path), 1)
    assert run_ranks(_save_two_ranks, 2, path, False) == [True, True]
    (lost,) = glob.glob(os.path.join(path, ".checksums-1.*.json"))
    os.unlink(lost)
    assert main(["verify", path]) == 1
    assert f"{os.path.basename(lost)}: missing" in capsys.readouterr().out
    for manifest in glob.glob(os.path.join(path, ".checksums-*.json")):
        os.unlink(manifest)
    assert main(["verify", path]) == 1
    assert "without it the data cannot be checked" in capsys.readouterr().out
    assert main(["ls", "--json", str(tmp_path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)["checkpoints"]
    assert row["status"] == "corrupt" and "checksum manifest" in row["detail"], row
    with pytest.raises(CorruptCheckpointError, match="missing"):
        load({"w": torch.zeros(256, 40), "step": 0}, path)


def _dtensor_state(world: int, seed: int):
    """The full tensor, and a state holding it sharded over ``world`` ranks (one: whole)."""
    full = torch.randn(256, 40, generator=torch.Generator().manual_seed(seed))
    if world == 1:
        return full, {"w": full.clone(), "step": seed}
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return full, {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": seed}


def _save_two_ranks(rank: int, world: int, path: str, is_async: bool) -> bool:
    _, state = _dtensor_state(world, 3)
    if is_async:
        with AsyncCallsQueue() as queue:
            async_save(state, path, queue=queue).result(timeout=120)
    else:
        save(state, path)
    return True


def _load_on_ranks(rank: int, world: int, path: str) -> str:
    full, state = _dtensor_state(world, 3)
    _, out = _dtensor_state(world, 99)
    try:
        load(out, path)
    except CorruptCheckpointError as e:
        return f"corrupt: {e}"
    got = out["w"].full_tensor() if world > 1 else out["w"]
    return "equal" if torch.equal(got, full) and out["step"] == 3 else "differ"


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_two_ranks_save_and_load_verified_and_every_rank_raises_on_damage(tmp_path, is_async):
    path = step_path(str(tmp_path), 1)
    assert run_ranks(_save_two_ranks, 2, path, is_async) == [True, True]
    assert sorted(os.path.basename(m)[:12] for m in glob.glob(f"{path}/.checksums-*")) == [
        ".checksums-0",
        ".checksums-1",
    ]
    assert run_ranks(_load_on_ranks, 2, path) == ["equal", "equal"]
    assert run_ranks(_load_on_ranks, 1, path) == ["equal"]  # resharded
    full, _ = _dtensor_state(1, 3)
    damaged = _flip_in_tensor(path, full[128:])  # rank 1's shard
    results = run_ranks(_load_on_ranks, 2, path)
    for result in results:  # every rank raises, naming the file and the item
        assert result.startswith("corrupt:") and damaged in result and "item 'w'" in result
    assert "checksum mismatch" in results[1]


def test_a_resharded_load_reading_part_of_an_item_verifies_it(tmp_path):
    path = step_path(str(tmp_path), 1)
    assert run_ranks(_save_two_ranks, 1, path, False) == [True]
    assert run_ranks(_load_on_ranks, 2, path) == ["equal", "equal"]  # each reads half the item
    full, _ = _dtensor_state(1, 3)
    damaged = _flip_in_tensor(path, full, at=200)  # in the half rank 0 reads
    for result in run_ranks(_load_on_ranks, 2, path):
        assert result.startswith("corrupt:") and damaged in result and "item 'w'" in result


def test_on_s3_a_flipped_byte_is_found(s3_bucket):  # noqa: F811 - pytest fixture
    base, options = s3_bucket
    path = step_path(base, 1)
    state = _state()
    save(state, path, storage_options=options)
    loaded = zeros_like_state(state)
    load(loaded, path, storage_options=options)
    assert_same(loaded, state)
    assert verify_checkpoint(path, storage_options=options).verified
    names = storage.listdir(path, options)
    assert any(n.startswith(".checksums-0.") for n in names)
    fs, key = storage.filesystem(path, options)
    needle = state["w"].view(torch.uint8).numpy().tobytes()[:64]
    for name in (n for n in names if n.endswith(".distcp")):
        data = bytearray(fs.cat_file(f"{key}/{name}"))
        at = data.find(needle)
        if at >= 0:
            data[at + 2000] ^= 0x04
            fs.pipe_file(f"{key}/{name}", bytes(data))
            break
    fs.invalidate_cache()
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in item 'w'"):
        load(zeros_like_state(state), path, storage_options=options)


def test_range_checksums_hash_the_bytes_of_a_file_given_in_pieces():
    data = bytes(range(256)) * 300
    pieces = [data[:7], data[7:7], data[7:5000], data[5000:]]
    ranges = [(0, 0), (0, 10), (5, 4990), (4999, 3), (6000, len(data) - 6000)]
    expected = [xxhash.xxh3_64_hexdigest(data[o : o + n]) for o, n in ranges]
    for lanes in (1, 2, 3, 16):
        assert range_checksums(pieces, ranges, lanes) == expected
        assert range_checksums(pieces, ranges[::-1], lanes) == expected[::-1]  # any order
        with pytest.raises(ValueError, match="beyond"):
            range_checksums(pieces, [*ranges, (len(data) - 1, 2)], lanes)


def test_the_metadata_stays_torch_only(tmp_path):
    """The manifest is a file of its own: ``.metadata`` names only torch's classes and the data
    files, so torch's own reader still loads the checkpoint."""
    path = step_path(str(tmp_path), 1)
    state = _state()
    save(state, path)
    md = pickle.loads(Path(path, ".metadata").read_bytes())  # our own fresh file: trusted here
    assert all(info.relative_path.endswith(".distcp") for info in md.storage_data.values())
    out = zeros_like_state(state)
    dcp.load(out, checkpoint_id=path)
    assert_same(out, state)
