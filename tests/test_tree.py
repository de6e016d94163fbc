"""Tests for tierpoint.tree: flatten/unflatten round trips, tied tensors, unsupported objects and
hostile skeletons."""

from __future__ import annotations

import base64
import dataclasses
import fractions
import json
import math
import pickle
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tierpoint import tree
from tierpoint.errors import CheckpointingError, UnsupportedStateError

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

# ------------------------------------------------------------------------------------------ helpers


def json_trip(skeleton: Any) -> Any:
    """The skeleton as a file header stores it: strict JSON (no NaN), then parsed back."""
    return json.loads(json.dumps(skeleton, allow_nan=False))


def roundtrip(state: Any, *, allow_pickle: bool = False) -> Any:
    flat = tree.flatten(state, allow_pickle=allow_pickle)
    skeleton = json_trip(flat.skeleton)
    assert skeleton == flat.skeleton  # JSON stores the skeleton losslessly
    return tree.unflatten(skeleton, list(flat.tensors), allow_pickle=allow_pickle)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Exact equality: same types all the way down, nan == nan, -0.0 != 0.0, bitwise tensors."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert len(a) == len(b), path
        # key order is part of the state (and OrderedDict equality depends on it)
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{path}.<key>")
            assert_same(va, vb, f"{path}[{ka!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        ), path
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert tensor_bytes(a) == tensor_bytes(b), path
    elif isinstance(a, (np.ndarray, np.generic)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


# ------------------------------------------------------------------------------------ strategies

TORCH_DTYPES = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
TENSOR_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64,
                 torch.uint8, torch.bool, torch.complex64]  # fmt: skip
NP_DTYPES = ["<f4", "<f8", "<f2", "<i8", "<u2", "|u1", "|b1", "<c16", ">i4", ">f8", "<U3", "|S4",
             "<M8[s]"]  # fmt: skip


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def numpy_arrays() -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(NP_DTYPES).flatmap(
        lambda dt: hnp.arrays(
            np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)
        )
    )


def numpy_scalars() -> st.SearchStrategy[np.generic]:
    return st.sampled_from(NP_DTYPES + ["<U5"]).flatmap(lambda dt: hnp.from_dtype(np.dtype(dt)))


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**200), 2**200),
    st.sampled_from([2**53 - 1, 2**53, -(2**53), 2**64 + 1, -(2**64) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0]),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(TORCH_DTYPES),
    st.lists(st.integers(0, 2**40), max_size=3).map(torch.Size),
    st.sampled_from(["cpu", "cuda:1", "meta", "cuda"]).map(torch.device),
    numpy_scalars(),
    numpy_arrays(),
    tensors(),
)
keys = st.one_of(
    st.text(max_size=5),
    st.integers(),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(-3, 3), st.text(max_size=2)),
    st.binary(max_size=3),
)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.dictionaries(keys, children, max_size=4).map(OrderedDict),
    )


states = st.recursive(leaves, containers, max_leaves=20)

# -------------------------------------------------------------------------------- round trips


@settings(max_examples=100, deadline=None)
@given(states)
def test_roundtrip_is_exact(state: Any) -> None:
    assert_same(roundtrip(state), state)


