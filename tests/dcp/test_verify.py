"""verify_checkpoint: every item of a DCP checkpoint read and decoded, in bounded batches."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierpoint import dcp as tdcp
from tierpoint.dcp import step_path
from tierpoint.dcp import verify as verify_module
from tierpoint.dcp.verify import verify_checkpoint
from tierpoint.errors import CorruptCheckpointError


def test_every_item_is_read_in_batches(tmp_path: Path, monkeypatch) -> None:
    path = step_path(tmp_path, 1)
    state = {"a": torch.ones(100), "b": torch.zeros(50, dtype=torch.int64), "meta": {"lr": 0.1}}
    dcp.save(state, checkpoint_id=path)  # torch's own writer
    loads: list[list[str]] = []
    real_load = verify_module.load_here
    monkeypatch.setattr(
        verify_module,
        "load_here",
        lambda batch, *a, **k: (loads.append(sorted(batch)), real_load(batch, *a, **k)),
    )
    summary = verify_checkpoint(path, batch_bytes=450)
    assert (summary.tensors, summary.values, summary.tensor_bytes) == (2, 1, 800)
    assert loads == [["a"], ["b", "meta.lr"]]  # 400 + 400 bytes do not fit one batch of 450


def test_a_truncated_item_is_named(tmp_path: Path) -> None:
    path = step_path(tmp_path, 1)
    dcp.save({"a": torch.ones(1000)}, checkpoint_id=path)
    data = next(Path(path).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="'a'"):
        verify_checkpoint(path)


def test_an_intact_value_the_default_load_refuses_is_named_not_failed(tmp_path: Path) -> None:
    """A deque saved with tierpoint: every checksum matches, so verify passes and names the value
    the default load refuses; the same value damaged is damage; without checksums (torch's
    writer) a refusal cannot be told from damage and is raised."""
    from tierpoint.dcp import save
    from tierpoint.errors import UnsupportedStateError

    state = {"w": torch.ones(4), "rng": collections.deque(range(2000))}
    save(state, step_path(tmp_path, 1))
    summary = verify_checkpoint(step_path(tmp_path, 1))
    assert summary.verified and summary.needs_trust == ("rng",) and summary.values == 1
    data = max(Path(step_path(tmp_path, 1)).glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # inside the pickled RNG state (the bulk of the file)
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        verify_checkpoint(step_path(tmp_path, 1))
    dcp.save(state, checkpoint_id=step_path(tmp_path, 2))
    with pytest.raises(UnsupportedStateError, match="rng"):
        verify_checkpoint(step_path(tmp_path, 2))


def _verify_own(rank: int, world: int, root: Path) -> str:
    return str(verify_checkpoint(str(root / f"ckpt{rank}")).tensors)


def test_ranks_of_a_job_verify_checkpoints_of_their_own(tmp_path: Path) -> None:
    """verify_checkpoint runs no collective, also in a job: ranks that verify different
    checkpoints (its loads were refused as 'the ranks read different saves') or one rank alone."""
    from tierpoint.testing import run_ranks

    for rank in range(2):
        tdcp.save({"w": torch.full((4,), float(rank))}, str(tmp_path / f"ckpt{rank}"))
    assert run_ranks(_verify_own, 2, tmp_path, timeout=60) == ["1", "1"]
