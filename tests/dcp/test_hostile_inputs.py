"""Hostile and damaged DCP checkpoints beyond the basics of test_reader / test_safe_pickle: whatever
the files say, a load ends in a CorruptCheckpointError naming the file and the reason (never a raw
exception, a hang or a huge allocation), and never leaves stale values presented as loaded."""

from __future__ import annotations

import copy
import io
import os
import pickle
import resource
import struct
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from tierpoint.dcp import Reader, load, read_metadata, safe_loads
from tierpoint.dcp import saved_tensor as saved_tensor_mod
from tierpoint.errors import CorruptCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def source() -> dict:
    return {"w": torch.arange(12.0).reshape(4, 3), "b": torch.arange(5), "step": 3}


def blank() -> dict:
    return {"w": torch.full((4, 3), -1.0), "b": torch.full((5,), -1)}


def untouched(target: dict) -> bool:
    return bool((target["w"] == -1).all() and (target["b"] == -1).all())


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(source(), checkpoint_id=path, no_dist=True)
    return path


def metadata_of(path: Path):
    return pickle.loads((path / ".metadata").read_bytes())  # our own fresh file: trusted here


def write_metadata(path: Path, md) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(md))


def info_of(md, fqn: str):
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def item_bytes(path: Path, fqn: str) -> bytes:
    info = info_of(metadata_of(path), fqn)
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def replace_item(path: Path, fqn: str, item: bytes) -> None:
    """Append ``item`` to the item's data file and point the metadata at it."""
    md = metadata_of(path)
    info = info_of(md, fqn)
    data_file = path / info.relative_path
    info.offset, info.length = data_file.stat().st_size, len(item)
    with open(data_file, "ab") as f:
        f.write(item)
    write_metadata(path, md)


def archive(entries: list[tuple[str, bytes]], deflate: bool = False) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in entries:
            kind = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            z.writestr(zipfile.ZipInfo(name), data, compress_type=kind)
    return out.getvalue()


def entries_of(item: bytes) -> list[tuple[str, bytes]]:
    z = zipfile.ZipFile(io.BytesIO(item))
    return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def saved(value: torch.Tensor) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


PLACEHOLDER = b"X" + struct.pack("<I", 11) + b"PLACEHOLDER"  # the protocol-2 pickle of the str


def splice(md, value_pickle: bytes) -> bytes:
    """``md`` pickled with its one "PLACEHOLDER" string replaced by raw pickle opcodes."""
    data = pickle.dumps(md, protocol=2)
    assert data.count(PLACEHOLDER) == 1
    return data.replace(PLACEHOLDER, value_pickle)


def deep_list(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


def shared_list(fanout: int, levels: int) -> bytes:
    """A list whose repr has fanout**levels entries, in a few hundred bytes: each level lists the
    one below ``fanout`` times through the memo (slots far above the metadata pickle's own)."""

    def slot(level: int) -> bytes:
        return struct.pack("<I", 1_000_000 + level)

    ops = b"(" + b"K\x01" * fanout + b"lr" + slot(0) + b"0"  # MARK ints LIST LONG_BINPUT POP
    for level in range(1, levels):
        ops += b"(" + (b"j" + slot(level - 1)) * fanout + b"lr" + slot(level) + b"0"
    return ops + b"j" + slot(levels - 1)  # LONG_BINGET: the top list


# ------------------------------------------------------------------------------ metadata values


@pytest.mark.parametrize(
    "value", [-(10**5000), 10**5000, 2**63], ids=["-10e5000", "10e5000", "2e63"]
)
def test_huge_ints_in_the_metadata_are_refused(ckpt: Path, value: int) -> None:
    """A 5000-digit offset cannot be printed (Python refuses) nor seeked to: refused by name."""
    md = metadata_of(ckpt)
    info_of(md, "w").offset = value
    write_metadata(ckpt, md)
    target = blank()
    with pytest.raises(CorruptCheckpointError, match=r"storage_data\['w'\].offset is .*2\*\*63"):
        load(target, ckpt)
    assert untouched(target)


def test_huge_int_index_is_refused(ckpt: Path) -> None:
    md = metadata_of(ckpt)
    index = next(i for i in md.storage_data if i.fqn == "w")
    md.storage_data[MetadataIndex("w", index.offset, 10**5000)] = md.storage_data.pop(index)
    with pytest.raises(CorruptCheckpointError, match="index is <int of"):
        safe_loads(pickle.dumps(md), "meta")


@pytest.mark.parametrize("field", ["offset", "dtype", "relative_path"])
def test_deeply_nested_values_in_metadata_fields_are_refused(ckpt: Path, field: str) -> None:
    """A value nested 100,000 deep where a scalar belongs: the error message must not recurse."""
    md = metadata_of(ckpt)
    if field == "dtype":
        md.state_dict_metadata["w"].properties.dtype = "PLACEHOLDER"
    else:
        setattr(info_of(md, "w"), field, "PLACEHOLDER")
    with pytest.raises(CorruptCheckpointError, match=r"<list>|\[<list>\]"):
        safe_loads(splice(md, deep_list(100_000)), "meta")


@pytest.mark.timeout(30)
def test_values_with_an_exploding_repr_are_refused_at_once(ckpt: Path) -> None:
    """A 10**12-entry repr built from shared lists (a 'billion laughs'): refused, not printed."""
    md = metadata_of(ckpt)
    info_of(md, "w").offset = "PLACEHOLDER"
    with pytest.raises(CorruptCheckpointError, match="offset is"):
        safe_loads(splice(md, shared_list(fanout=10, levels=12)), "meta")


@pytest.mark.timeout(30)
def test_shared_planner_data_is_checked_once_per_container(ckpt: Path) -> None:
    """planner_data nested 60 deep, each level holding the next twice: 2**60 paths, 61 lists. It
    is plain data and loads, in linear time."""
    md = metadata_of(ckpt)
    node: list = [1]
    for _ in range(60):
        node = [node, node]
    md.planner_data = node
    top = safe_loads(pickle.dumps(md), "meta").planner_data
    assert top[0] is top[1]  # still shared (never compare these with ==: 2**60 paths)
    for _ in range(60):
        top = top[0]
    assert top == [1]


def _one_chunk_list_under_many_tensors(md) -> None:
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    chunks = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(1500)]
    shared = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([1500]), chunks)
    md.state_dict_metadata.update({f"t{i}": shared for i in range(1500)})


