"""Tests for tierpoint.fileformat: bitwise round trips of every dtype and layout, safetensors
compatibility, targets, recycling, file hygiene, and a corpus of damaged or hostile part files."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import struct
import tempfile
import tracemalloc
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from tierpoint import fileformat, tree
from tierpoint.errors import CheckpointingError, CorruptCheckpointError, UnsupportedStateError

from ..conftest import good_state

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

DTYPES = fileformat.DTYPES
ALL_DTYPES = sorted(DTYPES)
# The dtypes safetensors stores natively; every other dtype must appear there as U8 bytes.
SAFETENSORS_NATIVE = {"bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                      "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}  # fmt: skip
LAYOUTS = ("contiguous", "transposed", "strided")
SHAPES = [(), (0,), (3, 0, 2), (1,), (5,), (2, 1), (3, 4), (2, 3, 5)]  # (1,) strided: odd stride


def torch_can_copy(dtype: torch.dtype) -> bool:
    """False for torch's shell dtypes (uint1..7, int1..7): torch cannot make them contiguous."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
            torch.empty(2, 2, dtype=dtype).t().contiguous()
    except (NotImplementedError, RuntimeError):
        return False
    return True


COPYABLE = {name for name in ALL_DTYPES if torch_can_copy(DTYPES[name])}


def layouts_for(name: str) -> tuple[str, ...]:
    return LAYOUTS if name in COPYABLE else ("contiguous",)


# ------------------------------------------------------------------------------------------ helpers


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def random_tensor(dtype: torch.dtype, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Random bytes of any dtype (so nan payloads, subnormals and odd bit patterns all occur)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (math.prod(shape) * itemsize(dtype),), dtype=torch.uint8, generator=gen
    )
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(tuple(shape))


def make_tensor(dtype: torch.dtype, shape: Sequence[int], layout: str, seed: int) -> torch.Tensor:
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        dims = tuple(reversed(range(len(shape))))
        return random_tensor(dtype, shape[::-1], seed).permute(dims)
    if layout == "strided" and shape:
        return random_tensor(dtype, (*shape[:-1], 2 * shape[-1]), seed)[..., ::2]
    return random_tensor(dtype, shape, seed)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in C order (a contiguous tensor may keep odd strides on size-0/1 dims)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().contiguous().as_strided((t.numel(),), (1,)).view(torch.uint8)


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, torch.device("cpu"))
    assert torch.equal(raw_bytes(got), raw_bytes(want))


def assert_states_equal(got: Any, want: Any) -> None:
    """Same structure and types (the skeletons encode both exactly) and bitwise-equal tensors."""
    got_flat, want_flat = tree.flatten(got), tree.flatten(want)
    assert got_flat.skeleton == want_flat.skeleton
    assert len(got_flat.tensors) == len(want_flat.tensors)
    for g, w in zip(got_flat.tensors, want_flat.tensors, strict=True):
        assert_identical(g, w)


def named_tensors(path: Path, state: Any) -> dict[str, torch.Tensor]:
    """The state's tensors by the names the file gave them (records are in skeleton order)."""
    records = fileformat.read_header(path).records
    return {r.name: t for r, t in zip(records, tree.flatten(state).tensors, strict=True)}


def assert_safetensors_reads(path: Path, state: Any) -> None:
    expected = named_tensors(path, state)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "tierpoint"
        assert sorted(f.keys()) == sorted(expected)
        for name, want in expected.items():
            got = f.get_tensor(name)
            if str(want.dtype).removeprefix("torch.") in SAFETENSORS_NATIVE:
                assert_identical(got, want)
            else:
                assert got.dtype == torch.uint8 and got.shape == (
                    want.numel() * want.element_size(),
                )
                assert torch.equal(got, raw_bytes(want))


def assert_layout_invariants(path: Path, state: Any, nbytes: int) -> None:
    """Exact file size, data section aligned, every tensor aligned to its element size."""
    header = fileformat.read_header(path)
    data = sum(t.numel() * t.element_size() for t in tree.flatten(state).tensors)
    assert path.stat().st_size == nbytes == header.data_start + data
    assert header.data_start % fileformat.DATA_ALIGNMENT == 0
    for record in header.records:
        assert record.begin % itemsize(record.dtype) == 0


