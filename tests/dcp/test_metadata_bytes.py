"""The bytes of ``.metadata``: from the second commit of a layout on, spliced from a template into
exactly what pickling would make (no pickling per save), and pickled as usual wherever a template
cannot stand for the save's strings."""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import uuid

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from tierpoint.dcp import metadata_bytes as mb
from tierpoint.dcp.file_plan import plan_files
from tierpoint.dcp.write_results import results_for


def _layout(fqn: str = "layers.0.w"):
    """A global metadata object and one rank's rows, as a commit gets them."""
    state = {fqn: torch.zeros(30, 20), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 12}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    files = plan_files(plans[0], "__0_", 2)
    byte_items = {i: 50 for i, it in enumerate(plans[0].items) if it.tensor_data is None}
    token = secrets.token_hex(6)
    rows = [list(results_for(plans[0], files.with_token(token), byte_items, token).rows)]
    return metadata, rows


def _meta(path: str) -> StorageMeta:
    return StorageMeta(checkpoint_id=path, save_id=uuid.uuid4().hex)


def _plain(metadata, rows, token, meta) -> bytes:
    return mb.pickled(metadata, mb.storage_data(rows, token), meta)


def test_each_commit_of_a_layout_has_the_bytes_pickling_makes_and_only_the_first_two_pickle(
    monkeypatch,
):
    metadata, rows = _layout()
    pickles = []
    real = mb.pickled
    monkeypatch.setattr(mb, "pickled", lambda *a: pickles.append(1) or real(*a))
    saves = [("/ckpt/step-8", "a1b2c3d4e5f6"), ("/ckpt/step-9", "0f0f0f0f0f0f")]
    saves += [("/ckpt/step-9", secrets.token_hex(6)) for _ in range(4)]
    for k, (path, token) in enumerate(saves):
        meta = _meta(path)
        data = mb.metadata_bytes(metadata, rows, token, meta)
        assert data == real(metadata, mb.storage_data(rows, token), meta), k
        loaded = pickle.loads(data)
        assert loaded.storage_meta == meta
        assert {info.relative_path for info in loaded.storage_data.values()} == {
            f"__0_{n}.{token}.distcp" for n in (0, 1)
        }
    # the first commit pickles (a layout committed once only costs no more), the second makes
    # the template (two pickles), the others splice it
    assert len(pickles) == 3

    # a longer step directory: its own template, from its second commit on
    pickles.clear()
    for token in (secrets.token_hex(6) for _ in range(3)):
        meta = _meta("/ckpt/step-10")
        data = mb.metadata_bytes(metadata, rows, token, meta)
        assert data == real(metadata, mb.storage_data(rows, token), meta)
    assert len(pickles) == 3


def test_a_placeholder_found_elsewhere_in_the_pickle_means_no_template(monkeypatch):
    # the token's placeholder, in both pickles that make a template, also spells a tensor's name:
    # splicing would rename the tensor
    metadata, rows = _layout(fqn="aaaaaaaaaaaa")
    calls = []
    real_hex = secrets.token_hex

    def token_hex(n: int) -> str:
        calls.append(n)
        return "aaaaaaaaaaaa" if len(calls) in (1, 4) else real_hex(n)

    monkeypatch.setattr(mb.secrets, "token_hex", token_hex)
    for token in ("b" * 12, "c" * 12, "d" * 12):
        meta = _meta("/ckpt/step-1")
        data = mb.metadata_bytes(metadata, rows, token, meta)
        assert data == _plain(metadata, rows, token, meta)
        assert "aaaaaaaaaaaa" in pickle.loads(data).state_dict_metadata


@dataclasses.dataclass
class StampedMeta(StorageMeta):
    """A storage meta with a value of its own per save (as a later torch might add)."""

    stamp: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


@pytest.mark.parametrize(
    "make_meta",
    [
        lambda: StorageMeta(checkpoint_id="/ckpt/stép-1", save_id=uuid.uuid4().hex),
        lambda: StorageMeta(checkpoint_id="/ckpt/step-1", save_id=uuid.uuid4().hex, modules=["x"]),
        lambda: StampedMeta(checkpoint_id="/ckpt/step-1", save_id=uuid.uuid4().hex),
        lambda: None,
    ],
    ids=["not ascii", "modules", "a value per save", "none"],
)
def test_strings_no_template_stands_for_are_pickled_as_usual(make_meta):
    metadata, rows = _layout()
    for token in (secrets.token_hex(6) for _ in range(3)):
        meta = make_meta()  # a save's own
        data = mb.metadata_bytes(metadata, rows, token, meta)
        assert data == _plain(metadata, rows, token, meta)
        assert pickle.loads(data).storage_meta == meta