def _one_plan_for_many_ranks(md) -> None:
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    item = WriteItem(index=MetadataIndex("step"), type=WriteItemType.BYTE_IO)
    md.all_local_plans = [SavePlan([item] * 2000)] * 2000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("share", [_one_chunk_list_under_many_tensors, _one_plan_for_many_ranks])
def test_records_shared_to_multiply_the_work_are_refused(ckpt: Path, share) -> None:
    """A 'billion laughs' of records: a few hundred kilobytes of pickle whose records, shared
    through the memo, stand for millions (each path a record of its own to check and build: minutes
    of work and gigabytes of objects at a few megabytes). Refused, in time linear in its size."""
    md = metadata_of(ckpt)
    share(md)
    data = pickle.dumps(md)
    assert len(data) < 300_000
    with pytest.raises(CorruptCheckpointError, match="more records than the pickle has bytes"):
        safe_loads(data, "meta")


def test_non_utf8_storage_file_names_are_refused(ckpt: Path) -> None:
    """A lone surrogate cannot be turned into a path: clear error instead of UnicodeEncodeError."""
    md = metadata_of(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "\ud800.distcp"
    write_metadata(ckpt, md)
    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8"):
        load(blank(), ckpt)


# ------------------------------------------------------------------------------ chunks and ranges


def edit_chunks(ckpt: Path, chunks: list[ChunkStorageMetadata]) -> None:
    md = metadata_of(ckpt)
    md.state_dict_metadata["w"].chunks = chunks
    write_metadata(ckpt, md)


S = torch.Size


@pytest.mark.parametrize(
    "chunks",
    [
        [],  # nothing stored for w
        [ChunkStorageMetadata(S([0, 0]), S([2, 3]))],  # half of w
        [  # overlapping chunks with a gap of the same volume
            ChunkStorageMetadata(S([0, 0]), S([4, 3])),
            ChunkStorageMetadata(S([0, 0]), S([2, 3])),
        ],
    ],
    ids=["none", "half", "overlap-and-gap"],
)
def test_chunks_that_do_not_cover_the_tensor_are_refused(
    ckpt: Path, chunks: list[ChunkStorageMetadata]
) -> None:
    """A tensor whose chunks leave a hole would keep the destination's old values there, as if
    loaded: the metadata is refused instead."""
    edit_chunks(ckpt, chunks)
    target = blank()
    with pytest.raises(CorruptCheckpointError, match=r"chunks do not cover the \[4, 3\] tensor"):
        load(target, ckpt)
    assert untouched(target)


def test_rank_local_metadata_may_list_only_its_own_chunks(ckpt: Path) -> None:
    """torch's rank-local ``__<rank>.metadata`` lists one rank's chunks: not a damaged file."""
    edit_chunks(ckpt, [ChunkStorageMetadata(S([0, 0]), S([2, 3]))])
    (ckpt / "__0.metadata").write_bytes((ckpt / ".metadata").read_bytes())
    md = Reader(ckpt).read_metadata(rank=0)
    assert md.state_dict_metadata["w"].chunks[0].sizes == S([2, 3])
    with pytest.raises(CorruptCheckpointError, match="chunks do not cover"):
        read_metadata(ckpt)


def test_two_items_sharing_bytes_are_refused(ckpt: Path) -> None:
    """A metadata whose entry for w2 points at w's bytes would load w's values into w2."""
    md = metadata_of(ckpt)
    md.state_dict_metadata["w2"] = copy.deepcopy(md.state_dict_metadata["w"])
    index = next(i for i in md.storage_data if i.fqn == "w")
    md.storage_data[MetadataIndex("w2", index.offset)] = copy.copy(md.storage_data[index])
    write_metadata(ckpt, md)
    target = {"w": torch.zeros(4, 3), "w2": torch.zeros(4, 3)}
    with pytest.raises(CorruptCheckpointError, match=r"items of \['w', 'w2'\] overlap"):
        load(target, ckpt)
    assert not target["w2"].any()


def test_files_needed_reports_a_chunk_without_storage(ckpt: Path) -> None:
    """Peer retrieval asks which files a plan reads: a chunk the metadata does not store is a
    clear error there too, not a KeyError."""
    md = metadata_of(ckpt)
    del md.storage_data[next(i for i in md.storage_data if i.fqn == "w")]
    write_metadata(ckpt, md)
    reader = Reader(ckpt)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(4, 3)}, metadata, True)
    with pytest.raises(CorruptCheckpointError, match="which the metadata does not store"):
        reader.files_needed(planner.create_local_plan())