def write_and_check(path: Path, state: Any, **kwargs: Any) -> Any:
    result = fileformat.write(path, state, **kwargs)
    out = fileformat.read(path)
    assert_states_equal(out, state)
    header, mapped = fileformat.read_flat(path, mmap=True)
    assert_states_equal(fileformat.unflatten_checked(header, mapped), state)
    for t in mapped:  # each mapped tensor owns exactly its bytes (torch.save writes only those)
        assert t.storage_offset() == 0
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    fileformat.verify(path)
    assert_layout_invariants(path, state, result.nbytes)
    assert_safetensors_reads(path, state)
    return out


# ---------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_round_trips_bitwise(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name]
    state = {
        f"{layout}{i}": make_tensor(dtype, shape, layout, seed=i)
        for i, shape in enumerate(SHAPES)
        for layout in layouts_for(name)
    }
    out = write_and_check(tmp_path / "part", state)
    assert list(out) == list(state)
    assert all(t.is_contiguous() for t in out.values())


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    layout = draw(st.sampled_from(layouts_for(name)))
    return make_tensor(DTYPES[name], shape, layout, draw(st.integers(0, 2**31)))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ts=st.lists(tensors(), max_size=6), tie=st.booleans(), step=st.integers())
def test_write_read_round_trip_property(
    tmp_path: Path, ts: list[torch.Tensor], tie: bool, step: int
) -> None:
    state = {"tensors": ts, "tied": ts[:1] if tie else [], "step": step}
    out = write_and_check(tmp_path / "part", state, extra={"step": step})
    if tie and ts:
        assert out["tied"][0] is out["tensors"][0]
    assert fileformat.read_header(tmp_path / "part").extra == {"step": step}


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(tensors(), min_size=1, max_size=5),
    change=st.sampled_from(["none", "paths", "shape", "dtype", "count"]),
    step=st.integers(),
)
def test_a_plan_like_an_earlier_one_is_the_plan_made_afresh(
    first: list[torch.Tensor], change: str, step: int
) -> None:
    """``plan_part(flat, extra, like=earlier)`` (a saver's next save) equals a fresh plan to the
    header byte, whatever changed in between; the layout is reused only where nothing did."""
    second = list(first)  # plans read no tensor data
    if change == "shape":
        second[0] = torch.empty(first[0].numel() + 1, dtype=first[0].dtype)
    elif change == "dtype":
        other = torch.int8 if first[0].dtype != torch.int8 else torch.float32
        second[0] = torch.empty(first[0].shape, dtype=other)
    elif change == "count":
        second.append(torch.ones(3))
    earlier = fileformat.plan_part(tree.flatten({"t": first, "step": 0}), {"iteration": 1})
    earlier.header_size()  # its layout's JSON made
    key = "u" if change == "paths" else "t"
    flat = tree.flatten({key: second, "step": step, "lr": 1e-3 * step})
    reused = fileformat.plan_part(flat, {"iteration": step}, like=earlier)
    fresh = fileformat.plan_part(flat, {"iteration": step})
    assert reused == fresh
    sums = [f"{i:016x}" for i in range(len(fresh.names))]
    assert reused.header(sums) == fresh.header(sums)
    assert reused.header_size() == fresh.header_size() == len(fresh.header(sums))
    assert (reused.offsets is earlier.offsets) == (change == "none")
    received = pickle.loads(pickle.dumps(reused))  # as a worker process gets it
    assert received == fresh and received.header(sums) == fresh.header(sums)


def test_mixed_training_state_round_trips(tmp_path: Path) -> None:
    w = torch.randn(4, 3)
    state = {
        "model": OrderedDict(w=w, b=torch.zeros(3, dtype=torch.bfloat16), tied=w),
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "eps": -0.0}],
        },
        "numpy_rng": np.random.default_rng(0).bit_generator.state,
        "legacy_rng": np.random.RandomState(0).get_state(),
        "torch_rng": torch.get_rng_state(),
        "numbers": [2**70, -(2**64), math.nan, math.inf, np.float32(0.5), np.arange(3)],
        "meta": {
            "dtype": torch.float16,
            "shape": torch.Size([2, 3]),
            "device": torch.device("cpu"),
        },
    }
    out = write_and_check(tmp_path / "part", state)
    assert out["model"]["w"] is out["model"]["tied"]
    assert isinstance(out["numbers"][5], np.ndarray)


