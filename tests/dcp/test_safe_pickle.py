"""The allow-list unpickler for DCP ``.metadata``: real files load exactly; hostile ones are refused
with a clear error and nothing they ask for runs."""

from __future__ import annotations

import os
import pickle
import resource
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from tierpoint.dcp.safe_pickle import safe_loads
from tierpoint.errors import CorruptCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def plain_dcp_metadata(path: Path, state: dict) -> bytes:
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return (path / ".metadata").read_bytes()


def varied_state() -> dict:
    return {
        "w": torch.randn(7, 5),
        "bf": torch.ones(3, dtype=torch.bfloat16),
        "i": torch.arange(4),
        "mask": torch.tensor([True, False]),
        "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
        "c": torch.zeros(2, dtype=torch.complex64),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "step": 12,
        "name": "run-1",
        "blob": b"\x00\x01",
        "nested": {"a": {"b": torch.zeros(2), "c": [1, "x", 2.5]}, "t": (1, 2)},
        "none": None,
    }


def assert_same_metadata(ours: Metadata, theirs: Metadata) -> None:
    assert type(ours) is Metadata
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert ours.version == theirs.version
    assert str(ours.storage_meta.checkpoint_id) == str(theirs.storage_meta.checkpoint_id)
    assert ours.storage_meta.save_id == theirs.storage_meta.save_id
    for md in ours.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            assert type(md.size) is torch.Size
            assert md.properties.memory_format == torch.contiguous_format


def test_real_dcp_metadata_loads_exactly(tmp_path: Path) -> None:
    data = plain_dcp_metadata(tmp_path / "ck", varied_state())
    ours = safe_loads(data, "x")
    assert_same_metadata(ours, pickle.loads(data))  # our own fresh file: trusted here
    assert {"w", "bf", "step", "blob", "nested.a.c"} <= set(ours.state_dict_metadata)
    assert {type(k) for k in ours.storage_data} == {MetadataIndex}
    assert {type(v) for v in ours.storage_data.values()} == {_StorageInfo}


def test_every_pickle_protocol_of_real_metadata_loads(tmp_path: Path) -> None:
    reference = pickle.loads(plain_dcp_metadata(tmp_path / "ck", {"w": torch.ones(3), "n": 1}))
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert_same_metadata(safe_loads(pickle.dumps(reference, protocol=protocol), "x"), reference)


def test_metadata_of_older_torch_releases_loads(tmp_path: Path) -> None:
    """Older torch releases pickled the ``TensorProperties`` of
    ``torch.distributed._shard.sharded_tensor.metadata`` (and its memory-format enum), which torch
    still loads: they were refused as a forbidden global, the checkpoint called corrupt."""
    from torch.distributed._shard.sharded_tensor import metadata as older

    reference = pickle.loads(plain_dcp_metadata(tmp_path / "ck", varied_state()))
    for md in reference.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            p = md.properties
            md.properties = older.TensorProperties(
                p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory
            )
    data = pickle.dumps(reference)
    assert b"torch.distributed._shard.sharded_tensor.metadata" in data
    ours = safe_loads(data, "x")
    for fqn, md in ours.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            theirs = reference.state_dict_metadata[fqn].properties
            assert type(md.properties) is TensorProperties
            assert (md.properties.dtype, md.properties.memory_format) == (
                theirs.dtype,
                theirs.memory_format,
            )


# ------------------------------------------------------------------------------ hostile files


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a payload ran"