# ------------------------------------------------------------------------------ tensor items


def test_malformed_zip64_extra_field_is_refused(ckpt: Path) -> None:
    """An extra field longer than its entry (a struct.error for a naive parser)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in entries_of(item_bytes(ckpt, "w")):
            info = zipfile.ZipInfo(name)
            if name.endswith("/data.pkl"):
                info.extra = struct.pack("<2H", 1, 64) + bytes(8)
            z.writestr(info, data)
    replace_item(ckpt, "w", out.getvalue())
    with pytest.raises(CorruptCheckpointError, match="malformed extra field") as err:
        load(blank(), ckpt)
    assert "__0_0.distcp" in str(err.value)


def with_data_pkl(item: bytes, edit) -> bytes:
    return archive([(n, edit(d) if n.endswith("/data.pkl") else d) for n, d in entries_of(item)])


def test_a_hostile_item_cannot_change_how_other_checkpoints_are_read(
    ckpt: Path, tmp_path: Path
) -> None:
    """A data.pkl that BUILDs new attributes onto the shared FloatStorage stand-in (to make every
    later float32 tensor read as float16) is refused, and a good checkpoint still loads after it."""
    poison = b"ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypectorch\nfloat16\nsb0"
    replace_item(ckpt, "w", with_data_pkl(item_bytes(ckpt, "w"), lambda d: d[:2] + poison + d[2:]))
    good = tmp_path / "good"
    dcp.save(source(), checkpoint_id=good, no_dist=True)
    stand_in = saved_tensor_mod._DATA_GLOBALS[("torch", "FloatStorage")]
    try:
        with pytest.raises(CorruptCheckpointError, match="item 'w': unreadable data.pkl"):
            load(blank(), ckpt)
        target = blank()
        load(target, good)
        assert torch.equal(target["w"], source()["w"])
    finally:
        saved_tensor_mod._DATA_GLOBALS[("torch", "FloatStorage")] = stand_in
        if "dtype" in getattr(stand_in, "__dict__", {}):  # without the fix: undo the poisoning
            del stand_in.__dict__["dtype"]


@pytest.mark.parametrize(
    "value", [pickle.dumps(10**5000, 2)[2:-1], deep_list(100_000)], ids=["huge-int", "deep-list"]
)
def test_huge_or_deep_values_in_a_tensor_header_are_refused(ckpt: Path, value: bytes) -> None:
    """The size tuple of the tensor's rebuild call holds a 5000-digit int or a 100,000-deep list."""
    size = b"K\x04K\x03\x86"  # BININT1 4, BININT1 3, TUPLE2: the (4, 3) of the rebuild call

    def edit(data: bytes) -> bytes:
        assert data.count(size) == 1
        return data.replace(size, value + b"K\x03\x86")

    replace_item(ckpt, "w", with_data_pkl(item_bytes(ckpt, "w"), edit))
    with pytest.raises(CorruptCheckpointError, match=r"item 'w': size \(.*\) holds a negative"):
        load(blank(), ckpt)