@pytest.mark.parametrize(
    "state",
    [
        {
            1: "int",
            "1": "str",
            (1, "a"): "tuple",
            False: "bool",
            None: "none",
            b"k": "bytes",
            2.5: "float",
        },
        OrderedDict([("b", 1), ("a", (1, [2, (3,)]))]),
        {"list": [1, 2], "tuple": (1, 2), "empty_list": [], "empty_tuple": (), "empty": {}},
        [0, 1, True, False, 1.0, -0.0, math.nan, math.inf, -math.inf, 2**53, -(2**100), 2**64],
        {"dtype": torch.bfloat16, "size": torch.Size([2, 0, 3]), "device": torch.device("cuda", 3)},
        {"np": [np.float32(1.5), np.int64(-3), np.bool_(True), np.str_("abc"), np.bytes_(b"ab")]},
        {"arrays": [np.array(2.5), np.zeros((2, 0)), np.array(["a", "bcd"], dtype="<U3")]},
        {
            "arrays": [
                np.arange(4, dtype=">i4"),
                np.arange(6.0).reshape(2, 3).T,
                np.arange(3, dtype="<u8"),
            ]
        },
        {
            "records": np.array([(1, 0.5), (2, 1.5)], dtype=[("id", "<i4"), ("w", ">f8")]),
            "aligned": np.ones(2, dtype=np.dtype([("a", "u1"), ("b", "<f4", (2,))], align=True)),
            "nested": np.zeros(1, dtype=[("p", [("x", "<f2"), ("tag", "<U2")])])[0],
            "when": np.array(["2026-11-27"], dtype="<M8[D]"),
        },
        torch.arange(6.0).reshape(2, 3).t(),
    ],
    ids=[
        "dict_keys",
        "odict",
        "sequences",
        "numbers",
        "torch_meta",
        "np_scalars",
        "np_arrays",
        "np_layout",
        "np_structured",
        "root_tensor",
    ],
)
def test_roundtrip_examples(state: Any) -> None:
    assert_same(roundtrip(state), state)


def test_big_ints_and_special_floats_are_tagged_not_lossy() -> None:
    skeleton = tree.flatten([2**53 - 1, 2**53, math.nan, -0.0]).skeleton
    assert skeleton[0] == 2**53 - 1
    assert skeleton[1] == {"~": "int", "v": str(2**53)}
    assert skeleton[2] == {"~": "float", "v": "nan"}
    assert json.dumps(skeleton[3]) == "-0.0"


def test_numeric_numpy_arrays_travel_as_tensors() -> None:
    arr, text = np.arange(5, dtype=np.int16), np.array(["ab"], dtype="<U2")
    flat = tree.flatten({"a": arr, "t": text})
    assert len(flat.tensors) == 1 and flat.numpy_indices == {0}
    assert flat.paths == ["a"]
    assert flat.skeleton["v"][1]["~"] == "ndbytes"


def test_tied_tensors_stored_once_and_restored_as_one_object() -> None:
    shared, other = torch.randn(3), torch.randn(3)
    state = {"embed": shared, "head": {"weight": shared}, "other": other, "again": [shared]}
    flat = tree.flatten(state)
    assert len(flat.tensors) == 2
    assert flat.paths == ["embed", "other"]
    out = roundtrip(state)
    assert out["embed"] is out["head"]["weight"] is out["again"][0]
    assert out["other"] is not out["embed"]
    assert tree.tensor_count(flat.skeleton) == 2


def test_skeletons_are_plain_json_data_that_later_flattens_never_change() -> None:
    """A save's skeleton travels to the worker by pickle and into headers as JSON; skeletons of
    later saves (which share nodes with it) must leave it as it was."""
    first = tree.flatten({"w": [torch.zeros(2), torch.ones(3)], "step": 1})
    kept = json.dumps(first.skeleton)
    tree.flatten({"w": [torch.ones(2)], "x": {"y": torch.zeros(1)}, "step": 2})
    assert json.dumps(first.skeleton) == kept
    copied = pickle.loads(pickle.dumps(first.skeleton))
    assert copied == first.skeleton and json.dumps(copied) == kept
    copied["v"][0][0]["i"] = 5  # a copy is the caller's to change
    with pytest.raises(TypeError):
        first.skeleton["v"][0][0]["i"] = 5  # a shared node is not
    assert tree.flatten({"w": [torch.zeros(2)]}).skeleton["v"][0][0] == {"~": "tensor", "i": 0}


def test_tensor_paths_name_key_paths() -> None:
    state = {"model": {"layers": [{"w": torch.ones(1)}]}, 3: torch.ones(1), "t": (torch.ones(1),)}
    assert tree.flatten(state).paths == ["model.layers[0].w", "[3]", "t[0]"]