@pytest.mark.parametrize(
    "paths",
    [["a.b~2", "a.b", "a.b"], ["", "tensor0"], ["__metadata__"], ["x", "x", "x~1"]],
    ids=["suffix_taken", "root_tensor", "metadata_name", "three_way"],
)
def test_tensor_names_are_unique(tmp_path: Path, paths: list[str]) -> None:
    tensors_ = [torch.full((2,), float(i)) for i in range(len(paths))]
    flat = tree.FlatState(
        skeleton=[{"~": "tensor", "i": i} for i in range(len(paths))], tensors=tensors_, paths=paths
    )
    path = tmp_path / "part"
    fileformat.write_flat(path, flat)
    header, got = fileformat.read_flat(path)
    assert len({r.name for r in header.records}) == len(paths)
    assert "__metadata__" not in {r.name for r in header.records}
    for g, w in zip(got, tensors_, strict=True):
        assert_identical(g, w)
    assert_safetensors_reads(path, tensors_)


def test_colliding_key_paths_from_a_real_state(tmp_path: Path) -> None:
    state = {"a.b~2": torch.zeros(2), "a": {"b": torch.ones(2)}, "a.b": torch.full((2,), 2.0)}
    write_and_check(tmp_path / "part", state)


def test_pickled_objects_need_allow_pickle_on_load(tmp_path: Path) -> None:
    path = tmp_path / "part"
    state = {"w": torch.ones(2), "milestones": {10, 20}}
    with pytest.raises(UnsupportedStateError) as info:
        fileformat.write(path, state)
    assert info.value.key_path == "milestones"
    fileformat.write(path, state, allow_pickle=True)
    with pytest.raises(UnsupportedStateError, match="allow_pickle"):
        fileformat.read(path)
    out = fileformat.read(path, allow_pickle=True)
    assert out["milestones"] == {10, 20} and torch.equal(out["w"], state["w"])


# ------------------------------------------------------------------------------ reading targets


def target_state() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 4),
        "b": torch.arange(6, dtype=torch.float64).reshape(2, 3),
        "c": torch.arange(5, dtype=torch.int32),
        "d": torch.randn(2, 2, dtype=torch.complex64),
        "e": torch.tensor([5.0]),
    }


def test_read_fills_targets_in_place(tmp_path: Path) -> None:
    path, state = tmp_path / "part", target_state()
    fileformat.write(path, state)
    contiguous = torch.empty(3, 4)
    strided = torch.empty(3, 2, dtype=torch.float64).t()
    needs_grad = torch.zeros(2, 2, dtype=torch.complex64, requires_grad=True)
    odd_stride = torch.empty(2)[::2]  # contiguous by torch's rules, yet its stride is 2
    assert not strided.is_contiguous() and odd_stride.is_contiguous()
    storage = contiguous.data_ptr(), strided.data_ptr(), odd_stride.data_ptr()
    out = fileformat.read(path, targets=[contiguous, strided, None, needs_grad, odd_stride])
    assert out["a"] is contiguous and out["b"] is strided and out["d"] is needs_grad
    assert out["e"] is odd_stride
    assert (contiguous.data_ptr(), strided.data_ptr(), odd_stride.data_ptr()) == storage
    assert_states_equal({k: v.detach() for k, v in out.items()}, state)
    assert needs_grad.requires_grad


@pytest.mark.parametrize(
    "targets",
    [
        [torch.empty(4, 3), None, None, None, None],
        [torch.empty(3, 4, dtype=torch.float64), None, None, None, None],
        [None, None, None, None],
    ],
    ids=["wrong_shape", "wrong_dtype", "wrong_count"],
)
def test_mismatched_targets_are_refused(tmp_path: Path, targets: list[torch.Tensor | None]) -> None:
    path = tmp_path / "part"
    fileformat.write(path, target_state())
    with pytest.raises(CheckpointingError, match=re.escape(str(path))):
        fileformat.read(path, targets=targets)


# --------------------------------------------------------------------------- recycling, hygiene


@pytest.mark.parametrize("old_numel", [1 << 18, 4], ids=["bigger", "smaller"])
def test_write_recycles_an_expired_file(tmp_path: Path, old_numel: int) -> None:
    old, new = tmp_path / "old.part", tmp_path / "new.part"
    fileformat.write(old, {"x": torch.randn(old_numel)})
    inode = old.stat().st_ino
    state = {"w": torch.randn(100, 3), "i": torch.arange(7), "s": "text"}
    write_and_check(new, state, recycle=old)
    assert not old.exists()
    assert new.stat().st_ino == inode
    assert sorted(os.listdir(tmp_path)) == ["new.part"]


