"""The ``tierpoint`` command: ls, verify, inspect on real part files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierpoint import fileformat
from tierpoint.cli import main
from tierpoint.dcp import save, step_path
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
    assert main(["inspect", str(tmp_path)]) == 2
    assert "use `tierpoint ls` or `tierpoint verify`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify"])


def test_ls_and_verify_a_dcp_base(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save({"w": torch.arange(8.0), "step": 3}, step_path(tmp_path, 3))
    save({"w": torch.arange(8.0), "step": 5}, step_path(tmp_path, 5))
    (Path(step_path(tmp_path, 5)) / ".unfinished-1").touch()  # rank 1 never finished step 5
    Path(step_path(tmp_path, 7)).mkdir()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 7: INCOMPLETE (no .metadata" in out
    assert "step 5: INCOMPLETE (unfinished on ranks [1])" in out
    assert "step 3: complete" in out and f"latest complete: {step_path(tmp_path, 3)}" in out
    assert main(["verify", step_path(tmp_path, 3)]) == 0
    assert "1 tensors (32 bytes) and 1 other values" in capsys.readouterr().out
    data = next(Path(step_path(tmp_path, 3)).glob("*.distcp"))
    assert main(["verify", str(data)]) == 1
    assert "a DCP data file: verify its checkpoint directory" in capsys.readouterr().out
    data.write_bytes(data.read_bytes()[:40])
    assert main(["verify", step_path(tmp_path, 3)]) == 1
    assert "truncated" in capsys.readouterr().out


def test_verify_a_directory_of_parts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for rank in (0, 1):
        _part(tmp_path / "0" / part_name(4, rank), 4, rank, 2)
    assert main(["verify", str(tmp_path / "0")]) == 0
    assert capsys.readouterr().out.count("ok   ") == 2
    assert main(["verify", str(tmp_path)]) == 0  # a session's directory: every rank's parts
    assert capsys.readouterr().out.count("ok   ") == 2
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    assert "neither a DCP checkpoint" in capsys.readouterr().out
    # A part renamed to another iteration is refused, as the manager refuses it.
    (tmp_path / "0" / part_name(4, 0)).rename(tmp_path / "0" / part_name(8, 0))
    assert main(["verify", str(tmp_path / "0" / part_name(8, 0))]) == 1
    assert "disagrees with its metadata" in capsys.readouterr().out


def test_ls_a_root_of_the_empty_session_and_a_session_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """With session_id="" (NVRx's default) the rank directories sit right under the root."""
    for rank in (0, 1):
        _part(tmp_path / "root" / str(rank) / part_name(7, rank), 7, rank, 2)
        _part(tmp_path / "root" / "job" / str(rank) / part_name(3, rank), 3, rank, 2)
    assert main(["ls", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    assert (
        f"rank directories under {tmp_path / 'root'}\n  iteration 7: world size 2, complete" in out
    )
    assert "session 'job'" in out and "iteration 3: world size 2, complete" in out
    assert "session '0'" not in out
    assert main(["ls", str(tmp_path / "root" / "job")]) == 0  # one session's directory
    assert "iteration 3: world size 2, complete" in capsys.readouterr().out
