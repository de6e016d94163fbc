"""Durable writes past the page cache: exact content whatever the views' alignment, safe fallbacks."""

from __future__ import annotations

import errno
import mmap
import os
import tempfile

import pytest

from tierpoint import storage
from tierpoint.storage import direct as direct_write

pytestmark = pytest.mark.skipif(not direct_write._O_DIRECT, reason="no O_DIRECT on this system")


def _views() -> list:
    """Aligned and unaligned, writable and read-only, tiny and large pieces; more than MIN_BYTES of
    them can go to the device straight from memory."""
    aligned = mmap.mmap(-1, 20 << 20)
    aligned[:] = os.urandom(1 << 20) * 20
    unaligned = bytearray(os.urandom(3 << 20)) * 3
    return [
        memoryview(aligned),  # page-aligned memory at file offset 0: straight to the device
        b"head",
        memoryview(unaligned)[1:],
        b"",
        memoryview(aligned)[: 8 << 20],  # aligned memory at an unaligned offset: bounced
        bytes(range(256)) * 17,
        memoryview(aligned)[4096 : 4096 + 12345],
    ]


@pytest.fixture
def disk_dir(tmp_path):
    if not direct_write.suitable(str(tmp_path / "probe"), _views()):
        pytest.skip("tmp_path is not on a file system that takes O_DIRECT")
    return tmp_path


def test_content_is_the_views_back_to_back(disk_dir):
    views = _views()
    path = str(disk_dir / "f.bin")
    assert direct_write.suitable(path, views)
    n = direct_write.write_file(path, views)
    expected = b"".join(bytes(v) for v in views)
    assert n == len(expected) == os.path.getsize(path)
    with open(path, "rb") as f:
        assert f.read() == expected


@pytest.mark.parametrize(
    "size", [direct_write.MIN_BYTES, direct_write.MIN_BYTES + 1, (40 << 20) - 7]
)
def test_aligned_memory_goes_straight_to_the_device(disk_dir, size):
    data = mmap.mmap(-1, size)
    data[:] = os.urandom(size)
    path = str(disk_dir / "g.bin")
    assert direct_write.write_file(path, [memoryview(data), b"tail"]) == size + 4
    with open(path, "rb") as f:
        assert f.read() == bytes(data) + b"tail"


def test_storage_write_file_uses_it_and_matches_buffered(disk_dir):
    views = _views()
    direct = storage.write_file(str(disk_dir / "a.bin"), views)
    plain = storage.write_file(str(disk_dir / "b.bin"), views, fsync=False)  # page cache path
    assert direct == plain
    with open(disk_dir / "a.bin", "rb") as a, open(disk_dir / "b.bin", "rb") as b:
        assert a.read() == b.read()


def test_a_file_mapped_read_only_is_bounced_to_the_device(disk_dir):
    """A committed file's bytes mapped read-only (the worker writing a local part into the
    persistent tier): worth writing past the page cache even at unaligned offsets."""
    source = disk_dir / "source.bin"
    source.write_bytes(os.urandom(1 << 20) * 24)
    with open(source, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    views = [b"record head", memoryview(mapped)[100 : (20 << 20) + 7], b"tail"]
    path = str(disk_dir / "copy.bin")
    assert direct_write.suitable(path, views)
    assert direct_write.write_file(path, views) == sum(len(v) for v in views)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(v) for v in views)
    del views
    mapped.close()


def test_not_used_for_small_files_ram_disks_or_when_turned_off(disk_dir, monkeypatch):
    big = _views()
    small = mmap.mmap(-1, direct_write.MIN_BYTES - direct_write.ALIGN)
    assert not direct_write.suitable(str(disk_dir / "x"), [memoryview(small)])
    live = bytearray(direct_write.MIN_BYTES * 2)  # unaligned memory: the page cache does as well
    assert not direct_write.suitable(str(disk_dir / "x"), [memoryview(live)[1:]])
    if os.path.isdir("/dev/shm"):
        with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            assert not direct_write.suitable(os.path.join(shm, "x"), big)
    monkeypatch.setenv("TIERPOINT_DIRECT_IO", "0")
    assert not direct_write.suitable(str(disk_dir / "x"), big)


def test_a_refusing_file_system_is_finished_buffered_and_remembered(disk_dir, monkeypatch):
    """Some file systems accept O_DIRECT at open but refuse the writes (EINVAL)."""
    real_pwrite = os.pwrite
    refusals = []

    def pwrite(fd, data, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct_write._O_DIRECT:
            refusals.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(direct_write, "_verdicts", {})
    views = _views()
    path = str(disk_dir / "r.bin")
    assert direct_write.suitable(path, views)
    assert direct_write.write_file(path, views) == sum(len(memoryview(v)) for v in views)
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(v) for v in views)
    assert refusals == [0]
    assert not direct_write.suitable(path, views)


def test_errors_leave_the_reason(disk_dir):
    with pytest.raises(FileNotFoundError):
        direct_write.write_file(
            str(disk_dir / "missing" / "f.bin"), [bytes(direct_write.MIN_BYTES)]
        )