@pytest.mark.parametrize("deflate", [False, True], ids=["in-place", "torch.load-fallback"])
def test_stored_tensor_of_another_shape_than_its_chunk_is_refused(
    ckpt: Path, deflate: bool
) -> None:
    """The item holds an (8, 3) tensor where the metadata's chunk is (4, 3): its first rows would
    load silently otherwise."""
    replace_item(ckpt, "w", archive(entries_of(saved(torch.ones(8, 3))), deflate=deflate))
    target = blank()
    with pytest.raises(CorruptCheckpointError, match=r"size \[8, 3\], the metadata's chunk is"):
        load(target, ckpt)
    assert (target["w"] == -1).all()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", ["sparse-coo", "sparse-csr", "meta"])
def test_fallback_accepts_only_dense_cpu_tensors(ckpt: Path, kind: str) -> None:
    """A compressed item goes through torch.load(weights_only=True), which also rebuilds sparse
    and meta tensors: refused by name instead of failing inside copy_."""
    dense = torch.arange(12.0).reshape(4, 3)
    value = {
        "sparse-coo": dense.to_sparse,
        "sparse-csr": dense.to_sparse_csr,
        "meta": lambda: dense.to("meta"),
    }[kind]()
    replace_item(ckpt, "w", archive(entries_of(saved(value)), deflate=True))
    with pytest.raises(CorruptCheckpointError, match="not a dense one"):
        load(blank(), ckpt)


def deflate_bomb(item: bytes, unpacked: int) -> bytes:
    """``item`` with its storage replaced by ``unpacked`` deflated zero bytes (~1000:1)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, data in entries_of(item):
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if "/data/" in name:
                with z.open(info, "w", force_zip64=True) as f:
                    block = bytes(16 << 20)
                    for _ in range(unpacked // len(block)):
                        f.write(block)
            else:
                z.writestr(info, data)
    return out.getvalue()


@pytest.mark.timeout(120)
def test_deflate_bomb_is_refused_before_torch_load_unpacks_it(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 250 KiB item whose entries unpack to 256 MiB (the metadata says 48 bytes): torch.load
    would allocate and fill all of it."""
    bomb = deflate_bomb(item_bytes(ckpt, "w"), 256 << 20)
    assert len(bomb) < 1 << 20
    replace_item(ckpt, "w", bomb)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    before = rss_mib()
    with pytest.raises(CorruptCheckpointError, match=r"item 'w': archive entries unpack to \d+"):
        load(blank(), ckpt)
    assert not calls
    assert rss_mib() - before < 128


@pytest.mark.timeout(120)
def test_huge_central_directory_claim_is_refused_without_reading_it(ckpt: Path) -> None:
    """An item that is a 512 MiB hole ending in an end-of-directory record claiming all of it as
    the central directory: refused before the 512 MiB are read into memory."""
    md = metadata_of(ckpt)
    info = info_of(md, "w")
    data_file = ckpt / info.relative_path
    start = data_file.stat().st_size
    hole = 512 << 20
    os.truncate(data_file, start + hole)  # sparse: no disk space, reads as zeros
    with open(data_file, "ab") as f:
        f.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, hole, 0, 0))
    info.offset, info.length = start, hole + 22
    write_metadata(ckpt, md)
    before = rss_mib()
    with pytest.raises(CorruptCheckpointError, match="a central directory of"):
        load(blank(), ckpt)
    assert rss_mib() - before < 256


def test_data_file_linking_outside_the_checkpoint_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """A link to a file outside the directory would load its bytes as weights (e.g. a secret copied
    into a model that is later shared); a link within the directory is an ordinary file."""
    name = info_of(metadata_of(ckpt), "w").relative_path
    outside = tmp_path / "elsewhere.distcp"
    os.replace(ckpt / name, outside)
    os.symlink(outside, ckpt / name)
    target = blank()
    with pytest.raises(CorruptCheckpointError, match="links outside the checkpoint directory"):
        load(target, ckpt)
    assert untouched(target)
    (ckpt / name).unlink()
    os.replace(outside, ckpt / "kept.bin")
    os.symlink("kept.bin", ckpt / name)
    load(target, ckpt)
    assert torch.equal(target["w"], source()["w"])