def test_nesting_within_limit_round_trips() -> None:
    state: Any = "leaf"
    for _ in range(tree.MAX_DEPTH):
        state = [state]
    assert roundtrip(state) == state


# ------------------------------------------------------------------------- unsupported objects


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and other.x == self.x


@dataclasses.dataclass
class Config:
    lr: float
    betas: tuple


class Label(str):
    pass


def nest_deep(depth: int) -> Any:
    state: Any = 0
    for _ in range(depth):
        state = [state]
    return state


UNSUPPORTED = {
    "lambda": lambda x: x,
    "set": {1, 2},
    "frozenset": frozenset({"a"}),
    "custom_class": Custom(3),
    "dataclass": Config(0.1, (0.9, 0.99)),
    "fraction": fractions.Fraction(1, 3),
    "str_subclass": Label("x"),
    "object_ndarray": np.array([1, "a"], dtype=object),
    "sparse_tensor": torch.eye(2).to_sparse(),
    "nested_tensor": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
}


@pytest.mark.parametrize("obj", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_object_names_its_key_path(obj: Any) -> None:
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"param_groups": [{"lr": 0.1, "fn": obj}]}}
    with pytest.raises(UnsupportedStateError) as info:
        tree.flatten(state)
    assert info.value.key_path == "optimizer.param_groups[0].fn"
    assert str(info.value).startswith("optimizer.param_groups[0].fn: ")
    assert isinstance(info.value, CheckpointingError)


@pytest.mark.parametrize(
    ("state", "key_path"),
    [
        ({1, 2}, ""),
        ([0, {"a": (1, {7: {3}})}], "[1].a[1][7]"),
        (OrderedDict(s={"x": Custom(1)}), "s.x"),
        ({(1, 2): Custom(1)}, "[(1, 2)]"),
        ({"deep": nest_deep(tree.MAX_DEPTH + 5)}, "deep" + "[0]" * tree.MAX_DEPTH),
    ],
    ids=["root", "nested", "odict", "tuple_key", "too_deep"],
)
def test_unsupported_key_paths(state: Any, key_path: str) -> None:
    with pytest.raises(UnsupportedStateError) as info:
        tree.flatten(state)
    assert info.value.key_path == key_path


def test_unsupported_root_message_says_root() -> None:
    with pytest.raises(UnsupportedStateError, match=r"^<root>: .*allow_pickle=True"):
        tree.flatten(Custom(1))


PICKLABLE = [
    name for name in UNSUPPORTED if name not in ("lambda", "sparse_tensor", "nested_tensor")
]


@pytest.mark.parametrize("name", PICKLABLE)
def test_allow_pickle_round_trips_unsupported(name: str) -> None:
    obj = UNSUPPORTED[name]
    state = {"optimizer": {"param_groups": [{"lr": 0.1, "fn": obj}]}, "w": torch.ones(2)}
    out = roundtrip(state, allow_pickle=True)
    restored = out["optimizer"]["param_groups"][0]["fn"]
    assert type(restored) is type(obj)
    if isinstance(obj, np.ndarray):
        assert restored.tolist() == obj.tolist()
    else:
        assert restored == obj
    assert torch.equal(out["w"], state["w"])


def test_allow_pickle_cannot_pickle_lambda_names_path() -> None:
    with pytest.raises(UnsupportedStateError, match="cannot pickle") as info:
        tree.flatten({"sched": [None, lambda: 0]}, allow_pickle=True)
    assert info.value.key_path == "sched[1]"


def test_pickle_node_refused_without_allow_pickle() -> None:
    flat = tree.flatten({"s": {1, 2}}, allow_pickle=True)
    skeleton = json_trip(flat.skeleton)
    with pytest.raises(UnsupportedStateError, match="allow_pickle=True"):
        tree.unflatten(skeleton, [])
    assert tree.unflatten(skeleton, [], allow_pickle=True) == {"s": {1, 2}}


