"""tierpoint.peers.transfer.move_files on real gloo ranks: content, buckets, verification, dead peers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tierpoint import peers
from tierpoint.errors import CheckpointingError, CorruptCheckpointError
from tierpoint.peers import transfer
from tierpoint.peers.transfer import FileMove, move_files
from tierpoint.testing import run_ranks


def _payload(rank: int, nbytes: int) -> bytes:
    return bytes((rank * 7 + i) % 251 for i in range(256)) * (nbytes // 256) + b"x" * (nbytes % 256)


def _setup_dir(tmp: str, rank: int, nbytes: int) -> Path:
    d = Path(tmp) / f"r{rank}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "own.bin").write_bytes(_payload(rank, nbytes))
    return d


def _ring_and_swap(rank: int, world: int, tmp: str) -> list[tuple[str, int]]:
    sizes = [3 << 20, 0, 1000, (1 << 20) + 17]
    _setup_dir(tmp, rank, sizes[rank])
    moves = [
        FileMove(
            r, (r + 1) % world, f"{tmp}/r{r}/own.bin", f"{tmp}/r{(r + 1) % world}/from_{r}.bin"
        )
        for r in range(world)
    ] + [
        FileMove(1, 0, f"{tmp}/r1/own.bin", f"{tmp}/r0/swap.bin"),
        FileMove(0, 1, f"{tmp}/r0/own.bin", f"{tmp}/r1/swap.bin"),
    ]
    stats = move_files(moves, timeout=30, bucket_bytes=256 << 10)
    left = (rank - 1) % world
    got = Path(f"{tmp}/r{rank}/from_{left}.bin").read_bytes()
    assert got == _payload(left, sizes[left])
    if rank in (0, 1):
        assert Path(f"{tmp}/r{rank}/swap.bin").read_bytes() == _payload(1 - rank, sizes[1 - rank])
    assert not [p for p in os.listdir(f"{tmp}/r{rank}") if p.endswith(".dirty")]
    return [
        (p, os.stat(f"{tmp}/r{rank}/{p}").st_mode & 0o777)
        for p in sorted(os.listdir(f"{tmp}/r{rank}"))
    ], stats.received_bytes


def test_ring_and_swap_arrive_intact(tmp_path: Path) -> None:
    results = run_ranks(_ring_and_swap, 4, str(tmp_path))
    listing0, received0 = results[0]
    assert [name for name, _ in listing0] == ["from_3.bin", "own.bin", "swap.bin"]
    assert dict(listing0)["from_3.bin"] == 0o600
    assert received0 == ((1 << 20) + 17) + 0  # from rank 3, plus rank 1's empty file


def _two_groups_at_once(rank: int, world: int, tmp: str) -> list[bool]:
    """Two threads move files on two groups at the same time, started in opposite orders on the two
    ranks (as a background restore and a foreground call may be): each group's calls pair up."""
    import threading
    import time

    _setup_dir(tmp, rank, 2 << 20)
    groups = [dist.new_group(backend="gloo"), dist.new_group(backend="gloo")]
    other = 1 - rank
    moves = [
        [FileMove(other, rank, f"{tmp}/r{other}/own.bin", f"{tmp}/r{rank}/via_{g}.bin")]
        + [FileMove(rank, other, f"{tmp}/r{rank}/own.bin", f"{tmp}/r{other}/via_{g}.bin")]
        for g in range(2)
    ]
    for m in moves:
        m.sort(key=lambda move: move.src)  # the same list on both ranks
    errors: list[BaseException] = []

    def run(g: int) -> None:
        try:
            move_files(moves[g], groups[g], timeout=20, bucket_bytes=64 << 10)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    order = [0, 1] if rank == 0 else [1, 0]
    threads = []
    for g in order:
        threads.append(threading.Thread(target=run, args=(g,)))
        threads[-1].start()
        time.sleep(0.3)
    for t in threads:
        t.join(60)
    assert not errors, errors
    return [
        Path(f"{tmp}/r{rank}/via_{g}.bin").read_bytes() == _payload(other, 2 << 20) for g in (0, 1)
    ]


def test_calls_on_two_groups_may_overlap(tmp_path: Path) -> None:
    assert run_ranks(_two_groups_at_once, 2, str(tmp_path)) == [[True, True], [True, True]]


def _rejected(rank: int, world: int, tmp: str, how: str) -> str:
    d = _setup_dir(tmp, rank, 2 << 20)
    moves = [FileMove(0, 1, f"{tmp}/r0/own.bin", f"{tmp}/r1/copy.bin")]
    if how == "digest" and rank == 0:
        transfer._digest = lambda view: 12345  # the sender announces a wrong checksum

    class Refuse:
        def __init__(self, move: FileMove, data: memoryview) -> None:
            self.move = move

        def advance(self, available: int) -> None:
            if available > (1 << 20):  # rejected mid-stream: the rest is still drained
                raise CorruptCheckpointError(self.move.dst_path, "refused by the test")

        def finish(self) -> None:
            raise AssertionError("finish after a rejection")

    try:
        move_files(
            moves, timeout=30, bucket_bytes=1 << 20, verify=Refuse if how == "verify" else None
        )
    except CorruptCheckpointError as e:
        assert rank == 1
        assert sorted(os.listdir(d)) == ["own.bin"]  # nothing visible, no dirty file
        return str(e)
    assert rank == 0
    return ""


