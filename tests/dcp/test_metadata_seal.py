"""tierpoint's ``.metadata`` carries a checksum seal after its pickle: plain torch still reads the
file, tierpoint refuses one whose seal does not match, and files without a seal still load."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
import xxhash

from tierpoint import dcp
from tierpoint.errors import CorruptCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEAL = re.compile(rb"\ntierpoint-seal xxh3-64 ([0-9a-f]{16})\n\Z")


def _saved(path: Path) -> tuple[dict, bytes]:
    state = {"w": torch.randn(6, 4), "step": 3}
    dcp.save(state, checkpoint_id=path)
    return state, (path / ".metadata").read_bytes()


def test_the_seal_is_the_checksum_of_the_pickle_and_plain_torch_still_loads(tmp_path: Path):
    state, data = _saved(tmp_path / "ck")
    seal = SEAL.search(data)
    assert seal is not None, data[-60:]
    body = data[: seal.start()]
    assert seal.group(1).decode() == xxhash.xxh3_64_hexdigest(body)
    assert pickle.loads(body) == pickle.loads(data)  # pickle stops before the seal
    loaded = {"w": torch.zeros(6, 4), "step": 0}
    torch_dcp.load(loaded, storage_reader=torch_dcp.FileSystemReader(tmp_path / "ck"))
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def _load(path: Path) -> dict:
    out = {"w": torch.zeros(6, 4), "step": 0}
    dcp.load(out, checkpoint_id=path)
    return out


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: d[:-2] + (b"0" if d[-2:-1] != b"0" else b"1") + d[-1:], "checksum mismatch"),
        (lambda d: d.replace(b"tierpoint-seal", b"tierpoint-sea1"), "stray bytes"),
        (lambda d: d[:-1], "stray bytes"),
        (lambda d: d.replace(b"step", b"stea", 1), "checksum mismatch"),
    ],
    ids=["seal digit", "seal word", "seal cut", "pickle byte"],
)
def test_a_seal_that_does_not_match_its_pickle_is_refused(tmp_path: Path, damage, reason):
    _, data = _saved(tmp_path / "ck")
    damaged = damage(data)
    assert damaged != data
    (tmp_path / "ck" / ".metadata").write_bytes(damaged)
    with pytest.raises(CorruptCheckpointError, match=reason) as error:
        _load(tmp_path / "ck")
    assert ".metadata" in str(error.value)


def test_metadata_without_a_seal_still_loads(tmp_path: Path):
    """torch's own writer, and tierpoint before the seal, write the pickle alone."""
    state, data = _saved(tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(data[: SEAL.search(data).start()])
    assert torch.equal(_load(tmp_path / "ck")["w"], state["w"])
