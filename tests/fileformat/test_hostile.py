"""Hostile and damaged part files beyond the corpus of test_fileformat: what is not a regular file,
truncation at every region boundary, headers crafted by hand with a valid checksum (an attacker can
recompute xxh3), skeletons that decode to unusable values, and states the writer must refuse because
the reader would refuse the file it wrote."""

from __future__ import annotations

import json
import os
import pickle
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from tierpoint import fileformat, tree
from tierpoint.errors import CorruptCheckpointError, UnsupportedStateError
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

CHECKSUM_KEY = fileformat.CHECKSUM_KEY
ZERO_SUM = "0" * 16


def stream(path: Path) -> fileformat.PartHeader:
    return fileformat.PartVerifier(path, memoryview(path.read_bytes())).finish()


READERS: dict[str, Callable[[Path], Any]] = {
    "read": fileformat.read,
    "read_noverify": lambda p: fileformat.read(p, verify=False),
    "read_mmap": lambda p: fileformat.unflatten_checked(*fileformat.read_flat(p, mmap=True)),
    "read_header": fileformat.read_header,
    "verify": fileformat.verify,
}
ALL_READERS = {**READERS, "stream": stream}


def assert_corrupt(path: Path, reader: Callable[[Path], Any], reason: str = "") -> str:
    with pytest.raises(CorruptCheckpointError) as info:
        reader(path)
    assert info.value.path == str(path)
    assert reason in info.value.reason
    return info.value.reason


# ------------------------------------------------------------------------------ crafted files


