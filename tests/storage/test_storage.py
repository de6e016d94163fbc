"""tierpoint.storage on local paths: whole-file writes, atomic publish, markers, listing, clear errors.

(Object-store behaviour, multipart and retries, is tested against a real S3 server in
tests/dcp/test_s3.py.)
"""

from __future__ import annotations

import os
import time

import pytest

from tierpoint import storage
from tierpoint.errors import CheckpointingError

from ..mounts import small_tmpfs


def test_write_file_writes_views_back_to_back(tmp_path):
    big = os.urandom(3 << 20)
    views = [b"head", memoryview(big), bytearray(b"tail"), b"", memoryview(b"x" * 10)[2:5]]
    n = storage.write_file(tmp_path / "f", views)
    assert n == 4 + len(big) + 4 + 3
    assert (tmp_path / "f").read_bytes() == b"head" + big + b"tail" + b"xxx"


def test_write_file_replaces_existing_content(tmp_path):
    (tmp_path / "f").write_bytes(b"a much longer old content")
    storage.write_file(tmp_path / "f", [b"new"])
    assert (tmp_path / "f").read_bytes() == b"new"


def test_many_small_views_take_the_gathered_path(tmp_path):
    views = [bytes([i % 256]) * (i % 7) for i in range(3000)]
    storage.write_file(tmp_path / "f", views)
    assert (tmp_path / "f").read_bytes() == b"".join(views)


def test_publish_is_atomic_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "d" / ".metadata"
    storage.makedirs(tmp_path / "d")
    storage.publish(target, b"v1")
    storage.publish(target, b"v2")
    assert target.read_bytes() == b"v2"
    assert storage.listdir(tmp_path / "d") == [".metadata"]