class RunsCommand:
    """Pickles as a call to os.system(cmd) (what an attacker puts in a file)."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def touch(marker: Path) -> str:
    return f"touch {marker}"


def hostile_payloads(marker: Path) -> dict[str, bytes]:
    cmd = touch(marker).encode()
    real = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            )
        },
        storage_data={MetadataIndex("w", [0]): _StorageInfo("__0_0.distcp", 0, 10)},
    )
    nested = Metadata(
        state_dict_metadata=real.state_dict_metadata,
        storage_data=real.storage_data,
        planner_data={"w": ("w", RunsCommand(touch(marker)))},
    )
    payloads = {
        f"reduce-protocol-{p}": pickle.dumps(RunsCommand(touch(marker)), protocol=p)
        for p in range(0, pickle.HIGHEST_PROTOCOL + 1)
    }
    payloads.update(
        {
            "nested-in-metadata": pickle.dumps(nested, protocol=4),
            "nested-in-metadata-proto2": pickle.dumps(nested, protocol=2),
            "global-os-system": b"cos\nsystem\n(S'" + cmd + b"'\ntR.",
            "stack-global": b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c"
            + bytes([len(cmd)])
            + cmd
            + b"\x85R.",
            "inst": b"(S'" + cmd + b"'\nios\nsystem\n.",
            "obj": b"(cos\nsystem\nS'" + cmd + b"'\no.",
            "import-getattr-chain": b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'"
            + cmd
            + b"'\ntR.",
            "eval": b'cbuiltins\neval\n(S\'__import__("os").system("' + cmd + b"\")'\ntR.",
            "exec": b"cbuiltins\nexec\n(S'import os; os.system(\"" + cmd + b"\")'\ntR.",
            "partial": b"cfunctools\npartial\n(cos\nsystem\nS'" + cmd + b"'\ntR)R.",
            "subprocess": b"csubprocess\ncheck_call\n((S'touch'\nS'"
            + str(marker).encode()
            + b"'\nltR.",
            "newobj-popen": b"\x80\x02csubprocess\nPopen\n)\x81.",
            "torch-rebuild-tensor": b"ctorch._utils\n_rebuild_tensor_v2\n(tR.",
            "torch-load": b"ctorch\nload\n(S'/dev/null'\ntR.",
            "torch-load-from-bytes": b"ctorch.storage\n_load_from_bytes\n(C\x00tR.",
            "copyreg-reconstructor": b"ccopyreg\n_reconstructor\n(cos\nsystem\ncbuiltins\nobject\nNtR.",
            "dcp-module-other-name": b"ctorch.distributed.checkpoint.metadata\nos\n.",
            "extension-code": b"\x80\x02\x82\x01.",
            "persistent-id": b"\x80\x02X\x01\x00\x00\x00xQ.",
            "out-of-band-buffer": b"\x80\x05\x97.",
        }
    )
    return payloads


def test_plain_pickle_would_run_the_payloads(marker: Path) -> None:
    """The corpus is live: torch's plain ``pickle.load`` executes these (so the refusals below mean
    something)."""
    payloads = hostile_payloads(marker)
    for name in ("reduce-protocol-2", "stack-global", "inst", "obj", "nested-in-metadata"):
        pickle.loads(payloads[name])
        assert marker.exists(), name
        marker.unlink()


@pytest.mark.parametrize("name", sorted(hostile_payloads(Path("/nonexistent"))))
def test_hostile_pickle_is_refused_and_nothing_runs(marker: Path, name: str) -> None:
    data = hostile_payloads(marker)[name]
    with pytest.raises(CorruptCheckpointError) as err:
        safe_loads(data, "/ckpt/step-3/.metadata")
    assert err.value.path == "/ckpt/step-3/.metadata"
    assert "/ckpt/step-3/.metadata" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "forbidden"),
    [
        ("global-os-system", "os.system"),
        ("reduce-protocol-2", "posix.system"),
        ("stack-global", "os.system"),
        ("inst", "os.system"),
        ("obj", "os.system"),
        ("import-getattr-chain", "builtins.getattr"),
        ("eval", "builtins.eval"),
        ("partial", "functools.partial"),
        ("torch-rebuild-tensor", "torch._utils._rebuild_tensor_v2"),
        ("torch-load", "torch.load"),
        ("nested-in-metadata", "posix.system"),
    ],
)
def test_refusal_names_the_forbidden_global(marker: Path, name: str, forbidden: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=f"forbidden global {forbidden}"):
        safe_loads(hostile_payloads(marker)[name], "meta")


def test_build_cannot_patch_a_class_or_a_dtype() -> None:
    patch_class = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n}X\x06\x00\x00\x00__eq__K\x01sb."
    patch_slots = b"\x80\x02ctorch\nfloat32\nN}X\x01\x00\x00\x00xK\x01s\x86b."
    eq_before = Metadata.__eq__
    for data in (patch_class, patch_slots):
        with pytest.raises(CorruptCheckpointError):
            safe_loads(data, "meta")
    assert Metadata.__eq__ is eq_before
    assert not hasattr(torch.float32, "x")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty file"),
        (b"\x80\x04\x95", "not a DCP metadata pickle"),
        (b"PK\x03\x04 this is a zip, not a pickle", "not a DCP metadata pickle"),
        (b'{"json": true}', "not a DCP metadata pickle"),
        (pickle.dumps({"state_dict_metadata": {}}), "want Metadata"),
        (pickle.dumps(7), "want Metadata"),
    ],
)
def test_malformed_input_gives_a_clear_error(data: bytes, reason: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=reason):
        safe_loads(data, "meta")


def test_truncated_real_metadata_is_refused(tmp_path: Path) -> None:
    data = plain_dcp_metadata(tmp_path / "ck", varied_state())
    for cut in (1, 2, len(data) // 3, len(data) // 2, len(data) - 1):
        with pytest.raises(CorruptCheckpointError):
            safe_loads(data[:cut], "meta")


def test_stray_bytes_after_the_pickle_are_refused(tmp_path: Path) -> None:
    data = plain_dcp_metadata(tmp_path / "ck", {"w": torch.ones(2)})
    with pytest.raises(CorruptCheckpointError, match="stray bytes"):
        safe_loads(data + b"\x00junk", "meta")


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"abc.",  # BINBYTES8, 4 EiB
        b"\x80\x04\x8e" + struct.pack("<Q", 16 << 30) + b"abc.",  # BINBYTES8, 16 GiB
        b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"abc.",  # BINUNICODE8, 1 TiB
        b"\x80\x05\x96" + struct.pack("<Q", 8 << 30) + b"abc.",  # BYTEARRAY8, 8 GiB
        b"\x80\x02B" + struct.pack("<i", 2**31 - 1) + b"abc.",  # BINBYTES, 2 GiB
    ],
)
def test_huge_length_claims_fail_fast_without_allocating(data: bytes) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptCheckpointError):
        safe_loads(data, "meta")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 * 1024


def test_deep_or_cyclic_planner_data_is_refused(tmp_path: Path) -> None:
    base = pickle.loads(plain_dcp_metadata(tmp_path / "ck", {"w": torch.ones(2)}))
    deep: list = []
    for _ in range(200):
        deep = [deep]
    cyclic: list = []
    cyclic.append(cyclic)
    for planner_data in (deep, cyclic):
        base.planner_data = planner_data
        with pytest.raises(CorruptCheckpointError, match="planner_data"):
            safe_loads(pickle.dumps(base), "meta")


# ------------------------------------------------------------------------------ legit types, bad values


def metadata_with(**changes) -> bytes:
    index = MetadataIndex("w", [0, 0])
    fields = {
        "properties": TensorProperties(dtype=torch.float32),
        "size": torch.Size([4, 3]),
        "chunks": [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3]))],
        "info": _StorageInfo("__0_0.distcp", 0, 100),
        "index": index,
    }
    fields.update(changes)
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(fields["properties"], fields["size"], fields["chunks"])
        },
        storage_data={fields["index"]: fields["info"]},
    )
    return pickle.dumps(md)


def test_metadata_with_sane_values_loads() -> None:
    md = safe_loads(metadata_with(), "meta")
    assert md.storage_data[MetadataIndex("w", [0, 0])].relative_path == "__0_0.distcp"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"info": _StorageInfo("../../etc/passwd", 0, 10)}, "plain name"),
        ({"info": _StorageInfo("/etc/passwd", 0, 10)}, "plain name"),
        ({"info": _StorageInfo("sub/__0_0.distcp", 0, 10)}, "plain name"),
        ({"info": _StorageInfo("..", 0, 10)}, "plain name"),
        ({"info": _StorageInfo("", 0, 10)}, "non-empty"),
        ({"info": _StorageInfo("__0_0.distcp", -1, 10)}, "offset"),
        ({"info": _StorageInfo("__0_0.distcp", 0, -5)}, "length"),
        ({"info": _StorageInfo("__0_0.distcp", 0.5, 10)}, "offset"),
        ({"info": _StorageInfo("__0_0.distcp", 0, 10, transform_descriptors="zstd")}, "transform"),
        ({"chunks": [ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([4, 3]))]}, "exceeds"),
        ({"chunks": [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))]}, "dims"),
        ({"size": [4, 3]}, "torch.Size"),
        ({"index": MetadataIndex("other", [0, 0])}, "lacks"),
        ({"index": MetadataIndex("w", [0])}, "does not fit"),
        ({"properties": "float32"}, "TensorProperties"),
    ],
)
def test_legit_types_with_bad_values_are_refused(changes: dict, reason: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=reason):
        safe_loads(metadata_with(**changes), "meta")


def test_negative_size_is_refused() -> None:
    data = metadata_with()
    # Rewrite the pickled torch.Size((4, 3)) of the tensor size into (-4, 3): BININT1 4 -> BININT -4.
    bad = data.replace(b"K\x04K\x03\x86", b"J" + struct.pack("<i", -4) + b"K\x03\x86", 1)
    assert bad != data
    with pytest.raises(CorruptCheckpointError, match="negative"):
        safe_loads(bad, "meta")


def test_unknown_fields_are_refused() -> None:
    md = pickle.loads(metadata_with())
    md.__dict__["surprise"] = 1
    with pytest.raises(CorruptCheckpointError, match="unknown Metadata fields"):
        safe_loads(pickle.dumps(md), "meta")
