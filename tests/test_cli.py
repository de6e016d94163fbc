"""The ``tierpoint`` command on real checkpoints: ls, inspect, verify, convert, bench, --help.

Checkpoints come from the public APIs (LocalCheckpointManager, fileformat.write, dcp.save);
damaged ones are damaged on disk. Failures must be one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tierpoint
from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint import dcp, fileformat
from tierpoint.cli import main
from tierpoint.local import BasicTensorAwareStateDict, LocalCheckpointManager
from tierpoint.local.naming import part_name

from .mounts import small_tmpfs

REPO = Path(__file__).resolve().parents[1]


def _part(path: Path, iteration: int, rank: int, world: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": iteration, "lr": 0.5}
    fileformat.write(path, state, extra={"iteration": iteration, "rank": rank, "world_size": world})


def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tierpoint.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def _one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def _run_counting_cpu(cmd: list[str]) -> tuple[int, str, str, float]:
    """Run ``cmd`` in REPO: its exit code, stdout, stderr and the CPU seconds it used (user and
    system). Unlike its wall time, which a loaded machine stretches many times over (tests run in
    parallel), the CPU time is the command's own."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        return (
            proc.returncode,
            out.read().decode(),
            err.read().decode(),
            usage.ru_utime + usage.ru_stime,
        )


def test_help_and_version_answer_without_torch() -> None:
    for args in ([], ["ls"], ["inspect"], ["verify"], ["convert"], ["bench"]):
        code, out, err, cpu = _run_counting_cpu(
            [sys.executable, "-X", "importtime", "-m", "tierpoint.cli", *args, "--help"]
        )
        assert code == 0 and "usage: tierpoint" in out
        assert "torch" not in err  # -X importtime lists every module imported
        # about 0.1 s; importing torch alone takes 1.5 s of CPU
        assert cpu < 1.0, f"tierpoint {' '.join(args)} --help took {cpu:.2f} s of CPU"
    done = _cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("tierpoint 0.")
    package = subprocess.run(  # python -m tierpoint: the same command
        [sys.executable, "-m", "tierpoint", "--version"], capture_output=True, text=True, cwd=REPO
    )
    assert package.returncode == 0 and package.stdout == done.stdout


def test_demo_help_answers_without_torch() -> None:
    """``tierpoint demo --help`` (and ``python -m tierpoint.demo --help``) answer at once too."""
    for cmd, usage in (
        (["-m", "tierpoint.cli", "demo"], "usage: tierpoint demo "),
        (["-m", "tierpoint.demo"], "usage: python -m tierpoint.demo "),
    ):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *cmd, "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert done.returncode == 0 and done.stdout.startswith(usage)
        assert "torch" not in done.stderr  # -X importtime lists every module imported


