"""The one snapshot-copy engine on CPU: plain bytes in lanes, copied and hashed from the cache, any
other tensor through torch, and copies issued in one batch (one call per tensor where refused)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
import torch

from tierpoint import snapshot_copy
from tierpoint.fileformat import byte_view, checksum


def _sources() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: several lanes' chunks
    return [
        big,
        torch.randn(7, 5, generator=g).to(torch.bfloat16),
        torch.randn(6, 4, generator=g).t(),  # not contiguous
        torch.empty(0),
        torch.arange(10, dtype=torch.int64),
    ]


@pytest.mark.parametrize("hash", [False, True])
def test_copies_are_bit_equal_and_hashes_are_those_of_the_staged_bytes(hash):
    sources = _sources()
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    sums = snapshot_copy.copy_tensors(sources, targets, pinned=False, hash=hash)
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))
    if hash:
        assert sums == [checksum(byte_view(t)) for t in targets]
    else:
        assert sums is None


@pytest.fixture
def batching_restored():
    yield
    snapshot_copy._batched_copies = True


def test_copies_issued_in_one_batch_per_dtype_or_one_by_one_where_torch_refuses(
    monkeypatch, batching_restored
):
    sources = _sources()
    calls = []
    real = torch._foreach_copy_

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    targets = [torch.zeros(s.shape, dtype=s.dtype) for s in sources]
    snapshot_copy.issue_copies(sources, targets, non_blocking=False)
    counts = collections.Counter(s.dtype for s in sources)
    assert sorted(calls) == sorted(counts.values())  # one call per dtype (torch's fast path)
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))

    def refused(*args, **kwargs):
        raise RuntimeError("expected all tensors on the same device")

    monkeypatch.setattr(torch, "_foreach_copy_", refused)
    targets = [torch.zeros(s.shape, dtype=s.dtype) for s in sources]
    snapshot_copy.issue_copies(sources, targets, non_blocking=False)
    assert all(torch.equal(s, t) for s, t in zip(sources, targets))
    assert snapshot_copy._batched_copies is False  # not tried again


def test_cpu_tensors_have_no_training_streams_to_wait_for():
    assert snapshot_copy.training_streams([torch.ones(2), torch.zeros(3, dtype=torch.int64)]) == {}


CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("given", "local", "lanes"),
    [
        ("2", "", 2),
        ("7", "4", 7),
        ("", "", min(8, CPUS)),
        ("", "2", max(1, min(8, CPUS // 2))),
        ("", str(4 * CPUS), 1),
        ("0", "", "error"),
        ("many", "", "error"),
    ],
)
def test_copy_lanes_come_from_the_environment_or_a_clear_error(given, local, lanes):
    env = dict(os.environ, TIERPOINT_COPY_LANES=given, LOCAL_WORLD_SIZE=local)
    done = subprocess.run(
        [sys.executable, "-c", "from tierpoint import snapshot_copy as s; print(s.LANES)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if lanes == "error":
        assert done.returncode != 0
        assert "TIERPOINT_COPY_LANES must be a positive integer" in done.stderr
        assert repr(given) in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == lanes