def test_a_publish_that_fills_the_disk_leaves_no_temporary_and_the_old_content(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as small:
        target = small / ".metadata"
        storage.publish(target, b"v1")
        with pytest.raises(CheckpointingError, match="No space left"):
            storage.publish(target, os.urandom(2 << 20))
        assert storage.listdir(small) == [".metadata"]  # no .metadata.tmp holding the space
        assert target.read_bytes() == b"v1"
        storage.publish(target, b"v2")  # the space is back
        assert target.read_bytes() == b"v2"


def test_touch_remove_exists_listdir(tmp_path):
    storage.makedirs(tmp_path / "a" / "b")
    marker = storage.join(tmp_path / "a" / "b", ".unfinished-0")
    storage.touch(marker)
    assert storage.exists(marker)
    assert storage.listdir(tmp_path / "a") == ["b"]
    assert storage.remove(marker) is True
    assert storage.remove(marker) is False  # missing is fine by default
    with pytest.raises(CheckpointingError, match=".unfinished-0"):
        storage.remove(marker, missing_ok=False)
    assert storage.listdir(tmp_path / "missing") == []
    storage.remove_dir_if_empty(tmp_path / "a" / "b")
    assert not (tmp_path / "a" / "b").exists()


def test_file_urls_are_local(tmp_path):
    url = f"file://{tmp_path}/x"
    assert storage.is_local(url)
    storage.write_file(url, [b"abc"])
    assert storage.read_bytes(tmp_path / "x") == b"abc"


def test_unwritable_directory_names_the_path(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointingError, match=r"file/ckpt.*ENOTDIR"):
        storage.makedirs(tmp_path / "file" / "ckpt")
    with pytest.raises(CheckpointingError, match=r"file/x.distcp.*ENOTDIR"):
        storage.write_file(tmp_path / "file" / "x.distcp", [b"abc"])


def test_full_disk_names_the_file(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    os.symlink("/dev/full", tmp_path / "__0_0.distcp")
    with pytest.raises(CheckpointingError, match=r"__0_0.distcp.*ENOSPC"):
        storage.write_file(tmp_path / "__0_0.distcp", [os.urandom(1 << 16)])


def test_parallel_writes_report_the_failing_file(tmp_path):
    ok = [(str(tmp_path / f"f{i}"), [os.urandom(1000)]) for i in range(5)]
    assert storage.write_files_parallel(ok, threads=3) == [1000] * 5
    assert sorted(os.listdir(tmp_path)) == [f"f{i}" for i in range(5)]
    bad = [*ok[:2], (str(tmp_path / "nodir" / "f"), [b"x"])]
    with pytest.raises(CheckpointingError, match=r"nodir/f.*ENOENT"):
        storage.write_files_parallel(bad, threads=2)


def test_retries_only_transient_errors():
    calls = []

    def flaky(fail: list[BaseException]):
        calls.append(1)
        if fail:
            raise fail.pop(0)
        return "ok"

    fast = storage.UploadOptions(attempts=3, backoff=0.0)
    assert (
        storage._with_retries("x", fast, flaky, [ConnectionError("reset"), TimeoutError()]) == "ok"
    )
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(PermissionError):
        storage._with_retries("x", fast, flaky, [PermissionError("denied")])
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ConnectionError):
        storage._with_retries("x", fast, flaky, [ConnectionError()] * 5)
    assert len(calls) == 3


def test_a_deadline_ends_retries_on_the_threads_given_its_work_and_grace_lets_clean_up_run():
    from concurrent.futures import ThreadPoolExecutor

    from tierpoint.storage import retries

    calls: list[float] = []

    def refused() -> None:
        calls.append(time.monotonic())
        raise ConnectionError("refused")

    slow = storage.UploadOptions(attempts=5, backoff=0.4)  # 0.4 + 0.8 + 1.6 + 3.2 s of waits
    start = time.monotonic()
    with retries.deadline(0.5), ThreadPoolExecutor(1) as pool:  # as a multipart upload's parts
        work = retries.under_this_deadline(lambda: retries.with_retries("x", slow, refused))
        with pytest.raises(TimeoutError, match="out of time"):
            pool.submit(work).result()
    assert len(calls) == 2 and time.monotonic() - start < 4  # not the 6 s of waits
    calls.clear()
    with retries.deadline(0.0):
        with pytest.raises(TimeoutError, match="before the first try"):
            retries.with_retries("x", slow, refused)
        assert calls == []
        with retries.grace(1.0), pytest.raises(TimeoutError, match="out of time"):
            retries.with_retries("x", slow, refused)  # (an upload's abort, after the deadline)
        assert len(calls) == 2


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftpx://host/run", "unknown URL scheme 'ftpx'"),
        ("s3://", "names no bucket or host after s3://"),
        ("s3:///run", "names no bucket or host after s3://"),
        ("s3:/bucket/run", "one slash after s3:.*write s3://bucket/run"),
    ],
)
def test_a_url_no_store_serves_is_refused_by_name(url, message):
    """Such URLs were taken, then failed at every save (or, ``s3:/bucket``, ``s3://``, wrote
    into a local directory named ``s3:``)."""
    with pytest.raises(CheckpointingError, match=f"persistent_dir {url!r}.*{message}"):
        storage.checkpoint_path(url, "persistent_dir")


def test_paths_and_urls_that_stores_serve_are_kept():
    for path in ("/tmp/run", "run", "file:///tmp/run", "s3://bucket", "s3://bucket/run", "c:/x"):
        assert storage.checkpoint_path(path) == path


def test_storage_options_must_be_a_mapping():
    assert storage.options_dict(None) == {} and storage.options_dict({"a": 1}) == {"a": 1}
    with pytest.raises(CheckpointingError, match="storage_options must be a mapping.*got str"):
        storage.options_dict("endpoint=http://x")


def test_urls_of_stores_whose_paths_start_at_the_root_are_kept():
    """``memory:///run`` and ``hdfs:///run`` (the default name node) name no bucket or host, and
    need none: they were refused as if they were ``s3://``."""
    for url in ("memory:///run", "hdfs:///user/run", "memory://run"):
        assert storage.checkpoint_path(url) == url


def test_a_file_url_with_one_slash_is_told_the_url_that_names_the_same_path():
    """``file:/tmp/run`` was told to write ``file://tmp/run``: a relative path ``tmp/run``."""
    with pytest.raises(CheckpointingError, match="write file:///tmp/run$"):
        storage.checkpoint_path("file:/tmp/run")