def test_a_mapped_file_is_never_recycled(tmp_path: Path) -> None:
    old = tmp_path / "old"
    fileformat.write(old, {"x": torch.arange(1000.0)})
    _, (mapped,) = fileformat.read_flat(old, mmap=True)
    assert fileformat.is_mapped(old)
    fileformat.write(tmp_path / "new", {"x": torch.zeros(1000)}, recycle=old)
    assert torch.equal(mapped, torch.arange(1000.0))  # the mapped pages were not rewritten
    mapped.add_(1)  # copy-on-write: the file itself is unchanged
    assert torch.equal(fileformat.read(old)["x"], torch.arange(1000.0))
    del mapped  # once its tensors are gone, the file may be recycled again
    assert not fileformat.is_mapped(old)
    fileformat.write(tmp_path / "newer", {"x": torch.zeros(1000)}, recycle=old)
    assert not old.exists()


def test_recycle_path_that_does_not_exist_is_ignored(tmp_path: Path) -> None:
    write_and_check(tmp_path / "part", {"w": torch.ones(3)}, recycle=tmp_path / "missing")


@pytest.mark.parametrize("dirty", [None, "custom.tmp"])
def test_write_leaves_only_the_final_file_private(tmp_path: Path, dirty: str | None) -> None:
    path = tmp_path / "part"
    dirty_path = tmp_path / dirty if dirty else None
    fileformat.write(path, {"w": torch.ones(3)}, dirty_path=dirty_path, fsync=dirty is None)
    assert sorted(os.listdir(tmp_path)) == ["part"]
    assert path.stat().st_mode & 0o777 == 0o600


def boom(*_: Any) -> None:
    raise OSError("disk on fire")


def test_failed_write_keeps_the_previous_file_and_leaves_no_dirty_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "part"
    old = {"w": torch.ones(3)}
    fileformat.write(path, old)
    with pytest.raises(UnsupportedStateError):
        fileformat.write(path, {"w": torch.zeros(3), "fn": lambda: 0})
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk on fire"):
        fileformat.write(path, {"w": torch.zeros(3)})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["part"]
    assert_states_equal(fileformat.read(path), old)


# ------------------------------------------------------------------------ damaged/hostile files

CHECKSUM_KEY = fileformat.CHECKSUM_KEY


