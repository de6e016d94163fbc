"""tierpoint.dist on real gloo ranks: agreement, bounded waits, node layout, single process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tierpoint import dist as tpdist
from tierpoint.errors import CheckpointingError, CoordinationTimeoutError
from tierpoint.testing import RankFailure, free_port, run_ranks


def _fail_on_rank_two(rank: int, world: int) -> dict:
    start = time.monotonic()
    try:
        with tpdist.agree("test step"):
            if rank == 2:
                raise OSError("disk on fire")
    except CheckpointingError as e:
        return {"msg": str(e), "failures": e.failures, "seconds": time.monotonic() - start}
    return {"msg": None}


def test_agree_one_rank_fails_all_raise_same_error():
    results = run_ranks(_fail_on_rank_two, 4, timeout=90)
    messages = {r["msg"] for r in results}
    assert len(messages) == 1, "every rank must raise the same error"
    (msg,) = messages
    assert msg is not None
    assert "rank 2" in msg and "disk on fire" in msg and "OSError" in msg
    for r in results:
        assert set(r["failures"]) == {2}
        assert r["seconds"] < 30


def _all_succeed(rank: int, world: int) -> list:
    with tpdist.agree("fine step"):
        pass
    return tpdist.all_gather_json({"rank": rank})


def test_agree_success_and_gather():
    results = run_ranks(_all_succeed, 3)
    for r in results:
        assert r == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


def _crash_inside_agree(rank: int, world: int) -> str:
    tpdist.coordination_group()
    tpdist.barrier("every rank connected")  # the crash must come after group creation, not during
    try:
        with tpdist.agree("step with a crash"):
            if rank == 1:
                os._exit(17)  # a real crash: no agreement message is ever sent
    except CheckpointingError as e:
        return type(e).__name__
    return "no error"


def test_crashed_rank_makes_others_raise_not_hang():
    start = time.monotonic()
    results = run_ranks(
        _crash_inside_agree, 4, allow_crash={1}, env={"TIERPOINT_TIMEOUT": "5"}, timeout=90
    )
    assert results[1] is None
    for rank in (0, 2, 3):
        assert results[rank] in ("CheckpointingError", "CoordinationTimeoutError")
    assert time.monotonic() - start < 60


def _late_rank(rank: int, world: int) -> str:
    tpdist.coordination_group()
    if rank == 0:
        time.sleep(8)  # never joins in time
        return "slept"
    try:
        tpdist.barrier("waiting for a late rank")
    except CoordinationTimeoutError as e:
        first = str(e)
    else:
        return "no timeout"
    start = time.monotonic()
    try:
        tpdist.barrier("the next step")
    except CheckpointingError as e:
        return f"{first} | {e} | {time.monotonic() - start:.1f}"
    return f"{first} | no error"


def test_wait_for_absent_rank_times_out_and_later_steps_say_why_they_cannot_run():
    results = run_ranks(_late_rank, 2, env={"TIERPOINT_TIMEOUT": "3"}, timeout=90)
    first, later, seconds = results[1].split(" | ")
    assert "waiting for a late rank" in first and "timeout" in first
    assert "no word from rank 0 " in first  # the silent rank is named
    assert "the next step: tierpoint's coordination group failed earlier" in later
    assert "waiting for a late rank" in later and "restart the job" in later
    assert float(seconds) < 2.5  # at once, not after another timeout (3 s)


def _store_host_stopped(rank: int, world: int, port: int) -> str | None:
    """As a job launched with env:// (srun, a plain script): rank 0 hosts the job's store."""
    dist.destroy_process_group()
    long = timedelta(seconds=600)  # torch's default store timeout is 30 minutes
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=long)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    tpdist.coordination_group()
    pids: list[int | None] = [None] * world  # (gathered after every rank made the group: its
    dist.all_gather_object(pids, os.getpid())  # making asks the store, which rank 0 hosts)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped: its store answers no one
        return None
    start = time.monotonic()
    try:
        tpdist.barrier("waiting for a stopped rank")
    except CoordinationTimeoutError as e:
        return f"{time.monotonic() - start:.1f} | {e}"
    finally:
        os.kill(pids[0], signal.SIGKILL)
    return "no timeout"