# ---------------------------------------------------------------------------- hostile skeletons


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def deep(levels: int, wrap: Any) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = wrap(node)
    return node


ONE_TENSOR = [torch.zeros(2)]
STRUCT = {"names": ["a"], "formats": ["<i4"], "offsets": [0], "itemsize": 4}
TAGS = ["int", "float", "tuple", "dict", "odict", "bytes", "tensor", "dtype", "size", "device",
        "ndarray", "ndbytes", "npscalar", "pickle", "nope"]  # fmt: skip
HOSTILE = {
    "unknown_tag": {"~": "evil", "v": 1},
    "no_tag": {"a": 1},
    "tag_unhashable": {"~": [1], "v": 1},
    "tensor_index_high": {"~": "tensor", "i": 1},
    "tensor_index_negative": {"~": "tensor", "i": -1},
    "tensor_index_bool": {"~": "tensor", "i": True},
    "tensor_index_str": {"~": "tensor", "i": "0"},
    "tensor_index_float": {"~": "tensor", "i": 0.0},
    "tensor_index_missing": {"~": "tensor"},
    "ndarray_index_high": {"~": "ndarray", "i": 5},
    "ndarray_of_bfloat16": {"~": "ndarray", "i": 1},
    "deep_lists": deep(100_000, lambda n: [n]),
    "deep_tuples": deep(100_000, lambda n: {"~": "tuple", "v": [n]}),
    "deep_dicts": deep(100_000, lambda n: {"~": "dict", "k": ["a"], "v": [n]}),
    "tuple_v_not_list": {"~": "tuple", "v": 5},
    "dict_k_not_list": {"~": "dict", "k": "ab", "v": [1, 2]},
    "dict_lengths_differ": {"~": "odict", "k": ["a", "b"], "v": [1]},
    "dict_key_unhashable": {"~": "dict", "k": [[1]], "v": [1]},
    "dict_missing_v": {"~": "dict", "k": []},
    "bytes_v_int": {"~": "bytes", "v": 5},
    "bytes_bad_base64": {"~": "bytes", "v": "!!!"},
    "int_v_int": {"~": "int", "v": 5},
    "int_not_digits": {"~": "int", "v": "12x"},
    "int_too_long": {"~": "int", "v": "9" * 20_000},
    "float_v_number": {"~": "float", "v": "1.5"},
    "float_v_list": {"~": "float", "v": ["nan"]},
    "dtype_unknown": {"~": "dtype", "v": "Tensor"},
    "dtype_v_dict": {"~": "dtype", "v": {"a": 1}},
    "size_v_str": {"~": "size", "v": "12"},
    "size_v_floats": {"~": "size", "v": [1.5]},
    "device_bad": {"~": "device", "v": "nonsense:0"},
    "device_v_int": {"~": "device", "v": 5},
    "ndbytes_bad_dtype": {"~": "ndbytes", "dtype": "zz", "shape": [1], "v": ""},
    "ndbytes_long_dtype": {"~": "ndbytes", "dtype": "<f4" * 20, "shape": [1], "v": ""},
    "ndbytes_object_dtype": {"~": "ndbytes", "dtype": "|O", "shape": [1], "v": b64(bytes(8))},
    "ndbytes_negative_shape": {"~": "ndbytes", "dtype": "<i4", "shape": [-1], "v": ""},
    "ndbytes_shape_mismatch": {"~": "ndbytes", "dtype": "<i4", "shape": [3], "v": b64(bytes(8))},
    "ndbytes_absurd_shape": {"~": "ndbytes", "dtype": "<i4", "shape": [2**62, 2**62, 0], "v": ""},
    "ndbytes_zero_itemsize": {"~": "ndbytes", "dtype": "<U0", "shape": [1], "v": ""},
    "npscalar_wrong_size": {"~": "npscalar", "dtype": "<f8", "v": b64(bytes(4))},
    "npscalar_dtype_int": {"~": "npscalar", "dtype": 4, "v": ""},
    "struct_object_field": {"~": "npscalar", "dtype": STRUCT | {"formats": ["|O"]}, "v": ""},
    "struct_lengths_differ": {"~": "npscalar", "dtype": STRUCT | {"offsets": [0, 4]}, "v": ""},
    "struct_name_int": {"~": "npscalar", "dtype": STRUCT | {"names": [1]}, "v": b64(bytes(4))},
    "struct_overflowing": {"~": "npscalar", "dtype": STRUCT | {"offsets": [8]}, "v": ""},
    "struct_deep": {"~": "npscalar", "dtype": deep(50, lambda n: STRUCT | {"formats": [n]})},
    "struct_many_fields": {
        "~": "npscalar",
        "dtype": {"names": ["a"] * 2000, "formats": ["u1"] * 2000, "offsets": [0] * 2000},
    },
    "subarray_absurd": {"~": "npscalar", "dtype": {"base": "<f8", "shape": [2**40]}, "v": ""},
    "struct_itemsize_beyond_c_int": {"~": "npscalar", "dtype": STRUCT | {"itemsize": 2**70}},
    "struct_offset_beyond_c_int": {"~": "ndbytes", "dtype": STRUCT | {"offsets": [2**70]}},
    "struct_itemsize_bool": {"~": "npscalar", "dtype": STRUCT | {"itemsize": True}, "v": ""},
    "subarray_no_shape": {"~": "npscalar", "dtype": {"base": "<f8"}, "v": ""},
    "not_json_type": {1, 2},
    "not_json_bytes": b"abc",
}
HOSTILE_TENSORS = {"ndarray_of_bfloat16": [torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)]}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_skeleton_raises_skeleton_error(name: str) -> None:
    with pytest.raises(tree.SkeletonError):
        tree.unflatten(HOSTILE[name], HOSTILE_TENSORS.get(name, ONE_TENSOR))
    with pytest.raises(tree.SkeletonError):  # the same node buried inside a valid state
        tree.unflatten({"~": "dict", "k": ["ok", "bad"], "v": [1, [HOSTILE[name]]]}, ONE_TENSOR)


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.dictionaries(
                st.sampled_from(["~", "v", "k", "i", "dtype", "shape"]), kids, max_size=4
            ),
            st.fixed_dictionaries(
                {"~": st.sampled_from(TAGS)},
                optional={"v": kids, "k": kids, "i": kids, "dtype": kids, "shape": kids},
            ),
        ),
        max_leaves=12,
    )
)
def test_random_skeletons_raise_only_skeleton_error(skeleton: Any) -> None:
    try:
        tree.unflatten(skeleton, ONE_TENSOR)
    except tree.SkeletonError:
        pass
    except UnsupportedStateError as e:  # a pickle node, refused without allow_pickle
        assert "allow_pickle" in str(e)


def test_pickle_payload_not_loaded_without_allow_pickle() -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (pytest.fail, ("pickle payload was executed",))

    node = {"~": "pickle", "v": b64(pickle.dumps(Boom()))}
    with pytest.raises(UnsupportedStateError):
        tree.unflatten({"~": "tuple", "v": [node]}, [])


@pytest.mark.parametrize("flag", ["no", "false", 1, None])
def test_allow_pickle_must_be_a_bool_not_a_truthy_value(flag: Any) -> None:
    """``allow_pickle="no"`` once turned pickle on: the opt-in must be the literal True."""
    with pytest.raises(CheckpointingError, match="allow_pickle must be True or False"):
        tree.flatten({"a": 1}, allow_pickle=flag)
    skeleton = tree.flatten({"a": {1, 2}}, allow_pickle=True).skeleton
    with pytest.raises(CheckpointingError, match="allow_pickle must be True or False"):
        tree.unflatten(skeleton, [], allow_pickle=flag)