def sum_field(value: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{value}"'.encode()


def split_part(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def frame(header: bytes, data: bytes = b"") -> bytes:
    """A part file around ``header``: length prefix, space padding to DATA_ALIGNMENT, data."""
    padded = header + b" " * ((-(8 + len(header))) % fileformat.DATA_ALIGNMENT)
    return struct.pack("<Q", len(padded)) + padded + data


def rewrite_header(
    path: Path,
    doc_edit: Callable[[dict[str, Any]], Any] | None = None,
    header_edit: Callable[[dict[str, Any]], Any] | None = None,
    text_edit: Callable[[bytes], bytes] | None = None,
) -> None:
    """Edit a valid part file's tierpoint document, header or header text, then recompute the
    header checksum as fileformat does (xxh3-64 of the padded header whose checksum is sixteen 0s)
    and the length prefix, so only the structural checks can catch the edit."""
    header, data = split_part(path)
    meta = header["__metadata__"]
    doc = json.loads(meta["tierpoint"])
    if doc_edit:
        doc_edit(doc)
    meta["tierpoint"] = json.dumps(doc)
    meta[CHECKSUM_KEY] = "0" * 16
    if header_edit:
        header_edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    if text_edit:
        text = text_edit(text)
    framed = frame(text, data)
    padded = framed[8 : len(framed) - len(data)]
    digest = xxhash.xxh3_64_hexdigest(padded)
    path.write_bytes(framed.replace(sum_field("0" * 16), sum_field(digest), 1))


def record(doc: dict[str, Any], name: str) -> list[Any]:
    return next(r for r in doc["tensors"] if r[0] == name)


def set_record(name: str, field: int, value: Any) -> Callable[[Path], None]:
    def edit(doc: dict[str, Any]) -> None:
        record(doc, name)[field] = value

    return lambda path: rewrite_header(path, doc_edit=edit)


def set_entry(name: str, key: str, value: Any) -> Callable[[Path], None]:
    return lambda path: rewrite_header(path, header_edit=lambda h: h[name].__setitem__(key, value))


def set_doc(key: str, value: Any) -> Callable[[Path], None]:
    return lambda path: rewrite_header(path, doc_edit=lambda d: d.__setitem__(key, value))


def set_meta(key: str, value: Any) -> Callable[[Path], None]:
    return lambda path: rewrite_header(
        path, header_edit=lambda h: h["__metadata__"].__setitem__(key, value)
    )


def shrink_b(path: Path) -> None:
    """Tensor b loses its last element but keeps its place, leaving a hole before the next one."""

    def edit(header: dict[str, Any]) -> None:
        begin, end = header["b"]["data_offsets"]
        header["b"].update(shape=[7], data_offsets=[begin, end - 8])

    rewrite_header(path, doc_edit=lambda d: record(d, "b").__setitem__(2, [7]), header_edit=edit)


def replace_file(content: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content)


def with_prefix(n: int) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(struct.pack("<Q", n) + path.read_bytes()[8:])


def patch_header_byte(path: Path) -> None:
    """Change one digit of a shape inside the header, leaving the checksum as it was."""
    raw = path.read_bytes()
    i = raw.index(b'"shape":[4,4]')
    path.write_bytes(raw[:i] + b'"shape":[4,5]' + raw[i + 13 :])


def flip_bit_in(name: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        header = fileformat.read_header(path)
        rec = next(r for r in header.records if r.name == name)
        raw = bytearray(path.read_bytes())
        raw[header.data_start + (rec.begin + rec.end) // 2] ^= 0x10
        path.write_bytes(bytes(raw))

    return damage


def plain_safetensors(path: Path) -> None:
    save_file({"w": torch.ones(4, 4)}, str(path), metadata={"format": "pt"})


def resize_by(delta: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        raw = path.read_bytes()
        path.write_bytes(raw[:delta] if delta < 0 else raw + b"\0" * delta)

    return damage


def verify_arriving(path: Path, step: int = 5) -> fileformat.PartHeader:
    """Check a file as peers do while it arrives: ``step`` bytes at a time."""
    data = memoryview(path.read_bytes())
    checker = fileformat.PartVerifier(path, data)
    for available in range(0, len(data), step):
        checker.advance(available)
    return checker.finish()


HEADER_READERS = ("read", "read_noverify", "read_mmap", "read_header", "verify", "stream")
READERS: dict[str, Callable[[Path], Any]] = {
    "stream": verify_arriving,
    "read": fileformat.read,
    "read_noverify": lambda p: fileformat.read(p, verify=False),
    "read_mmap": lambda p: fileformat.read_flat(p, mmap=True),
    "read_header": fileformat.read_header,
    "verify": fileformat.verify,
}


@dataclass(frozen=True)
class Damage:
    apply: Callable[[Path], None]
    reason: str
    readers: tuple[str, ...] = HEADER_READERS


def dup_key(text: bytes) -> bytes:
    return text.replace(b'{"__metadata__":', b'{"w":{},"__metadata__":', 1)


CORPUS: dict[str, Damage] = {
    "empty_file": Damage(replace_file(b""), "too short"),
    "four_bytes": Damage(replace_file(b"\x10\0\0\0"), "too short"),
    "header_longer_than_file": Damage(lambda p: with_prefix(p.stat().st_size)(p), "header claims"),
    "header_length_absurd": Damage(with_prefix(2**63), "exceeds the limit"),
    "header_not_json": Damage(replace_file(frame(b"\xff\xfe not json at all")), "not valid JSON"),
    "header_not_object": Damage(replace_file(frame(b"[1, 2, 3]")), "not a JSON object"),
    "header_nesting_bomb": Damage(replace_file(frame(b"[" * 200_000 + b"]" * 200_000)), "nested too deeply"),
    "no_metadata": Damage(lambda p: rewrite_header(p, header_edit=lambda h: h.pop("__metadata__")), "not a tierpoint part file"),
    "plain_safetensors": Damage(plain_safetensors, "not a tierpoint part file"),
    "checksum_mismatch": Damage(patch_header_byte, "header checksum mismatch"),
    "checksum_missing": Damage(lambda p: rewrite_header(p, header_edit=lambda h: h["__metadata__"].pop(CHECKSUM_KEY)), "checksum is missing"),
    "duplicate_json_key": Damage(lambda p: rewrite_header(p, text_edit=dup_key), "duplicate key 'w'"),
    "inner_not_json": Damage(set_meta("tierpoint", "{oops"), "tierpoint metadata is not valid JSON"),
    "inner_nesting_bomb": Damage(set_meta("tierpoint", "[" * 200_000 + "]" * 200_000), "nested too deeply"),
    "format_version": Damage(set_doc("version", 2), "unsupported format version 2"),
    "records_missing": Damage(set_doc("tensors", None), "tensor records are missing"),
    "record_count": Damage(lambda p: rewrite_header(p, doc_edit=lambda d: d["tensors"].pop()), "tensor records but"),
    "record_without_entry": Damage(set_record("w", 0, "nope"), "has no header entry"),
    "record_malformed": Damage(set_doc("tensors", [["w"], ["b"], ["z"], ["e"]]), "malformed tensor record"),
    "unknown_dtype": Damage(set_record("w", 1, "float128"), "unknown dtype 'float128'"),
    "dtype_disagrees": Damage(set_record("w", 1, "int32"), "disagrees with int32"),
    "shape_length_mismatch": Damage(set_record("w", 2, [4, 5]), "needs 80 bytes, entry has 64"),
    "absurd_shape": Damage(set_record("w", 2, [2**40, 2**40]), f"needs {2**80 * 4} bytes"),
    "zero_size_overflowing_shape": Damage(set_record("e", 2, [0, 2**63]), "invalid shape"),
    "zero_size_overflowing_product": Damage(set_record("e", 2, [2**62, 2**62, 0]), "invalid shape"),
    "negative_dim": Damage(set_record("w", 2, [-4, -4]), "invalid shape"),
    "too_many_dims": Damage(set_record("e", 2, [1] * 64 + [0]), "invalid shape"),
    "bad_checksum_field": Damage(set_record("w", 3, 12), "malformed checksum"),
    "offsets_past_end": Damage(set_entry("w", "data_offsets", [120, 184]), "lies outside the file"),
    "offsets_reversed": Damage(set_entry("w", "data_offsets", [152, 88]), "lies outside the file"),
    "offsets_not_ints": Damage(set_entry("w", "data_offsets", [88.0, 152]), "invalid data_offsets"),
    "offsets_overlap": Damage(set_entry("z", "data_offsets", [56, 80]), "overlaps another tensor"),
    "offsets_gap": Damage(shrink_b, "leaves a gap"),
    "extra_not_object": Damage(set_doc("extra", [1]), "extra metadata is not a JSON object"),
    "truncated_data": Damage(resize_by(-10), "lies outside the file"),
    "extended_file": Damage(resize_by(7), "7 unexpected bytes after the last tensor"),
    "skeleton_bad_index": Damage(set_doc("skeleton", {"~": "tensor", "i": 99}), "bad state skeleton", ("read", "read_noverify")),
    "skeleton_unknown_tag": Damage(set_doc("skeleton", [{"~": "evil"}]), "bad state skeleton", ("read", "read_noverify")),
    "flipped_data_bit": Damage(flip_bit_in("w"), "checksum mismatch in tensor 'w'", ("read", "read_mmap", "verify", "stream")),
}  # fmt: skip


def test_good_file_has_the_layout_the_corpus_assumes(good_part: Path) -> None:
    offsets = {r.name: (r.begin, r.end) for r in fileformat.verify(good_part).records}
    assert offsets == {"b": (0, 64), "w": (64, 128), "e": (128, 128), "z": (128, 152)}


def test_rewrite_helper_without_edits_keeps_the_file_valid(good_part: Path) -> None:
    rewrite_header(good_part, doc_edit=lambda d: d["extra"].update(note="edited"))
    assert fileformat.verify(good_part).extra == {"note": "edited"}
    assert_states_equal(fileformat.read(good_part), good_state())


CORPUS_CASES = [
    pytest.param(case, reader, id=f"{case}-{reader}")
    for case, d in CORPUS.items()
    for reader in d.readers
]


@pytest.mark.parametrize(("case", "reader"), CORPUS_CASES)
def test_damaged_file_raises_corrupt_checkpoint_error(
    good_part: Path, case: str, reader: str
) -> None:
    CORPUS[case].apply(good_part)
    with pytest.raises(CorruptCheckpointError) as info:
        READERS[reader](good_part)
    err = info.value
    assert err.path == str(good_part)
    assert str(err).startswith(f"corrupt checkpoint file {good_part}: ")
    assert CORPUS[case].reason in err.reason


@pytest.mark.parametrize("step", [1, 7, 64, 1 << 20])
def test_arriving_file_is_checked_piece_by_piece(good_part: Path, step: int) -> None:
    header = verify_arriving(good_part, step)
    assert header == fileformat.verify(good_part)
    CORPUS["flipped_data_bit"].apply(good_part)
    data = memoryview(good_part.read_bytes())
    checker = fileformat.PartVerifier(good_part, data)
    w_end = header.data_start + next(r.end for r in header.records if r.name == "w")
    checker.advance(w_end - 1)  # w is not complete yet: nothing to say
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor 'w'"):
        checker.advance(w_end)  # rejected as soon as w's last byte is there


def test_flipped_data_bit_passes_without_verify(good_part: Path) -> None:
    CORPUS["flipped_data_bit"].apply(good_part)
    fileformat.read_header(good_part)
    w = fileformat.read(good_part, verify=False)["w"]
    differs = (raw_bytes(w) != raw_bytes(good_state()["w"])).sum().item()
    assert differs == 1


def refuse_big_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    real_empty = torch.empty

    def guarded(*size: Any, **kwargs: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        assert math.prod(shape) <= 1024, f"tried to allocate a tensor of shape {shape}"
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", guarded)


@pytest.mark.parametrize("shape", [[2**40, 2**40], [2**17, 2**17], [2**62, 2**62, 0]])
def test_absurd_shape_is_refused_before_allocating(
    good_part: Path, monkeypatch: pytest.MonkeyPatch, shape: list[int]
) -> None:
    set_record("w", 2, shape)(good_part)
    refuse_big_allocations(monkeypatch)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="w"):
            fileformat.read(good_part)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# ------------------------------------------------------------------------------------ huge tensor


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(mem_available() < 8 << 30, reason="needs 8 GiB of free memory")
def test_huge_tensor_over_2GiB_round_trip_through_dev_shm() -> None:
    n = (1 << 31) + 4099  # past the 2 GiB and 1 GiB I/O chunk boundaries
    block = torch.randint(
        0, 256, (1_000_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    big = block.repeat(n // block.numel() + 1)[:n]
    marks = torch.tensor([0, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 1 << 31, n - 1])
    big[marks] = torch.arange(1, 7, dtype=torch.uint8) * 37
    state = {"big": big, "tail": torch.arange(-50, 50, dtype=torch.int8)}
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="tierpoint-test-")
    try:
        path = Path(directory) / "huge.part"
        result = fileformat.write(path, state)
        header = fileformat.verify(path)
        assert result.nbytes == path.stat().st_size == header.data_start + n + 100
        assert next(r for r in header.records if r.name == "tail").begin == n
        out = fileformat.read(path)
        assert out["big"].shape == (n,) and torch.equal(out["big"][marks], big[marks])
        assert torch.equal(out["big"], big)
        assert torch.equal(out["tail"], state["tail"])
    finally:
        shutil.rmtree(directory)


def test_tensors_of_whole_cache_lines_start_on_64_byte_boundaries() -> None:
    # Adam-like state: odd-sized scalars between the big tensors must not misalign them.
    state = {
        f"p{i}": {
            "w": torch.zeros(1000, 64),
            "step": torch.tensor(float(i)),
            "pos": torch.arange(3),
        }
        for i in range(5)
    }
    plan = fileformat.plan_part(tree.flatten(state))
    for (begin, end), dtype in zip(plan.offsets, plan.dtypes):
        size = end - begin
        assert begin % fileformat.DTYPES[dtype].itemsize == 0
        if size % 64 == 0:
            assert begin % 64 == 0, (begin, size, dtype)


def test_lazy_conjugate_and_negative_views_are_written_as_their_values(tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    state = {"conj": c.conj(), "neg": c.conj().imag}
    fileformat.write(tmp_path / "part", state)
    back = fileformat.read(tmp_path / "part")
    assert torch.equal(back["conj"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(back["neg"], torch.tensor([-2.0, 4.0]))


def test_a_write_whose_rename_fails_leaves_no_dirty_file(tmp_path):
    """Writing onto a directory's name failed at the rename and left ``<name>.dirty`` behind."""
    target = tmp_path / "a_directory"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        fileformat.write(target, {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_directory"]