def test_a_stopped_rank_hosting_the_store_makes_the_others_raise_within_the_timeout():
    """Naming the silent ranks after a timeout asks the job's store, which rank 0 hosts when
    the job was launched with env:// (torchrun's agent hosts it elsewhere): a stopped rank 0
    left the others waiting for the store's own timeout (30 minutes by default) instead."""
    results = run_ranks(
        _store_host_stopped,
        2,
        free_port(),
        env={"TIERPOINT_TIMEOUT": "3"},
        timeout=60,
        allow_crash={0},
    )
    seconds, message = results[1].split(" | ")
    assert "waiting for a stopped rank" in message and "timeout" in message
    assert float(seconds) < 3 * 3 + 10


def _layout(rank: int, world: int) -> dict:
    layout = tpdist.node_layout()
    group = tpdist.coordination_group()
    return {
        "nodes": layout.nodes,
        "local_rank": layout.local_rank,
        "local_world_size": layout.local_world_size,
        "node_index": layout.node_index,
        "own_group": group is not dist.group.WORLD and dist.get_backend(group) == "gloo",
        "bcast": tpdist.broadcast_json({"from": rank}, src=1),
    }


def test_node_layout_from_node_ids():
    # Two simulated nodes of two ranks each: node identity comes from TIERPOINT_NODE_ID, set per rank
    # by a wrapper that derives it from the rank.
    results = run_ranks(_layout_with_ids, 4)
    assert [r["node_index"] for r in results] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in results] == [0, 1, 0, 1]
    assert all(r["local_world_size"] == 2 for r in results)
    assert all(r["own_group"] for r in results)
    assert all(r["bcast"] == {"from": 1} for r in results)


def _layout_with_ids(rank: int, world: int) -> dict:
    os.environ["TIERPOINT_NODE_ID"] = f"node{rank // 2}"
    return _layout(rank, world)


def test_single_process_without_torch_distributed():
    assert not tpdist.is_distributed()
    assert (tpdist.get_rank(), tpdist.get_world_size()) == (0, 1)
    assert tpdist.all_gather_json({"a": 1}) == [{"a": 1}]
    assert tpdist.broadcast_json([1, 2]) == [1, 2]
    layout = tpdist.node_layout()
    assert (layout.local_rank, layout.local_world_size) == (0, 1)
    with pytest.raises(CheckpointingError, match="rank 0: ValueError: nope") as info:
        with tpdist.agree("solo"):
            raise ValueError("nope")
    assert isinstance(info.value.__cause__, ValueError)
    with tpdist.agree("solo ok"):
        pass


def _raise(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom")


def test_helper_reports_rank_failures():
    with pytest.raises(RankFailure, match="rank 1 failed"):
        run_ranks(_raise, 2)


def test_free_port_is_free_and_not_one_the_kernel_hands_out():
    """The caller binds the port a moment later: the kernel could give a port of its ephemeral
    range to another process in between (a store or gloo socket of a test run beside it)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here")
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # picked at random: two launchers starting together get two ports
    for port in ports:
        if ephemeral >= 20000 + 1024:
            assert 20000 <= port < ephemeral, (port, ephemeral)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf", "nan"])
def test_a_bad_timeout_variable_is_named(monkeypatch, value):
    monkeypatch.setenv("TIERPOINT_TIMEOUT", value)
    with pytest.raises(CheckpointingError, match="TIERPOINT_TIMEOUT must be a positive number"):
        tpdist.default_timeout()


def _after_destroying_the_group(rank: int, world: int, root: str) -> str:
    from tierpoint.local import LocalCheckpointManager

    manager = LocalCheckpointManager(root, session_id="job")
    dist.destroy_process_group()
    with pytest.raises(CheckpointingError) as raised:
        manager.find_latest()
    return str(raised.value)


def test_a_manager_used_after_its_group_was_destroyed_says_so(tmp_path):
    """Refused (every process would act as rank 0 of 1), and the message gives the way out that
    fits this case too: new objects once a new process group is up."""
    for message in run_ranks(_after_destroying_the_group, 2, str(tmp_path), timeout=60):
        assert "after destroy_process_group(), make new managers" in message, message


@pytest.mark.parametrize(
    "what", ["agree", "agree destroy", "agree", "agree destroy", "everything destroy"]
)
def test_torchrun_ranks_exit_cleanly_after_tierpoint_collectives(tmp_path, what):
    """A gloo group freed while the interpreter shuts down aborted about one exit in three
    ("terminate called without an active exception", SIGABRT: torchrun reported the job failed);
    tierpoint drops its groups at exit. Several launches: one passing by chance proves little."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}",
         str(Path(__file__).with_name("clean_exit_job.py")), str(tmp_path / "root"), *what.split()],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path), "TIERPOINT_TIMEOUT": "60"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert done.stdout.count(" done") == 2
