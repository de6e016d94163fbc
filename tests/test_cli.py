"""The ``tierpoint`` command: ls, verify, inspect on real part files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierpoint import fileformat
from tierpoint.cli import main
from tierpoint.local.naming import part_name


def _part(path: Path, iteration: int, rank: int, world: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    fileformat.write(path, state, extra={"iteration": iteration, "rank": rank, "world_size": world})


def test_ls_counts_replicas_and_names_missing_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    session = tmp_path / "job"
    for holder, origin in ((0, 0), (0, 1), (1, 1)):  # iteration 5: rank 1 replicated on rank 0
        _part(session / str(holder) / part_name(5, origin), 5, origin, 2)
    _part(session / "0" / part_name(9, 0), 9, 0, 2)  # iteration 9: rank 1's part nowhere
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iteration 9: world size 2, INCOMPLETE (missing ranks [1])" in out
    assert "iteration 5: world size 2, complete" in out
    assert main(["ls", str(tmp_path / "absent")]) == 1


def test_verify_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    _part(good, 1, 0, 1)
    data = bytearray(good.read_bytes())
    data[-1] ^= 1
    bad.write_bytes(bytes(data))
    assert main(["verify", str(good)]) == 0
    assert main(["verify", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"ok   {good}" in out and f"FAIL {bad}" in out and "checksum" in out
    assert main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert '"iteration": 1' in out and "w  torch.float32  [2, 3]" in out
    with pytest.raises(SystemExit):
        main(["verify"])