def test_ls_the_local_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = LocalCheckpointManager(tmp_path / "root", session_id="job", keep_last=2)
    for iteration in (3, 4):
        manager.save(BasicTensorAwareStateDict({"w": torch.ones(4) * iteration}), iteration)
    session = tmp_path / "root" / "job"
    for holder, origin in ((0, 0), (0, 1), (1, 1)):  # iteration 5: rank 1 replicated on rank 0
        _part(session / str(holder) / part_name(5, origin), 5, origin, 2)
    _part(session / "0" / part_name(9, 0), 9, 0, 2)  # iteration 9: rank 1's part nowhere
    for holder, origin in ((0, 0), (1, 1), (1, 0)):  # iteration 7: a damaged replica of rank 0
        _part(session / str(holder) / part_name(7, origin), 7, origin, 2)
    _flip(session / "1" / part_name(7, 0), 20)  # in its header: ls reads headers only
    _part(session / "0" / part_name(11, 0), 11, 0, 1)  # iteration 11: its only part damaged
    _flip(session / "0" / part_name(11, 0), 20)

    assert main(["ls", "--json", str(tmp_path / "root")]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert (
        rows[5]["status"] == "complete" and rows[5]["replicas"] == 1 and rows[5]["ranks"] == [0, 1]
    )
    assert rows[9]["status"] == "incomplete" and "missing ranks [1]" in rows[9]["detail"]
    assert rows[11]["status"] == "corrupt" and "rank 0's part damaged" in rows[11]["detail"]
    assert rows[7]["status"] == "complete" and rows[7]["replicas"] == 0
    assert "damaged copies of ranks [0] ignored" in rows[7]["detail"]
    assert rows[4]["status"] == rows[3]["status"] == "complete" and rows[4]["world_size"] == 1
    assert rows[5]["tier"] == "local" and rows[5]["size"] > 0 and rows[5]["mtime"] > 0
    assert doc["newest_restorable"] == {"job": str(session)}

    assert main(["ls", str(session)]) == 0  # a session's directory, as a table
    out = capsys.readouterr().out
    assert "incomplete: missing ranks [1]" in out and "corrupt" in out
    assert f"newest restorable (job): local iteration 7: {session}" in out
    assert main(["ls", "--json", str(session / "1")]) == 0  # one rank's directory
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[5]["ranks"] == [1] and rows[5]["where"] == "job"

    assert main(["ls", str(tmp_path / "absent")]) == 1
    _one_line_error(capsys.readouterr().err, "absent: no such file or directory")
    monkeypatch.setattr("tierpoint.local.naming.default_root", lambda: tmp_path / "root")
    assert main(["ls"]) == 0  # the default root
    assert "newest restorable (job)" in capsys.readouterr().out
    monkeypatch.setattr("tierpoint.local.naming.default_root", lambda: tmp_path / "none")
    assert main(["ls"]) == 1
    _one_line_error(capsys.readouterr().err, "no local tier at the default root")


def test_ls_a_dcp_base_and_an_olmo_style_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = tmp_path / "base"
    for step in (0, 3, 5, 6):
        dcp.save({"w": torch.arange(8.0), "step": step}, dcp.step_path(base, step))
    (Path(dcp.step_path(base, 5)) / ".unfinished-1").touch()  # rank 1 never finished step 5
    Path(dcp.step_path(base, 7)).mkdir()  # never committed
    data = next(Path(dcp.step_path(base, 6)).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:40])  # truncated
    assert main(["ls", "--json", str(base)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[7]["status"] == "incomplete" and "no .metadata" in rows[7]["detail"]
    assert rows[5]["status"] == "incomplete" and "unfinished on ranks [1]" in rows[5]["detail"]
    assert rows[6]["status"] == "corrupt" and "truncated" in rows[6]["detail"]
    assert rows[3]["status"] == "complete" and rows[3]["ranks"] == [0]
    assert rows[3]["tier"] == "persistent" and rows[0]["status"] == "complete"
    assert [r["step"] for r in doc["checkpoints"]] == [7, 6, 5, 3, 0]
    assert doc["newest_restorable"] == {str(base): dcp.step_path(base, 3)}
    assert main(["ls", dcp.step_path(base, 3)]) == 0  # one step
    assert "complete" in capsys.readouterr().out

    run = tmp_path / "run"  # OLMo-core: <run>/step<N>/model_and_optim is the DCP checkpoint
    dcp.save({"w": torch.ones(3)}, run / "step100" / "model_and_optim")
    (run / "step100" / "train").mkdir()  # OLMo-core's pickled trainer state
    torch.save({"step": 100}, run / "step100" / "train" / "rank0.pt")
    (run / "step100" / ".metadata.json").write_text("{}")  # written last: the step is finished
    dcp.save({"w": torch.ones(3)}, run / "step150" / "model_and_optim")  # no .metadata.json
    (run / "step200" / "model_and_optim").mkdir(parents=True)
    assert main(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert "no .metadata.json: the Checkpointer's save never finished" in out
    assert f"persistent step 100: {run / 'step100' / 'model_and_optim'}" in out
    assert main(["verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert "every item matches its checksum" in out and "skipped" in out


def test_ls_of_one_node_s_directory_in_ml_flashpoint_s_layout_says_other_nodes_hold_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """On node-local storage a node's step-N_ckpt holds its own ranks' files (the .metadata on the
    coordinator's node): what is missing there may be on other nodes, and ls says so."""
    for step in (1, 2):
        dcp.save({"w": torch.arange(8.0)}, tmp_path / f"step-{step}_ckpt")
    (tmp_path / "step-1_ckpt" / ".metadata").unlink()  # a node other than the coordinator's
    next((tmp_path / "step-2_ckpt").glob("*.distcp")).unlink()  # the coordinator's node
    assert main(["ls", "--json", str(tmp_path)]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[1]["status"] == "incomplete" and "no .metadata" in rows[1]["detail"]
    assert rows[2]["status"] == "corrupt" and "missing" in rows[2]["detail"]
    for row in rows.values():
        assert "other nodes hold the rest" in row["detail"], row


def test_verify(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    _part(good, 1, 0, 1)
    bad.write_bytes(good.read_bytes())
    _flip(bad)
    level = logging.getLogger("tierpoint").level
    assert main(["verify", f"file://{good}"]) == 0
    assert f"ok   {good}" in capsys.readouterr().out
    assert logging.getLogger("tierpoint").level == level  # quiet only while a command runs
    assert main(["verify", "--json", str(good), str(bad)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert [r["status"] for r in doc["results"]] == ["ok", "FAIL"]
    assert "checksum" in doc["results"][1]["detail"]

    parts = tmp_path / "session"
    for rank in (0, 1):
        _part(parts / "0" / part_name(4, rank), 4, rank, 2)
    assert main(["verify", str(parts)]) == 0  # every rank's parts
    assert capsys.readouterr().out.count("ok   ") == 2
    # A part renamed to another iteration is refused, as the manager refuses it.
    (parts / "0" / part_name(4, 0)).rename(parts / "0" / part_name(8, 0))
    assert main(["verify", str(parts / "0" / part_name(8, 0))]) == 1
    assert "disagrees with its metadata" in capsys.readouterr().out

    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 1
    _one_line_error(capsys.readouterr().err, "neither a DCP checkpoint")
    assert main(["verify", str(tmp_path / "absent"), str(good)]) == 1  # the others go on
    captured = capsys.readouterr()
    _one_line_error(captured.err, "absent: no such file or directory")
    assert f"ok   {good}" in captured.out and "1 ok" in captured.out
    with pytest.raises(SystemExit):
        main(["verify"])


def test_verify_a_dcp_base_checks_every_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = tmp_path / "base"
    for step in (1, 2):
        dcp.save({"w": torch.arange(1000.0), "step": step}, dcp.step_path(base, step))
    Path(dcp.step_path(base, 3)).mkdir()  # an uncommitted step is skipped
    assert main(["verify", str(base)]) == 0
    out = capsys.readouterr().out
    assert out.count("every item matches its checksum") == 2 and "skipped" in out
    data = next(Path(dcp.step_path(base, 2)).glob("*.distcp"))
    assert main(["verify", str(data)]) == 1
    _one_line_error(capsys.readouterr().err, "a DCP data file: verify its checkpoint directory")
    _flip(data, 1000)  # inside the tensor's bytes
    assert main(["verify", "--json", str(base)]) == 1
    doc = json.loads(capsys.readouterr().out)
    status = {Path(r["target"]).name: r for r in doc["results"]}
    assert status["step-1"]["status"] == "ok" and status["step-3"]["status"] == "skipped"
    assert (
        status["step-2"]["status"] == "FAIL" and "checksum mismatch" in status["step-2"]["detail"]
    )
    # A checkpoint plain torch wrote (no manifests) reads fine but cannot be verified.
    import torch.distributed.checkpoint as torch_dcp

    plain = str(tmp_path / "plain" / "step-1")
    torch_dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=plain, no_dist=True)
    assert main(["verify", plain]) == 0
    assert "unverified: no checksum manifest" in capsys.readouterr().out
    assert main(["verify", "--strict", plain]) == 1  # its line and the summary agree
    line, summary = capsys.readouterr().out.splitlines()
    assert line.startswith(f"FAIL {plain}: ") and "unverified" in line
    assert summary == "1 unverified (failed: --strict)"
    assert main(["verify", "--strict", "--json", plain]) == 1
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "unverified"


def test_inspect(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    part = tmp_path / "p.safetensors"
    state = {"model": {"w": torch.ones(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "step": 7, "opt": {"betas": (0.9, 0.99)}, "blob": {1, 2}}  # fmt: skip
    fileformat.write(part, state, allow_pickle=True, extra={"iteration": 7})
    assert main(["inspect", "--json", str(part)]) == 0
    doc = json.loads(capsys.readouterr().out)
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert tensors["model.w"]["dtype"] == "float32" and tensors["model.w"]["shape"] == [2, 3]
    assert tensors["model.w"]["bytes"] == 24 and len(tensors["model.b"]["checksum"]) == 16
    assert doc["values"]["step"] == 7 and doc["values"]["opt.betas[1]"] == 0.99
    assert doc["values"]["blob"] == "<a pickled object: not loaded>"
    assert doc["extra"] == {"iteration": 7} and doc["skeleton"]["~"] == "dict"
    assert main(["inspect", str(part)]) == 0
    out = capsys.readouterr().out
    assert "model.b" in out and "bfloat16" in out and "<tensor model.w>" in out

    step = dcp.step_path(tmp_path / "base", 2)
    dcp.save({"w": torch.arange(4.0), "lr": 0.25, "name": "run"}, step)
    assert main(["inspect", "--json", f"file://{step}/.metadata"]) == 0  # = the step
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "DCP checkpoint" and doc["values"] == {"lr": 0.25, "name": "run"}
    (w,) = doc["tensors"]
    assert w["name"] == "w" and w["shape"] == [4] and w["bytes"] == 16 and len(w["checksum"]) == 16
    assert main(["inspect", step]) == 0  # the size its head gives is the tensors', not the files'
    assert capsys.readouterr().out.startswith(f"{step}: DCP checkpoint, 16 B of tensors")

    pt, plain = tmp_path / "s.pt", tmp_path / "plain.safetensors"
    assert main(["convert", str(part), str(pt)]) == 1  # its pickle is never loaded
    _one_line_error(capsys.readouterr().err, str(part), "pickled objects")
    del state["blob"]
    fileformat.write(part, state)
    assert main(["convert", str(part), str(pt)]) == 0  # a torch.save file: loaded weights_only
    assert main(["convert", step, str(plain)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(pt)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "torch.save file" and doc["values"]["opt.betas[0]"] == 0.9
    assert {t["name"]: t["checksum"] for t in doc["tensors"]}["model.w"] == tensors["model.w"][
        "checksum"
    ]
    assert main(["inspect", "--json", str(plain)]) == 0  # header only, when not tierpoint's own
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] in ("safetensors file", "part file")
    assert [(t["name"], t["shape"], t["bytes"]) for t in doc["tensors"]] == [("w", [4], 16)]

    assert main(["inspect", str(tmp_path / "base")]) == 2
    _one_line_error(capsys.readouterr().err, "use `tierpoint ls` or `tierpoint verify`")
    part.write_bytes(part.read_bytes()[:30])
    done = _cli("inspect", str(part))
    assert done.returncode == 1
    _one_line_error(done.stderr, str(part))


def test_inspect_shows_a_step_whose_manifest_is_lost_and_names_the_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    step = dcp.step_path(tmp_path / "base", 3)
    dcp.save({"w": torch.arange(4.0), "lr": 0.25}, step)
    (manifest,) = Path(step).glob(".checksums-*")
    manifest.unlink()
    assert main(["inspect", "--json", step]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(t["name"], t["shape"], t["checksum"]) for t in doc["tensors"]] == [
        ("w", [4], "DAMAGED")
    ]
    problems = doc["problems"]
    assert problems and all(manifest.name in p for p in problems)
    assert not any(a != b and a in b for a in problems for b in problems)  # each said once
    assert main(["inspect", step]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and manifest.name in out and "w" in out


def test_inspect_names_a_lost_or_cut_data_file_as_ls_does(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # inspect reads only the values' items: a tensor's lost data file went unsaid, exit status 0,
    # where ls calls the step corrupt
    step = dcp.step_path(tmp_path / "base", 3)
    state = {"w": torch.arange(4096.0), "v": torch.ones(4096), "lr": 0.25}
    dcp.save(state, step, thread_count=2)
    (holder,) = Path(step).glob("__0_1.*.distcp")  # a tensor's file (the values are in file 0)
    data = holder.read_bytes()
    for damage, said in ((lambda: holder.unlink(), "data file missing"),
                         (lambda: holder.write_bytes(data[:-100]), "truncated")):  # fmt: skip
        damage()
        assert main(["ls", "--json", step]) == 0
        assert json.loads(capsys.readouterr().out)["checkpoints"][0]["status"] == "corrupt"
        assert main(["inspect", "--json", step]) == 1
        problems = json.loads(capsys.readouterr().out)["problems"]
        assert any(holder.name in p and said in p for p in problems), problems


def test_convert_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    part = tmp_path / "p.safetensors"
    state = {"model": {"w": torch.randn(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)}, "step": 9}
    fileformat.write(part, state)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(part), str(out)]) == 0
    assert "(safetensors): 2 tensors" in capsys.readouterr().out
    plain = safetensors.load_file(out)  # other tools read it
    assert torch.equal(plain["model.w"], state["model"]["w"])

    step = dcp.step_path(tmp_path / "base", 1)
    assert main(["convert", str(out), step]) == 0  # back to DCP, values included
    loaded = {"model.w": torch.empty(3, 4), "model.b": torch.empty(4, dtype=torch.bfloat16),
              "step": None}  # fmt: skip
    dcp.load(loaded, step)
    assert torch.equal(loaded["model.w"], state["model"]["w"]) and loaded["step"] == 9
    assert main(["convert", str(out), step]) == 1
    _one_line_error(capsys.readouterr().err, "holds a DCP checkpoint already")

    pt = tmp_path / "out.pt"
    assert main(["convert", step, str(pt)]) == 0
    flat = torch.load(pt, weights_only=True)
    assert torch.equal(flat["model.b"], state["model"]["b"]) and flat["step"] == 9
    assert main(["convert", str(pt), dcp.step_path(tmp_path / "base", 2)]) == 0
    assert main(["verify", dcp.step_path(tmp_path / "base", 2)]) == 0
    assert main(["convert", str(pt), str(pt)]) == 1
    _one_line_error(capsys.readouterr().err, "exists (--force to replace it)")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_onto_a_full_disk_leaves_no_partial_file(
    tmp_path: Path, capsys: pytest.CaptureFixture, suffix: str
) -> None:
    """A .pt file was written straight to its name: a full disk left a truncated file there (and
    --force destroyed the file it was to replace), with torch's obscure error."""
    part = tmp_path / "p.safetensors"
    fileformat.write(part, {"w": torch.randn(600_000), "step": 3})  # 2.4 MB
    with small_tmpfs(tmp_path / "small", "1m") as small:
        dst = small / f"out{suffix}"
        assert main(["convert", str(part), str(dst)]) == 1
        err = capsys.readouterr().err
        _one_line_error(err, "nothing written")
        assert "no space left on device" in err.lower(), err
        assert os.listdir(small) == []
        old = tmp_path / f"old{suffix}"
        fileformat.write(tmp_path / "small.safetensors", {"w": torch.ones(4), "step": 1})
        assert main(["convert", str(tmp_path / "small.safetensors"), str(old)]) == 0
        shutil.copy(old, dst)
        assert main(["convert", str(part), str(dst), "--force"]) == 1
        assert os.listdir(small) == [dst.name] and dst.read_bytes() == old.read_bytes()
        dst.unlink()
        assert main(["convert", str(tmp_path / "small.safetensors"), str(dst)]) == 0  # room again
        assert os.listdir(small) == [dst.name]
        assert main(["convert", str(dst), str(tmp_path / f"back{suffix}")]) == 0  # it reads back
        gc.collect()  # the tensors read map the file: the mount would stay busy


def test_convert_into_missing_directories_then_ls_and_verify_the_results(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("safetensors.torch")
    part = tmp_path / "p.safetensors"
    _part(part, 3, 0, 1)
    plain, pt = tmp_path / "out" / "p.safetensors", tmp_path / "deep" / "er" / "l.pt"
    for dst in (plain, pt):  # missing parents are made, as for a DCP destination
        assert main(["convert", str(part), str(dst)]) == 0
    assert torch.load(pt, weights_only=True)["step"] == 3
    url = tmp_path / "url" / "u.pt"  # a file:// URL names the same file, nothing else is made
    assert main(["convert", str(part), f"file://{url}"]) == 0 and url.exists()
    assert not Path("file:").exists()
    capsys.readouterr()

    # A plain safetensors file has no checksums: unverified, not corrupt.
    assert main(["verify", str(plain)]) == 0
    out = capsys.readouterr().out
    assert f"ok   {plain}: a plain safetensors file" in out and "1 unverified" in out
    assert main(["verify", "--strict", "--json", str(plain)]) == 1
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "unverified"
    plain.write_bytes(plain.read_bytes()[:-4])  # truncated: a failure still
    assert main(["verify", str(plain)]) == 1
    assert capsys.readouterr().out.startswith(f"FAIL {plain}")

    # A DCP checkpoint in a directory not named step-N has no step number.
    back = tmp_path / "out" / "back"
    assert main(["convert", str(pt), str(back)]) == 0
    capsys.readouterr()
    assert main(["ls", "--json", str(back)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in doc["checkpoints"]] == [None]
    assert doc["newest_restorable"] == {str(back): str(back)}
    assert main(["ls", str(back)]) == 0
    out = capsys.readouterr().out
    cells = {c.strip() for line in out.splitlines() for c in line.split("│")}
    assert "-1" not in cells and f"newest restorable ({back}): persistent step -: {back}" in out


def test_convert_a_local_iteration_and_refuse_unsafe_files(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = tmp_path / "job"
    for rank in (0, 1):
        _part(session / str(rank) / part_name(5, rank), 5, rank, 2)
    _part(session / "0" / part_name(6, 0), 6, 0, 2)  # incomplete: not the default
    assert main(["convert", str(session), str(tmp_path / "all.pt")]) == 0
    out = capsys.readouterr().out
    assert "iteration 5, ranks 0..1; newer iteration 6 not taken: incomplete (missing" in out, out
    both = torch.load(tmp_path / "all.pt", weights_only=True)
    assert sorted(both) == ["rank0", "rank1"] and both["rank1"]["step"] == 5
    assert main(["convert", str(session), str(tmp_path / "r0.pt"), "--iteration", "6",
                 "--rank", "0"]) == 0  # fmt: skip
    assert torch.load(tmp_path / "r0.pt", weights_only=True)["step"] == 6
    # iteration 6 whole: it is there, but incomplete ("no iteration 6" said it was not there)
    assert main(["convert", str(session), str(tmp_path / "six.pt"), "--iteration", "6"]) == 1
    _one_line_error(capsys.readouterr().err, "iteration 6 is incomplete (missing ranks [1])")
    # Without the safetensors package the layout is written by tierpoint.fileformat.
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert main(["convert", str(session), str(tmp_path / "all.safetensors")]) == 0
    assert "by tierpoint.fileformat" in capsys.readouterr().out
    assert fileformat.read(tmp_path / "all.safetensors")["rank0"]["lr"] == 0.5

    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "obj": _Unsafe()}, evil)
    assert main(["convert", str(evil), str(tmp_path / "x.safetensors")]) == 1
    _one_line_error(capsys.readouterr().err, "weights_only=True")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 5)
    assert main(["convert", str(tmp_path / "junk.safetensors"), str(tmp_path / "y.pt")]) == 1
    _one_line_error(capsys.readouterr().err, "junk.safetensors")
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "z.pt")]) == 1
    _one_line_error(capsys.readouterr().err, "empty: no complete iteration to convert")
    # --rank / --iteration choose within the local tier: elsewhere they were silently ignored
    step = dcp.step_path(tmp_path / "base", 5)
    dcp.save({"w": torch.ones(2)}, step)
    for src, option in ((step, "--rank"), (str(evil), "--iteration")):
        assert main(["convert", src, str(tmp_path / "one.pt"), option, "0"]) == 1
        _one_line_error(capsys.readouterr().err, "--iteration and --rank choose within")
        assert not (tmp_path / "one.pt").exists()
    # a DCP base is not converted whole: --iteration is pointed at its step's directory
    assert (
        main(["convert", str(tmp_path / "base"), str(tmp_path / "one.pt"), "--iteration", "5"]) == 1
    )
    _one_line_error(capsys.readouterr().err, f"convert one of its steps, such as {step}")


class _Unsafe:
    """Not loadable with weights_only=True."""


def test_s3_urls(s3_bucket: tuple, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    url, options = s3_bucket
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    base = f"{url}/run"
    for step in (10, 20):
        dcp.save({"w": torch.arange(16.0), "step": step}, dcp.step_path(base, step),
                 storage_options=options)  # fmt: skip
    assert main(["ls", "--json", base, *endpoint]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in doc["checkpoints"]] == ["complete", "complete"]
    assert doc["newest_restorable"] == {base: f"{base}/step-20"}  # still s3://, not s3:/
    assert main(["verify", base, *endpoint]) == 0
    assert capsys.readouterr().out.count(f"{base}/step-") == 2
    assert main(["inspect", "--json", f"{base}/step-10", *endpoint]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == {"step": 10}
    pt = tmp_path / "s3.pt"
    assert main(["convert", f"{base}/step-20", str(pt), *endpoint]) == 0
    assert torch.load(pt, weights_only=True)["step"] == 20
    assert main(["convert", str(pt), f"{base}/step-30", *endpoint]) == 0
    assert main(["verify", f"{base}/step-30", *endpoint]) == 0
    capsys.readouterr()
    assert main(["ls", "s3://no-such-bucket-tierpoint/run", *endpoint]) == 1
    _one_line_error(capsys.readouterr().err, "bucket 'no-such-bucket-tierpoint' does not exist")
    assert main(["ls", f"{url}/nothing-here", *endpoint]) == 1
    _one_line_error(capsys.readouterr().err, "nothing there")


def test_an_unreachable_store_is_one_line() -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    done = _cli("verify", "s3://bucket/run", "--endpoint-url", "http://127.0.0.1:9", env=env)
    assert done.returncode == 1
    _one_line_error(done.stderr, "s3://bucket/run", "Could not connect")


def test_bench(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    benches = tmp_path / "benches"
    benches.mkdir()
    (benches / "tiny_bench.py").write_text(
        "import argparse, json, pathlib\n"
        "p = argparse.ArgumentParser()\n"
        'p.add_argument("--quick", action="store_true")\n'
        'p.add_argument("--json", type=pathlib.Path)\n'
        "a = p.parse_args()\n"
        'a.json.write_text(json.dumps({"quick": a.quick, "tierpoint_s": 0.5}))\n'
        'print("tiny: done")\n'
        'print("WRITE")\n'
        "print(f\"{'contender':24} {'median s':>9} {'GB/s':>6}\")\n"
        'print("-" * 40)\n'
        "print(f\"{'tierpoint write':24} {0.5:9.3f} {2.0:6.2f}\")\n"
        "print(f\"{'torch.save (floor 2)':24} {1.25:9.3f} {0.8:6.2f}\")\n"
        "print()\n"
    )
    (benches / "broken_bench.py").write_text("raise SystemExit(3)\n")
    (benches / "gpu_bench.py").write_text("raise SystemExit('needs CUDA')\n")
    out = tmp_path / "results"
    common = ["--dir", str(benches), "--out", str(out)]
    assert main(["bench", "tiny", *common]) == 0
    text = capsys.readouterr().out  # one table: a row per contender of the bench's own tables
    assert "tierpoint write" in text and "1.25 median s" in text and "WRITE" in text
    assert str(out / "bench.json") in text
    try:
        import matplotlib  # noqa: F401

        assert (out / "bench.png").exists()
    except ImportError:
        assert "no chart: matplotlib not installed" in text
    assert main(["bench", "--json", *common]) == 1  # every bench; one failed
    doc = json.loads(capsys.readouterr().out)
    results = {r["bench"]: r for r in doc["results"]}
    assert results["tiny"]["figures"] == {"quick": True, "tierpoint_s": 0.5}
    assert results["tiny"]["args"] == ["--quick"] and results["tiny"]["status"] == "ok"
    assert results["tiny"]["contenders"] == [
        {"section": "WRITE", "name": "tierpoint write", "label": "median s", "value": 0.5},
        {"section": "WRITE", "name": "torch.save (floor 2)", "label": "median s", "value": 1.25},
    ]
    assert results["broken"]["status"] == "failed (exit status 3)"
    if not torch.cuda.is_available():  # the whole suite here skips the GPU bench
        assert results["gpu"]["status"] == "skipped (no CUDA device)"
    assert json.loads((out / "bench.json").read_text())["results"] == doc["results"]
    assert main(["bench", "nope", *common]) == 1
    _one_line_error(capsys.readouterr().err, "no benchmark 'nope'")


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "site-packages"  # an installed package: no benchmarks/ beside it
    shutil.copytree(Path(tierpoint.__file__).parent, site / "tierpoint",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    done = _cli("bench", env={"PYTHONPATH": str(site)})
    assert done.returncode == 1
    _one_line_error(done.stderr, str(tmp_path / "lib" / "benchmarks"), "source repository",
                    "--dir <checkout>/benchmarks")  # fmt: skip


def test_demo_is_still_reachable() -> None:
    done = _cli("demo", "--help")
    assert done.returncode == 0 and "--failures" in done.stdout
    description = " ".join(done.stdout.split("\n\n")[1].split())  # after the usage
    assert description.startswith("The demo: ") and description.endswith(
        "ends bit for bit where an uninterrupted run ends."
    )


def test_bench_chart_draws_every_contender(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart code, with a stand-in for matplotlib (not a dependency)."""
    from unittest import mock

    import numpy as np

    from tierpoint.cli import bench as cli

    plt = mock.MagicMock()
    axes = np.empty((2, 1), dtype=object)  # what subplots(2, 1, squeeze=False) returns
    axes[0, 0], axes[1, 0] = mock.MagicMock(), mock.MagicMock()
    figure = mock.MagicMock()
    figure.savefig.side_effect = lambda path, **_: Path(path).write_bytes(b"png")
    plt.subplots.return_value = (figure, axes)
    matplotlib = mock.MagicMock(pyplot=plt)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    results = [
        {"bench": "a", "seconds": 1.0, "contenders": [
            {"section": "W", "name": "tierpoint x", "label": "s", "value": 1.0},
            {"section": "W", "name": "torch.save", "label": "s", "value": 2.0}]},
        {"bench": "b", "seconds": 2.0, "contenders": [
            {"section": "R", "name": "torch.load", "label": "s", "value": 3.0}]},
    ]  # fmt: skip
    assert cli._chart(results, tmp_path / "c.png") == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes() == b"png"
    names, values = axes[0, 0].barh.call_args.args
    assert names == ["tierpoint x", "torch.save"] and values == [1.0, 2.0]
    assert axes[0, 0].barh.call_args.kwargs["color"] == ["tab:orange", "tab:blue"]
    assert axes[1, 0].set_title.call_args.args[0] == "b: R (s)"


def _save_olmo_run(rank: int, world: int, run: str, work: str) -> None:
    """Steps 2 and 3 of a run, saved by ``world`` ranks with tierpoint's Checkpointer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    checkpointer = tierpoint.Checkpointer(work_dir=f"{work}/{rank}")
    for step in (2, 3):
        module = tierpoint.BasicTrainModule(model, optim)
        checkpointer.save(f"{run}/step{step}", module, {"step": step, "rank": rank})


@pytest.fixture(scope="module")
def olmo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two steps saved by 2 ranks (copy it before damaging it)."""
    from tierpoint.testing import run_ranks

    base = tmp_path_factory.mktemp("olmo")
    run_ranks(_save_olmo_run, 2, str(base / "run"), str(base / "work"))
    return base / "run"


def _copy_run(olmo_run: Path, to: Path) -> Path:
    shutil.copytree(olmo_run, to)
    return to


def test_verify_an_olmo_step_checks_its_trainer_state_and_metadata(
    olmo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["verify", str(olmo_run)]) == 0  # both steps: DCP, metadata, each rank's state
    out = capsys.readouterr().out
    assert "8 ok" in out and f"ok   {olmo_run / 'step3' / 'train' / 'rank1.safetensors'}" in out
    assert main(["verify", str(olmo_run / "step2" / "train")]) == 0  # the trainer state alone
    assert capsys.readouterr().out.count("every checksum matches") == 2
    backup = shutil.copytree(olmo_run / "step2", tmp_path / "step2-backup")  # under another name
    assert main(["verify", str(backup)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.count("every checksum matches") == 2

    def damaged(name: str, how: Callable[[Path], None], *fragments: str) -> None:
        step = _copy_run(olmo_run, tmp_path / name) / "step2"
        how(step)
        for target in (step, step.parent):  # the step, and the run (every step)
            assert main(["verify", "--json", str(target)]) == 1, name
            failed = [r for r in json.loads(capsys.readouterr().out)["results"]
                      if r["status"] == "FAIL"]  # fmt: skip
            assert len(failed) == 1, (name, failed)
            text = f"{failed[0]['target']}: {failed[0]['detail']}"
            assert all(f in text for f in fragments), (name, text)

    rank1 = Path("train") / "rank1.safetensors"
    damaged("truncated", lambda s: (s / rank1).write_bytes((s / rank1).read_bytes()[:100]),
            str(rank1), "truncated")  # fmt: skip
    damaged("flipped", lambda s: _flip(s / rank1, 20), str(rank1))  # a header byte
    damaged("deleted", lambda s: (s / rank1).unlink(), str(rank1), "missing", "records 2 ranks")
    damaged("swapped", lambda s: shutil.copy(s / "train" / "rank0.safetensors", s / rank1),
            str(rank1), "written as the trainer state of")  # fmt: skip
    damaged("other save", lambda s: shutil.copy(s.parent / "step3" / rank1, s / rank1),
            str(rank1), "written as the trainer state of")  # fmt: skip
    damaged("empty", lambda s: (s / ".metadata.json").write_text(""), ".metadata.json", "JSON")
    damaged("garbage", lambda s: (s / ".metadata.json").write_text("{bad"), ".metadata.json")


def test_ls_agrees_with_the_checkpointer_on_olmo_steps(
    olmo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy_run(olmo_run, tmp_path / "run")
    assert main(["ls", "--json", str(run)]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[3]["status"] == rows[2]["status"] == "complete"
    assert rows[3]["world_size"] == rows[2]["world_size"] == 2  # what .metadata.json records

    (run / "step3" / ".metadata.json").write_text("{bad")
    latest = tierpoint.Checkpointer.latest_checkpoint(run)  # skips step 3 as corrupt
    assert main(["ls", "--json", str(run)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["step"]: r for r in doc["checkpoints"]}
    assert rows[3]["status"] == "corrupt" and ".metadata.json" in rows[3]["detail"]
    assert doc["newest_restorable"] == {str(run): str(Path(latest) / "model_and_optim")}
    assert main(["ls", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"persistent step 2: {run / 'step2' / 'model_and_optim'}" in out and "corrupt" in out

    (run / "step2" / "train" / "rank1.safetensors").unlink()  # a rank's trainer state lost
    assert main(["ls", "--json", str(run / "step2")]) == 0
    row = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert row["status"] == "corrupt" and "train/rank1.safetensors" in row["detail"]
    (run / "step2" / "train" / "rank0.safetensors").unlink()  # the Checkpointer skips it too
    assert not tierpoint.Checkpointer.dir_is_checkpoint(run / "step2")
    assert main(["ls", "--json", str(run)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["newest_restorable"] == {}
    assert "no trainer state of rank 0" in doc["checkpoints"][1]["detail"]


def test_convert_refuses_a_destination_that_is_not_empty(
    olmo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = _copy_run(olmo_run, tmp_path / "run")
    step = run / "step2"
    before = sorted(os.listdir(step))
    assert main(["convert", str(step), str(step)]) == 1  # into the checkpoint it reads
    _one_line_error(capsys.readouterr().err, str(step), "exists and is not empty", "--force")
    assert sorted(os.listdir(step)) == before

    session = tmp_path / "job"
    for rank in (0, 1):
        _part(session / str(rank) / part_name(5, rank), 5, rank, 2)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert main(["convert", str(session), str(user)]) == 1  # next to a user's files
    _one_line_error(capsys.readouterr().err, str(user), "exists and is not empty", "notes.txt")
    assert os.listdir(user) == ["notes.txt"]
    assert main(["convert", str(session), str(user), "--force"]) == 0  # asked for
    assert (user / ".metadata").exists() and (user / "notes.txt").exists()
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(session), str(tmp_path / "empty")]) == 0  # empty: fine
    (tmp_path / "file").write_text("x")
    assert main(["convert", str(session), str(tmp_path / "file"), "--force"]) == 1
    _one_line_error(capsys.readouterr().err, "a file, not a directory")


def test_ls_of_one_rank_directory_and_inspect_of_a_short_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    session = tmp_path / "job"
    for rank in (0, 1):
        _part(session / str(rank) / part_name(5, rank), 5, rank, 2)
    _part(session / "1" / part_name(9, 1), 9, 1, 2)  # iteration 9: rank 0's part nowhere
    assert main(["ls", "--json", str(session / "1")]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows[5]["status"] == "complete" and rows[5]["ranks"] == [1]
    assert "one rank's directory" in rows[5]["detail"]
    assert rows[9]["status"] == "incomplete" and "missing ranks [0]" in rows[9]["detail"]
    assert main(["ls", str(session / "1")]) == 0
    assert f"newest restorable (job): local iteration 5: {session}" in capsys.readouterr().out
    # Converting it whole needs every rank's part: they are not all under it.
    assert main(["convert", str(session / "1"), str(tmp_path / "all.pt")]) == 1
    _one_line_error(capsys.readouterr().err, "parts of ranks [0] are not under it")
    assert main(["convert", str(session / "1"), str(tmp_path / "r1.pt"), "--rank", "1"]) == 0

    short = tmp_path / "hostname"
    short.write_text("ab\n")
    assert main(["inspect", str(short)]) == 1
    _one_line_error(capsys.readouterr().err, "not a checkpoint file", "too short")
    damaged = tmp_path / "damaged.safetensors"  # a part whose header a byte flip broke
    data = bytearray((session / "0" / part_name(5, 0)).read_bytes())
    data[9] = 0
    damaged.write_bytes(bytes(data))
    for args in (["inspect", str(damaged)], ["convert", str(damaged), str(tmp_path / "d.pt")]):
        assert main(args) == 1
        err = capsys.readouterr().err
        _one_line_error(err, "corrupt, or not a safetensors file", "header is not valid JSON")


def test_verify_and_ls_an_olmo_run_on_s3(
    s3_bucket: tuple,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    url, options = s3_bucket
    endpoint = ["--endpoint-url", options["endpoint_url"]]
    checkpointer = tierpoint.Checkpointer(work_dir=tmp_path / "work", storage_options=options)
    module = tierpoint.BasicTrainModule(torch.nn.Linear(2, 2))
    checkpointer.save(f"{url}/run/step4", module, {"step": 4})
    assert main(["verify", f"{url}/run", *endpoint]) == 0
    out = capsys.readouterr().out
    assert f"ok   {url}/run/step4/train/rank0.safetensors: trainer state of step4" in out
    assert main(["ls", "--json", f"{url}/run", *endpoint]) == 0
    row = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert row["status"] == "complete" and row["world_size"] == 1


def test_ls_names_the_ranks_of_a_dcp_step_by_count_or_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A DCP step records no world size: ``ls`` shows how many ranks wrote it (rank 0 alone read
    as "0", as if none had), or which ones, as runs, when they are not 0..n-1."""
    base = tmp_path / "base"
    for step in (1, 2):
        dcp.save({"w": torch.arange(8.0)}, dcp.step_path(base, step))
    data = next(Path(dcp.step_path(base, 2)).glob("__0_*.distcp"))
    for rank in (2, 3, 5):  # stray files of other ranks
        (data.parent / data.name.replace("__0_", f"__{rank}_")).write_bytes(b"")
    assert main(["ls", str(base)]) == 0
    rows = {
        cells[2]: cells[4]
        for line in capsys.readouterr().out.splitlines()
        if len(cells := [c.strip() for c in line.split("│")]) > 4 and cells[2].isdigit()
    }
    assert rows == {"1": "1", "2": "0,2-3,5"}


def test_piped_output_keeps_long_paths_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    session = tmp_path / ("deep" * 40) / ("er" * 60) / "job"  # a path of over 400 characters
    _part(session / "0" / part_name(3, 0), 3, 0, 1)
    assert main(["ls", str(session)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"newest restorable (job): local iteration 3: {session}" in lines
    assert f"checkpoints under {session}" in lines  # the table's title
    assert any(str(session) in line for line in lines[:-1])  # the table's row, not folded


def test_verify_a_torch_save_file_checks_its_records_crcs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    good = tmp_path / "model.pt"
    torch.save({"w": torch.arange(1000.0), "step": 3}, good)
    data = good.read_bytes()
    flipped = tmp_path / "flipped.pt"
    at = data.index(torch.arange(1000.0).numpy().tobytes()) + 100
    flipped.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    (tmp_path / "short.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "other.pt").write_bytes(b"not a checkpoint")
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        torch.save({"w": torch.ones(3)}, tmp_path / "nocrc.pt")

    assert main(["verify", "--json", str(good)]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["status"] == "ok" and "matches its CRC-32" in result["detail"]
    for name, why in (
        ("flipped.pt", "record model/data/0 fails its CRC-32"),
        ("short.pt", "a damaged torch.save file"),
        ("other.pt", "not a torch.save file"),
    ):
        assert main(["verify", "--json", str(tmp_path / name)]) == 1
        (result,) = json.loads(capsys.readouterr().out)["results"]
        assert result["status"] == "FAIL" and why in result["detail"], result
    for name in ("legacy.pt", "nocrc.pt"):
        assert main(["verify", "--json", str(tmp_path / name)]) == 0
        (result,) = json.loads(capsys.readouterr().out)["results"]
        assert result["status"] == "unverified", result
        assert main(["verify", "--strict", str(tmp_path / name)]) == 1
        capsys.readouterr()


def test_verify_a_torch_save_file_whose_record_method_or_flags_are_damaged_fails_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # zipfile's testzip raises NotImplementedError for a compression method it does not know and
    # RuntimeError for a record flagged encrypted: verify ended on that error instead of a FAIL line
    import struct

    data = tmp_path / "model.pt"
    torch.save({"w": torch.arange(10.0)}, data)
    whole = data.read_bytes()
    entry = whole.index(b"PK\x01\x02")  # the first record's central directory entry
    for name, offset, value, why in (
        ("method.pt", 10, 99, "compression method"),
        ("flags.pt", 8, 1, "encrypted"),
    ):
        damaged = bytearray(whole)
        damaged[entry + offset : entry + offset + 2] = struct.pack("<H", value)
        (tmp_path / name).write_bytes(bytes(damaged))
        assert main(["verify", "--json", str(tmp_path / name)]) == 1
        (result,) = json.loads(capsys.readouterr().out)["results"]
        assert result["status"] == "FAIL", result
        assert "a damaged torch.save file" in result["detail"] and why in result["detail"], result


def test_convert_writes_files_the_umask_allows_others_to_read(tmp_path: Path) -> None:
    # a state safetensors cannot hold (complex) is written by tierpoint.fileformat, which made its
    # files private like a local tier's parts, where torch.save and safetensors follow the umask
    # (and the safetensors package itself, 0.8 at least, writes its files 0600)
    source = tmp_path / "s.pt"
    torch.save({"z": torch.ones(3, dtype=torch.complex64), "w": torch.ones(2)}, source)
    plain = tmp_path / "plain.pt"  # a state safetensors holds: written by the safetensors package
    torch.save({"w": torch.ones(2)}, plain)
    umask = os.umask(0o022)
    try:
        for src, name in (
            (source, "out.safetensors"),
            (source, "out.pt"),
            (plain, "p.safetensors"),
        ):
            assert main(["convert", str(src), str(tmp_path / name)]) == 0
            assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    finally:
        os.umask(umask)


def test_convert_onto_its_own_source_is_refused_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``convert SRC SRC --force`` replaced a local tier's part file by a plain safetensors file
    (no checksums: the tier then ignored its newest iteration), and a DCP step by a new save of
    itself (its old files removed first: a failure would leave neither)."""
    pytest.importorskip("safetensors.torch")
    part = tmp_path / "job" / "0" / part_name(5, 0)
    _part(part, 5, 0, 1)
    step = dcp.step_path(tmp_path / "base", 5)
    assert main(["convert", str(part), step]) == 0
    capsys.readouterr()
    link = tmp_path / "link.safetensors"
    link.symlink_to(part)
    base = tmp_path / "base"  # a DCP save into the base would sit over its step directories
    pairs = [(part, part), (part, link), (step, step), (step, f"file://{step}/"), (step, base)]
    for src, dst in pairs + [(part, tmp_path / "job"), (part, f"file://{tmp_path}")]:
        before = {p: p.read_bytes() for p in sorted(Path(src).parent.rglob("*")) if p.is_file()}
        assert main(["convert", str(src), str(dst), "--force"]) == 1
        _one_line_error(capsys.readouterr().err, "is SRC or holds it", "nothing written")
        assert {p: p.read_bytes() for p in before} == before
    assert main(["verify", str(part), step]) == 0


def test_convert_onto_a_file_system_without_free_blocks_that_is_not_full_says_why_it_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """/proc (like a squashfs) counts no free blocks: a write refused there was reported as
    "no space left on device" instead of its own reason."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    part = tmp_path / "p.safetensors"
    _part(part, 3, 0, 1)
    for dst in ("/proc/tierpoint-test.pt", "/proc/tierpoint-test.safetensors"):
        assert main(["convert", str(part), dst]) == 1
        err = capsys.readouterr().err
        _one_line_error(err, f"writing {dst} failed", "nothing written")
        assert "no space" not in err.lower(), err


def test_bench_refuses_a_timeout_that_is_not_positive_and_bounds_every_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--timeout 0`` or ``-1`` ran the bench and reported it "timed out after -1.0 s"; without
    ``--timeout`` a hung bench hung the command."""
    from tierpoint.cli import bench

    benches = tmp_path / "benches"
    benches.mkdir()
    (benches / "hung_bench.py").write_text("import time\ntime.sleep(600)\n")
    common = ["--dir", str(benches), "--out", str(tmp_path / "out")]
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as caught:
            main(["bench", "--timeout", bad, *common])
        assert caught.value.code == 2
        assert f"must be a number of seconds > 0, got '{bad}'" in capsys.readouterr().err
    monkeypatch.setitem(bench.TIMEOUT_S, "quick", 1.0)
    start = time.monotonic()
    assert main(["bench", "--json", *common]) == 1
    assert time.monotonic() - start < 30
    assert json.loads(capsys.readouterr().out)["results"][0]["status"] == "timed out after 1.0 s"


def test_bench_says_when_out_cannot_be_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--out`` naming a file failed with a bare "[Errno 17] File exists"."""
    benches = tmp_path / "benches"
    benches.mkdir()
    (benches / "quick_bench.py").write_text("print('never run')\n")
    taken = tmp_path / "results.json"
    taken.write_text("{}")
    assert main(["bench", "--dir", str(benches), "--out", str(taken)]) != 0
    err = capsys.readouterr().err
    assert f"--out {taken}: cannot be the results' directory (File exists)" in err, err
    assert taken.read_text() == "{}"


def test_convert_a_local_iteration_passes_over_a_damaged_or_misnamed_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # As the manager saves with replication: rank 0's directory holds rank 1's replica, which
    # sorts before rank 1's own part. A damaged copy must not fail the conversion while another
    # is intact, and a file under another part's name is never taken for it.
    def parts(session: Path) -> None:
        for holder in (0, 1):
            for origin in (0, 1):
                path = session / str(holder) / part_name(5, origin)
                path.parent.mkdir(parents=True, exist_ok=True)
                extra = {"iteration": 5, "rank": origin, "world_size": 2}
                fileformat.write(path, {"w": torch.full((4,), float(origin))}, extra=extra)

    def converted(session: Path, name: str) -> dict:
        assert main(["convert", str(session), str(tmp_path / name)]) == 0, capsys.readouterr()
        capsys.readouterr()
        return torch.load(tmp_path / name, weights_only=True)

    parts(tmp_path / "a")
    _flip(tmp_path / "a" / "0" / part_name(5, 1))  # the replica's data damaged
    assert torch.equal(converted(tmp_path / "a", "a.pt")["rank1"]["w"], torch.full((4,), 1.0))
    _flip(tmp_path / "a" / "1" / part_name(5, 1))  # and rank 1's own copy: none intact
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "none.pt")]) == 1
    _one_line_error(capsys.readouterr().err, "no intact copy of rank 1's part of iteration 5")
    assert not (tmp_path / "none.pt").exists()

    for holder in ("0", "1"):  # a copy of rank 1's part replaced by rank 0's: intact, not rank 1's
        parts(tmp_path / holder)
        shutil.copy(
            tmp_path / "0" / "0" / part_name(5, 0), tmp_path / holder / holder / part_name(5, 1)
        )
        rank1 = converted(tmp_path / holder, f"{holder}.pt")["rank1"]["w"]
        assert torch.equal(rank1, torch.full((4,), 1.0)), holder


def test_ls_and_convert_never_make_a_local_iteration_of_two_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Each rank's part of iteration 5 from another save (a node back with an earlier run's
    # parts): the manager refuses to load it, ls called it complete and its newest restorable,
    # and convert mixed the two saves. With a replica of the newer save, that save is whole.
    session = tmp_path / "job"

    def part(holder: int, origin: int, save: str) -> None:
        path = session / str(holder) / part_name(5, origin)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"iteration": 5, "rank": origin, "world_size": 2, "save": save}
        fileformat.write(path, {"w": torch.full((2,), float(origin)), "save": save}, extra=extra)

    part(0, 0, "t0000000000000001")
    part(1, 1, "t0000000000000002")
    assert main(["ls", "--json", str(session)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoints"][0]["status"] == "incomplete", doc
    assert "come from 2 saves" in doc["checkpoints"][0]["detail"] and not doc["newest_restorable"]
    assert main(["convert", str(session), str(tmp_path / "mixed.pt")]) == 1
    _one_line_error(capsys.readouterr().err, "no complete iteration to convert")

    part(1, 0, "t0000000000000002")  # rank 0's part of the newer save, as rank 1's replica
    assert main(["ls", "--json", str(session)]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"][0]["status"] == "complete"
    assert main(["convert", str(session), str(tmp_path / "whole.pt")]) == 0, capsys.readouterr()
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert [whole[f"rank{r}"]["save"] for r in (0, 1)] == ["t0000000000000002"] * 2


def test_a_failure_is_one_line_unless_tierpoint_debug_asks_for_its_traceback(tmp_path: Path):
    missing = str(tmp_path / "missing")
    for value in ("", "0"):  # unset, empty and 0 alike
        done = _cli("inspect", missing, env={"TIERPOINT_DEBUG": value})
        assert done.returncode != 0
        _one_line_error(done.stderr, missing)
    done = _cli("inspect", missing, env={"TIERPOINT_DEBUG": "1"})
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_bench_stopped_at_its_timeout_removes_its_files_and_keeps_its_output(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed-out bench was SIGKILLed, so its clean-up never ran (the benches' GiB-sized
    /dev/shm directories stayed), and its output was kept as the repr of bytes ("b'...\\\\n...'")."""
    from tierpoint.cli import bench

    benches = tmp_path / "benches"
    benches.mkdir()
    files = tmp_path / "bench-files"
    (benches / "slow_bench.py").write_text(
        "import os, signal, sys, shutil, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
        f"os.mkdir({str(files)!r})\n"
        "print('slow: started', flush=True)\n"
        "try:\n"
        "    time.sleep(600)\n"
        "finally:\n"
        f"    shutil.rmtree({str(files)!r})\n"
    )
    monkeypatch.setitem(bench.TIMEOUT_S, "quick", 3.0)
    common = ["--dir", str(benches), "--out", str(tmp_path / "out")]
    assert main(["bench", "--json", *common]) == 1
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert result["status"] == "timed out after 3.0 s"
    assert result["output"] == "slow: started\n" and result["last_line"] == "slow: started"
    assert not files.exists()