@pytest.mark.parametrize("how", ["digest", "verify"])
def test_rejected_file_never_becomes_visible(tmp_path: Path, how: str) -> None:
    message = run_ranks(_rejected, 2, str(tmp_path), how)[1]
    assert "copy.bin" in message
    assert ("checksum" in message) if how == "digest" else ("refused by the test" in message)


def _peer_dies(rank: int, world: int, tmp: str, late: bool) -> str:
    d = _setup_dir(tmp, rank, 1 << 20)
    dist.barrier()  # every rank's process group is up: a rank gone during its set-up breaks others'
    if rank == 0:
        os._exit(3)  # the source is gone before sending anything
    if late:  # gone before the receive is even posted: gloo may refuse to post it
        time.sleep(1.0)
    moves = [FileMove(0, 1, f"{tmp}/r0/own.bin", f"{tmp}/r1/copy.bin")]
    with pytest.raises(CheckpointingError) as info:
        move_files(moves, timeout=10)
    assert sorted(os.listdir(d)) == ["own.bin"]
    return str(info.value)


@pytest.mark.parametrize("late", [False, True])
def test_dead_peer_gives_an_error_not_a_hang(tmp_path: Path, late: bool) -> None:
    message = run_ranks(_peer_dies, 2, str(tmp_path), late, allow_crash={0}, timeout=60)[1]
    assert "copy.bin" in message or "rank 0" in message


def _one_destination_gone(rank: int, world: int, tmp: str) -> str:
    _setup_dir(tmp, rank, 1 << 16)
    dist.barrier()  # every rank's process group is up: a rank gone during its set-up breaks others'
    if rank == 1:
        os._exit(3)  # gone before the call
    time.sleep(1.0)
    moves = [
        FileMove(0, 1, f"{tmp}/r0/own.bin", f"{tmp}/r1/copy.bin"),
        FileMove(0, 2, f"{tmp}/r0/own.bin", f"{tmp}/r2/copy.bin"),
    ]
    start = time.monotonic()
    try:
        move_files(moves, timeout=60)
        outcome = "ok"
    except CheckpointingError as e:
        outcome = str(e)
    return f"{time.monotonic() - start:.1f}|{outcome}"


def test_a_gone_destination_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """Rank 0 sends to rank 1 (gone) and to rank 2: rank 2 gets its file at once, rank 0 raises
    naming the move to rank 1; nobody waits for the timeout."""
    results = run_ranks(_one_destination_gone, 3, str(tmp_path), allow_crash={1}, timeout=120)
    seconds = {r: float(results[r].split("|")[0]) for r in (0, 2)}
    assert results[2].endswith("|ok"), results
    assert "own.bin to rank 1: failed" in results[0], results
    assert max(seconds.values()) < 30, results
    own = (tmp_path / "r0" / "own.bin").read_bytes()
    assert (tmp_path / "r2" / "copy.bin").read_bytes() == own


def _uninvolved(rank: int, world: int) -> int:
    stats = move_files([], timeout=5)
    dist.barrier()
    return stats.sent_bytes


def test_empty_plan_is_a_no_op(tmp_path: Path) -> None:
    assert run_ranks(_uninvolved, 2) == [0, 0]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(CheckpointingError, match="bucket_bytes"):
        move_files([], bucket_bytes=0)


def test_mapping_cache_reuses_rechecks_and_lets_go(tmp_path: Path) -> None:
    cache = peers.MappingCache()
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 8192)
    b.write_bytes(b"y" * 4096)
    first = cache.map(str(a), 8192, writable=False)
    os.replace(a, tmp_path / "renamed.bin")  # circulating files change names, not inodes
    assert cache.map(str(tmp_path / "renamed.bin"), 8192, writable=True)[0] is first[0]
    os.truncate(tmp_path / "renamed.bin", 4096)  # a different size is mapped anew
    again = cache.map(str(tmp_path / "renamed.bin"), 4096, writable=True)
    assert again[0] is not first[0] and first[0].closed and len(again[0]) == 4096
    cache.map(str(b), 4096, writable=True)
    assert len(cache) == 2
    b.unlink()
    cache.retain([tmp_path / "renamed.bin", b])  # b is gone: its mapping must not pin its pages
    assert len(cache) == 1 and not again[0].closed
    cache.close()
    assert len(cache) == 0 and again[0].closed