def sum_field(value: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{value}"'.encode()


def craft(entries: dict[str, Any], doc: dict[str, Any], data: bytes = b"") -> bytes:
    """A part file built by hand (not by fileformat): header text, padding, a valid header checksum."""
    meta = {"format": "tierpoint", "tierpoint": json.dumps(doc), CHECKSUM_KEY: ZERO_SUM}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    padded = text + b" " * ((-(8 + len(text))) % fileformat.DATA_ALIGNMENT)
    digest = xxhash.xxh3_64_hexdigest(padded)
    padded = padded.replace(sum_field(ZERO_SUM), sum_field(digest), 1)
    return struct.pack("<Q", len(padded)) + padded + data


MISSING: Any = object()
"""Marks a field left out of a crafted header."""
W_BYTES = torch.arange(4, dtype=torch.float32).numpy().tobytes()


def one_tensor_file(
    entry: dict[str, Any] | None = None, rec: list[Any] | None = None, **doc: Any
) -> bytes:
    """A valid one-tensor file (``w``: float32 [4]) with fields of its entry, record or document replaced."""
    base_entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    base_rec = ["w", "float32", [4], xxhash.xxh3_64_hexdigest(W_BYTES), "cpu"]
    full_doc = {"version": 1, "skeleton": {"~": "tensor", "i": 0}, "extra": {}, **doc}
    full_doc.setdefault("tensors", [rec if rec is not None else base_rec])
    full_doc = {k: v for k, v in full_doc.items() if v is not MISSING}
    full_entry = {k: v for k, v in {**base_entry, **(entry or {})}.items() if v is not MISSING}
    return craft({"w": full_entry}, full_doc, W_BYTES)


def test_crafted_baseline_file_is_valid(tmp_path: Path) -> None:
    """The hand-built file the cases below damage is itself read exactly (else they prove nothing)."""
    path = tmp_path / "part"
    path.write_bytes(one_tensor_file())
    for reader in ("read", "read_noverify", "read_mmap"):
        assert torch.equal(READERS[reader](path), torch.arange(4, dtype=torch.float32))
    assert stream(path) == fileformat.verify(path)


NAN = float("nan")
WRONG_TYPES = [None, True, 1.5, NAN, "4", [], {}, [[4]], -1, 2**70]
FIELD_CASES = {
    # record fields: [name, dtype, shape, checksum, device]
    "record_name": [lambda v: {"rec": [v, "float32", [4], ZERO_SUM, "cpu"]}, WRONG_TYPES],
    "record_dtype": [lambda v: {"rec": ["w", v, [4], ZERO_SUM, "cpu"]}, [*WRONG_TYPES, "Tensor", "qint8", "bits8"]],
    "record_shape": [lambda v: {"rec": ["w", "float32", v, ZERO_SUM, "cpu"]}, [*WRONG_TYPES, [True] * 4, [4.0], [NAN], [2, 2.0]]],
    "record_checksum": [lambda v: {"rec": ["w", "float32", [4], v, "cpu"]}, [*WRONG_TYPES, "0" * 17]],
    "record_device": [lambda v: {"rec": ["w", "float32", [4], ZERO_SUM, v]}, [None, 1, [], {}, "bogus!", "cuda:-1", "cpu" * 30]],
    "record_short": [lambda v: {"rec": v}, [[], ["w"], ["w", "float32", [4], ZERO_SUM], "w", 7, {}]],
    "entry_dtype": [lambda v: {"entry": {"dtype": v}}, [None, 1, [], "F64", "f32", "U8"]],
    "entry_offsets": [lambda v: {"entry": {"data_offsets": v}}, [None, [0], [0, 16, 32], [0.0, 16], [False, 16], [NAN, 16], [0, 2**70], [-16, 0], "0,16"]],
    "doc_version": [lambda v: {"version": v}, [None, "1", 1.5, 2, 0, [], {}, MISSING]],
    "doc_tensors": [lambda v: {"tensors": v}, [None, {}, "w", [], MISSING]],
    "doc_extra": [lambda v: {"extra": v}, [None, [], "x", 1]],
}  # fmt: skip
FIELD_PARAMS = [
    pytest.param(case, i, id=f"{case}-{i}")
    for case, (_, values) in FIELD_CASES.items()
    for i in range(len(values))
]


@pytest.mark.parametrize(("case", "index"), FIELD_PARAMS)
def test_every_header_field_of_the_wrong_type_is_refused(
    tmp_path: Path, case: str, index: int
) -> None:
    """A header whose checksum holds but whose fields have impossible types or values gives
    CorruptCheckpointError from every reader (never a raw TypeError, KeyError, OverflowError...)."""
    make, values = FIELD_CASES[case]
    path = tmp_path / "part"
    path.write_bytes(one_tensor_file(**make(values[index])))
    for reader in ALL_READERS.values():
        assert "header checksum" not in assert_corrupt(path, reader)


def test_entry_and_record_must_agree_on_shape(tmp_path: Path) -> None:
    """The safetensors entry and the tierpoint record describe one tensor: a file where safetensors
    would see another shape (or none) than tierpoint is refused."""
    path = tmp_path / "part"
    for shape in ([2, 2], [16], [4, 1], None, MISSING):
        path.write_bytes(one_tensor_file(entry={"shape": shape}))
        for reader in ALL_READERS.values():
            assert_corrupt(path, reader, "shape")


def test_a_header_entry_cannot_be_claimed_by_two_records(tmp_path: Path) -> None:
    """Two records naming one (empty) tensor would leave another header entry unchecked and give two
    tensors the file does not hold."""
    path = tmp_path / "part"
    empty_sum = xxhash.xxh3_64_hexdigest(b"")
    path.write_bytes(
        craft(
            {"e": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "x": 5},
            {
                "version": 1,
                "skeleton": [{"~": "tensor", "i": 0}, {"~": "tensor", "i": 1}],
                "extra": {},
                "tensors": [["e", "float32", [0], empty_sum, "cpu"], ["e", "float32", [0, 7], empty_sum, "cpu"]],
            },
        )
    )  # fmt: skip
    for reader in ALL_READERS.values():
        assert_corrupt(path, reader, "'e'")


def test_a_missing_skeleton_is_not_read_as_none(tmp_path: Path) -> None:
    """A document without its state skeleton does not load as the state ``None``."""
    path = tmp_path / "part"
    path.write_bytes(one_tensor_file(skeleton=MISSING))
    for reader in ALL_READERS.values():
        assert_corrupt(path, reader, "skeleton")


def test_misaligned_tensors_in_a_valid_file_read_exactly(tmp_path: Path) -> None:
    """A valid file from another writer may place a float32 at an odd offset: every read mode returns
    its exact values (the mapping path copies what it cannot view)."""
    values = torch.tensor([1.5, -2.25, 3.0, 1e-30])
    data = b"\x07" + values.numpy().tobytes() + b"\x08\x09\x0a"
    spans = {"a": (0, 1), "w": (1, 17), "b": (17, 20)}
    entries = {
        "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "w": {"dtype": "F32", "shape": [4], "data_offsets": [1, 17]},
        "b": {"dtype": "U8", "shape": [3], "data_offsets": [17, 20]},
    }
    records = [
        [n, "uint8" if n != "w" else "float32", entries[n]["shape"],
         xxhash.xxh3_64_hexdigest(data[b:e]), "cpu"]
        for n, (b, e) in spans.items()
    ]  # fmt: skip
    skeleton = {"~": "dict", "k": ["a", "w", "b"], "v": [{"~": "tensor", "i": i} for i in range(3)]}
    path = tmp_path / "part"
    path.write_bytes(
        craft(entries, {"version": 1, "skeleton": skeleton, "extra": {}, "tensors": records}, data)
    )
    for reader in ("read", "read_noverify", "read_mmap"):
        out = READERS[reader](path)
        assert torch.equal(out["w"], values)
        assert out["a"].tolist() == [7] and out["b"].tolist() == [8, 9, 10]
    fileformat.verify(path)


def test_zero_length_and_blank_headers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "part"
    for header in (b"", b" " * 56, b"\0" * 56, b"{}" + b" " * 54, b"null" + b" " * 52):
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        for reader in ALL_READERS.values():
            assert_corrupt(path, reader)


# ------------------------------------------------------------------------------- hostile skeletons


def skeleton_file(skeleton: Any) -> bytes:
    return one_tensor_file(skeleton=skeleton)


@pytest.mark.parametrize("dims", [[2**63], [2**70, 1], [-(2**63) - 1]], ids=str)
def test_torch_size_beyond_int64_is_refused(tmp_path: Path, dims: list[int]) -> None:
    """A ``torch.Size`` node with dimensions torch cannot hold must not load as a Size that fails
    later, in user code, with a raw ValueError (on repr, comparison, allocation...)."""
    path = tmp_path / "part"
    path.write_bytes(skeleton_file({"~": "size", "v": dims}))
    for reader in ("read", "read_noverify", "read_mmap", "verify"):
        assert_corrupt(path, READERS[reader], "bad state skeleton")


def test_int64_extremes_of_torch_size_still_load(tmp_path: Path) -> None:
    path = tmp_path / "part"
    path.write_bytes(skeleton_file({"~": "size", "v": [2**63 - 1, -(2**63), 0]}))
    out = fileformat.read(path)
    assert out == torch.Size([2**63 - 1, -(2**63), 0]) and repr(out)


def test_pickle_payload_in_a_file_never_runs_by_default(tmp_path: Path) -> None:
    """A file whose skeleton carries a pickle (checksum recomputed) is refused on every default
    load path, and its payload never runs."""
    ran: list[bool] = []

    class Boom:
        def __reduce__(self) -> Any:
            return (ran.append, (True,))

    payload = {"~": "pickle", "v": __import__("base64").b64encode(pickle.dumps(Boom())).decode()}
    path = tmp_path / "part"
    path.write_bytes(skeleton_file([{"~": "tensor", "i": 0}, payload]))
    for reader in ("read", "read_noverify", "read_mmap"):
        with pytest.raises(UnsupportedStateError, match="allow_pickle"):
            READERS[reader](path)
    fileformat.verify(path)  # intact, and checked without unpickling
    assert not ran


@pytest.mark.parametrize(
    "skeleton",
    [
        {"~": "tensor", "i": 5},
        {"~": "nope"},
        {"~": "dict", "k": ["a"], "v": []},
        {  # numpy takes a C int: a larger itemsize was an OverflowError, not a corrupt file
            "~": "npscalar",
            "dtype": {"names": ["a"], "formats": ["<f4"], "offsets": [0], "itemsize": 2**70},
            "v": "",
        },
    ],
    ids=["index", "tag", "dict", "numpy_itemsize"],
)
def test_verify_rebuilds_the_skeleton_as_a_load_would(tmp_path: Path, skeleton: Any) -> None:
    path = tmp_path / "part"
    path.write_bytes(skeleton_file(skeleton))
    for reader in ("read", "verify"):
        assert_corrupt(path, READERS[reader], "bad state skeleton")


# ------------------------------------------------------------------------ truncation, file kinds


@pytest.mark.parametrize("reader", ALL_READERS)
def test_truncation_at_every_region_boundary_is_refused(good_part: Path, reader: str) -> None:
    """Cut inside the length prefix, the header, at the data start and at and around every tensor's
    first and last byte: always CorruptCheckpointError, never a short tensor."""
    header = fileformat.read_header(good_part)
    content = good_part.read_bytes()
    marks = {0, 1, 7, 8, 9, header.data_start // 2, header.data_start, len(content)}
    for rec in header.records:
        marks |= {header.data_start + rec.begin, header.data_start + rec.end}
    cuts = sorted({m + d for m in marks for d in (-1, 0, 1)} & set(range(len(content))))
    assert len(cuts) > 15
    for cut in cuts:
        good_part.write_bytes(content[:cut])
        assert_corrupt(good_part, ALL_READERS[reader])


def call_with_deadline(fn: Callable[[], Any], unblock: Callable[[], None], seconds: float) -> Any:
    """``fn()`` on a thread; if it has not returned after ``seconds`` the test fails (after
    ``unblock()`` lets the thread finish)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join(5)
        pytest.fail(f"{fn} blocked for more than {seconds} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def release_fifo(path: Path) -> Callable[[], None]:
    """Open and close the FIFO's writing end, so that a reader blocked in open() goes on."""

    def release() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    return release


@pytest.mark.parametrize("reader", READERS)
def test_fifo_is_refused_without_blocking(tmp_path: Path, reader: str) -> None:
    """A FIFO where a part file is expected (a stray pipe, or an attacker's) must not block the
    reader forever waiting for a writer: that would hang find_latest on every rank."""
    path = tmp_path / "iter_0000001_0_local.safetensors"
    os.mkfifo(path)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        call_with_deadline(lambda: READERS[reader](path), release_fifo(path), 5)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", ["directory", "char_device"])
def test_what_is_not_a_regular_file_is_refused(tmp_path: Path, reader: str, kind: str) -> None:
    path = tmp_path / "part"
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    assert_corrupt(path, READERS[reader])


@pytest.mark.parametrize("reader", READERS)
def test_symlinks_are_followed_and_a_missing_file_stays_file_not_found(
    good_part: Path, reader: str
) -> None:
    """A symlink to a good part reads like the part; a dangling one (or a symlink loop) is an
    OSError: FileNotFoundError is how the manager tells a missing part from a corrupt one."""
    link = good_part.with_name("link")
    link.symlink_to(good_part.name)
    READERS[reader](link)
    dangling = good_part.with_name("dangling")
    dangling.symlink_to("nowhere")
    with pytest.raises(FileNotFoundError):
        READERS[reader](dangling)
    loop = good_part.with_name("loop")
    loop.symlink_to("loop")
    with pytest.raises(OSError):
        READERS[reader](loop)


def test_manager_find_latest_skips_a_fifo_named_like_a_part(tmp_path: Path) -> None:
    """find_latest validates every part-named entry of its directory: a FIFO there is skipped as an
    unusable part, not waited on, and the older complete checkpoint still loads."""
    manager = LocalCheckpointManager(str(tmp_path), session_id="job")
    state = {"w": torch.arange(6.0), "step": 1}
    manager.save(BasicTensorAwareStateDict(state), 1)
    fifo = manager.local_ckpt_dir / "iter_0000002_0_local.safetensors"
    os.mkfifo(fifo)
    fresh = LocalCheckpointManager(str(tmp_path), session_id="job")
    assert call_with_deadline(fresh.find_latest, release_fifo(fifo), 10) == 1
    ta, _ = fresh.load()
    assert torch.equal(ta.state_dict["w"], state["w"]) and ta.state_dict["step"] == 1


# --------------------------------------------------------------- the writer refuses what cannot be read


def assert_nothing_written(tmp_path: Path, path: Path, old: dict[str, Any]) -> None:
    assert sorted(os.listdir(tmp_path)) == [path.name]
    out = fileformat.read(path)
    assert torch.equal(out["w"], old["w"])


def test_tensor_with_more_dims_than_readers_accept_is_refused_on_save(tmp_path: Path) -> None:
    """A save that succeeds must be loadable: a tensor the reader would call corrupt (more than
    MAX_DIMS dimensions) is refused when saving, naming it, and the previous file stays."""
    path, old = tmp_path / "part", {"w": torch.ones(2)}
    fileformat.write(path, old)
    deep = torch.zeros([1] * (fileformat.MAX_DIMS + 1))
    with pytest.raises(UnsupportedStateError) as info:
        fileformat.write(path, {"w": torch.zeros(2), "deep": deep})
    assert info.value.key_path == "deep"
    assert_nothing_written(tmp_path, path, old)
    fileformat.write(tmp_path / "max", {"t": torch.zeros([1] * fileformat.MAX_DIMS)})
    assert fileformat.read(tmp_path / "max")["t"].dim() == fileformat.MAX_DIMS


def test_header_larger_than_readers_accept_is_refused_on_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state whose skeleton would make a header over MAX_HEADER_BYTES (e.g. a long Python list) is
    refused when saving, not written as a file no reader accepts; one exactly at the limit loads."""
    path, old = tmp_path / "part", {"w": torch.ones(2)}
    fileformat.write(path, old)
    big = {"w": torch.zeros(2), "order": list(range(500))}
    size = fileformat.plan_part(tree.flatten(big)).header_size()
    monkeypatch.setattr(fileformat.header, "MAX_HEADER_BYTES", size - 1)  # writer and reader
    with pytest.raises(UnsupportedStateError, match="header"):
        fileformat.write(path, big)
    assert_nothing_written(tmp_path, path, old)
    monkeypatch.setattr(fileformat.header, "MAX_HEADER_BYTES", size)
    fileformat.write(path, big)
    assert fileformat.read(path)["order"] == big["order"]
    assert fileformat.read_header(path).data_start == 8 + size


def test_a_dtype_node_never_imports_torch_submodules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dtype node naming a lazily imported torch submodule ("_dynamo") must not make loading import
    it (seconds, and its import-time code): names are looked up, not fetched through torch's hook."""
    lazy: list[str] = []
    monkeypatch.setattr(torch, "__getattr__", lambda name: lazy.append(name), raising=False)
    path = tmp_path / "part"
    for name in ("_dynamo", "onnx", "no_such_submodule"):
        path.write_bytes(skeleton_file([{"~": "tensor", "i": 0}, {"~": "dtype", "v": name}]))
        assert_corrupt(path, fileformat.read, "unknown dtype")
    assert lazy == []
    path.write_bytes(skeleton_file({"~": "dtype", "v": "bfloat16"}))
    assert fileformat.read(path) is torch.bfloat16
