"""The persistent tier on s3:// against a real S3-compatible server (moto, 127.0.0.1): multipart
uploads with parts in parallel and retried, markers and commit on object storage, sync and async
saves from several ranks, get_latest_complete_checkpoint on URLs, torch's fsspec reader loads it."""

from __future__ import annotations

import asyncio
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures
from tierpoint import storage
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import async_save, get_latest_complete_checkpoint, save, step_path
from tierpoint.dcp.writer import Writer
from tierpoint.errors import CheckpointingError
from tierpoint.testing import run_ranks

from .file_names import untokened

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

SMALL_PARTS = storage.UploadOptions(part_size=5 << 20, concurrency=4, attempts=4, backoff=0.05)


def _fsspec_reader(url: str, options: dict):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **options)


def _ranks_save_to_s3(rank: int, world: int, base: str, options: dict) -> list:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(world * 3 << 20, generator=torch.Generator().manual_seed(5))  # 12 MiB a rank
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 1}
    save(state, step_path(base, 1), storage_options=options, upload=SMALL_PARTS)
    with AsyncCallsQueue() as queue:
        future = async_save(
            state, step_path(base, 2), queue=queue, storage_options=options, upload=SMALL_PARTS
        )
        with torch.no_grad():
            state["w"].mul_(0)  # after the snapshot: the checkpoint keeps the old values
        future.result(timeout=180)
    latest = get_latest_complete_checkpoint(base, storage_options=options)
    out = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "step": 0}
    dcp.load(out, storage_reader=_fsspec_reader(latest, options))
    names = storage.listdir(latest, options)
    return [latest, bool(torch.equal(out["w"].full_tensor(), full)), out["step"], names]


def test_ranks_save_sync_and_async_to_s3(s3_bucket):  # noqa: F811
    base, options = s3_bucket
    base = f"{base}/run"
    assert get_latest_complete_checkpoint(base, storage_options=options) is None  # a first run
    results = run_ranks(_ranks_save_to_s3, 2, base, options, timeout=300)
    for latest, equal, step, names in results:
        assert latest == step_path(base, 2) and equal and step == 1
        assert untokened(names) == [  # markers gone
            ".checksums-0.json",
            ".checksums-1.json",
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    assert get_latest_complete_checkpoint(base, storage_options=options) == step_path(base, 2)


class FlakyParts:
    """Wraps one real s3fs client call: the first upload of part 2 fails with a connection reset;
    records how many part uploads were in flight at once."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.original = fs._call_s3
        self.attempts: dict[int, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, method, *args, **kwargs):
        if method != "upload_part":
            return await self.original(method, *args, **kwargs)
        number = kwargs["PartNumber"]
        self.attempts[number] = self.attempts.get(number, 0) + 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # let the other parts start
            if number == 2 and self.attempts[number] == 1:
                raise ConnectionResetError("injected: connection reset during part 2")
            return await self.original(method, *args, **kwargs)
        finally:
            self.in_flight -= 1


def test_multipart_parts_go_in_parallel_and_a_failed_part_is_retried(s3_bucket):  # noqa: F811
    base, options = s3_bucket
    fs, _ = storage.filesystem(base, options)
    flaky = FlakyParts(fs)
    fs._call_s3 = flaky
    try:
        state = {"a": torch.randn(4 << 20), "n": 3}  # one 16 MiB file: 4 parts of 5 MiB
        save(state, step_path(base, 1), storage_options=options, thread_count=1, upload=SMALL_PARTS)
    finally:
        del fs._call_s3
    assert flaky.attempts == {1: 1, 2: 2, 3: 1, 4: 1}
    assert flaky.max_in_flight >= 2
    out = {"a": torch.zeros(4 << 20), "n": 0}
    dcp.load(out, storage_reader=_fsspec_reader(step_path(base, 1), options))
    assert torch.equal(out["a"], state["a"]) and out["n"] == 3


def test_a_failed_upload_is_aborted_and_reported(s3_bucket):  # noqa: F811
    base, options = s3_bucket
    fs, _ = storage.filesystem(base, options)
    original = fs._call_s3

    async def denied(method, *args, **kwargs):
        if method == "upload_part" and kwargs["PartNumber"] == 2:
            raise PermissionError("injected: access denied")
        return await original(method, *args, **kwargs)

    fs._call_s3 = denied
    try:
        with pytest.raises(CheckpointingError, match=r"big.*access denied"):
            storage.write_file(
                f"{base}/big", [bytes(11 << 20)], storage_options=options, upload=SMALL_PARTS
            )
    finally:
        del fs._call_s3
    bucket = base[len("s3://") :]
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    assert not uploads.get("Uploads")
    assert not storage.exists(f"{base}/big", options)


def test_missing_bucket_fails_clearly(s3_server):  # noqa: F811
    options = {"endpoint_url": s3_server}
    url = "s3://no-such-bucket-tierpoint/run/step-1"
    with pytest.raises(CheckpointingError, match="no-such-bucket-tierpoint"):
        save({"a": torch.ones(4)}, url, storage_options=options)
    # A typo in the bucket must not read as "no checkpoint yet" (training would start over).
    with pytest.raises(
        CheckpointingError, match="bucket 'no-such-bucket-tierpoint' does not exist"
    ):
        get_latest_complete_checkpoint("s3://no-such-bucket-tierpoint/run", storage_options=options)


class CountingCalls:
    """Wraps the real s3fs client: counts its requests by method."""

    def __init__(self, fs) -> None:
        self.original = fs._call_s3
        self.counts: dict[str, int] = {}

    async def __call__(self, method, *args, **kwargs):
        self.counts[method] = self.counts.get(method, 0) + 1
        return await self.original(method, *args, **kwargs)


def test_a_step_a_larger_world_left_uncommitted_is_saved_into_cleanly(s3_bucket):  # noqa: F811
    """A save killed after its commit, by 4 ranks: its .metadata, data files and markers stay. One
    rank saves into the step again: every stale marker and file goes (its worker clears them, with
    one listing), and the step is complete and holds the new values."""
    base, options = s3_bucket
    path = step_path(base, 1)
    for name in [".metadata", ".unfinished-2", ".unfinished-3", "__3_0.old.distcp"]:
        storage.write_file(f"{path}/{name}", [b"stale"], storage_options=options)
    fs, _ = storage.filesystem(base, options)
    fs._call_s3 = counting = CountingCalls(fs)
    try:
        with AsyncCallsQueue() as queue:
            future = async_save(
                {"a": torch.arange(5.0)}, path, queue=queue, storage_options=options
            )
            future.result(timeout=120)
    finally:
        del fs._call_s3
    assert untokened(storage.listdir(path, options)) == [
        ".checksums-0.json",
        ".metadata",
        "__0_0.distcp",
    ]
    assert get_latest_complete_checkpoint(base, storage_options=options) == path
    out = {"a": torch.zeros(5)}
    dcp.load(out, storage_reader=_fsspec_reader(path, options))
    assert torch.equal(out["a"], torch.arange(5.0))
    # Listed once in this process, at set-up (a .metadata with markers: not complete), which
    # removes the stale .metadata; the worker clears the stale markers and data files (after its
    # own marker), so the commit lists nothing and removes only this rank's marker.
    assert counting.counts.get("list_objects_v2", 0) == 1, counting.counts
    assert counting.counts.get("delete_object", 0) == 1, counting.counts


def test_an_async_save_to_s3_leaves_the_marker_to_the_worker(s3_bucket):  # noqa: F811
    """The training thread lists the step (one request) and writes nothing: the worker makes the
    rank's marker before the data and clears the directory, so the commit lists nothing: it writes
    .metadata and removes the marker (two requests)."""
    base, options = s3_bucket
    path = step_path(base, 1)
    fs, _ = storage.filesystem(base, options)
    with AsyncCallsQueue() as queue:
        fs._call_s3 = counting = CountingCalls(fs)
        try:
            future = async_save(
                {"a": torch.arange(5.0)}, path, queue=queue, storage_options=options
            )
            assert counting.counts == {"list_objects_v2": 1}, counting.counts
            counting.counts.clear()
            future.result(timeout=120)
        finally:
            del fs._call_s3
        assert counting.counts == {"put_object": 1, "delete_objects": 1}, counting.counts
    names = untokened(storage.listdir(path, options))
    assert names == [".checksums-0.json", ".metadata", "__0_0.distcp"]
    assert get_latest_complete_checkpoint(base, storage_options=options) == path


def _late_coordinator(rank: int, base: str, options: dict, flow: str) -> None:
    """Rank 0 pickles a large value first, so rank 1 writes its files (and its marker) before the
    coordinator's job lists the step."""
    state: dict = {f"t{rank}": torch.arange(1000.0) + rank}
    if rank == 0:
        state["extra"] = list(range(2_000_000))
    path = step_path(base, 1)
    if flow == "torch":
        dcp.save(state, storage_writer=Writer(path, storage_options=options, thread_count=1))
    elif flow == "sync":
        save(state, path, storage_options=options, thread_count=1)
    else:
        with AsyncCallsQueue() as queue:
            async_save(state, path, queue=queue, storage_options=options).result(timeout=60)


def _torch_flow(rank: int, world: int, base: str, options: dict) -> None:
    _late_coordinator(rank, base, options, "torch")


def test_torch_s_own_flow_keeps_every_rank_s_files(s3_bucket):  # noqa: F811
    """In torch's flow every rank draws its own file token: the coordinator must not take the
    other ranks' files of the same save for an earlier save's."""
    base, options = s3_bucket
    run_ranks(_torch_flow, 2, base, options, timeout=200)
    out = {"t0": torch.zeros(1000), "t1": torch.zeros(1000), "extra": None}
    dcp.load(out, storage_reader=_fsspec_reader(step_path(base, 1), options), no_dist=True)
    assert torch.equal(out["t1"], torch.arange(1000.0) + 1)


def _lost_during_commit(rank: int, world: int, base: str, options: dict, flow: str) -> str:
    if rank == 1:
        from tierpoint.dcp import commit

        agree = commit.agree

        def die(group: object, use_dist: bool, what: str, error: object) -> None:
            if what.startswith("committing"):
                os._exit(17)  # this rank's node is lost while the coordinator commits
            agree(group, use_dist, what, error)

        commit.agree = die
    try:
        _late_coordinator(rank, base, options, flow)
        return "saved"
    except CheckpointingError as e:
        return f"failed: {e}"


@pytest.mark.parametrize("flow", ["sync", "async"])
def test_a_rank_lost_during_the_commit_leaves_the_step_unfinished(s3_bucket, flow):  # noqa: F811
    """The coordinator's job clears only markers of ranks this save does not have: rank 1's stays
    until its commit, so with rank 1 lost the written .metadata never makes the step complete."""
    base, options = s3_bucket
    outcome = run_ranks(
        _lost_during_commit, 2, base, options, flow, timeout=200, pg_timeout=20, allow_crash={1}
    )
    assert outcome[0].startswith("failed"), outcome
    assert ".unfinished-1" in storage.listdir(step_path(base, 1), options)
    assert get_latest_complete_checkpoint(base, storage_options=options) is None


def _resave_with_the_coordinator_lost(rank: int, world: int, base: str, options: dict) -> str:
    state = {f"t{rank}": torch.arange(1000.0) + rank}
    path = step_path(base, 1)
    save(state, path, storage_options=options, thread_count=1)
    if rank == 0:
        from tierpoint.dcp import directory

        def lost(*args: object, **kwargs: object) -> None:
            os._exit(17)  # the coordinator's node is lost before its job makes its marker

        directory.make_marker = lost
    try:
        save(state, path, storage_options=options, thread_count=1, overwrite=True)
        return "saved"
    except CheckpointingError as e:
        return f"failed: {e}"


def test_a_resave_whose_coordinator_is_lost_leaves_no_checkpoint_there(s3_bucket):  # noqa: F811
    """overwrite=True un-commits the step at set-up, before any rank can write: with the
    coordinator lost, the other rank's failed save leaves no step that counts as complete."""
    base, options = s3_bucket
    outcome = run_ranks(
        _resave_with_the_coordinator_lost, 2, base, options, timeout=200, pg_timeout=20,
        allow_crash={0},
    )  # fmt: skip
    assert outcome[1].startswith("failed"), outcome
    assert get_latest_complete_checkpoint(base, storage_options=options) is None


def test_listing_a_prefix_names_what_is_directly_under_it_page_after_page(s3_bucket):  # noqa: F811
    base, options = s3_bucket
    fs, _ = storage.filesystem(base, options)
    bucket = base[len("s3://") :]
    fs.pipe({f"{bucket}/run/step-1/f{k:04d}": b"x" for k in range(1003)})  # two pages
    fs.pipe({f"{bucket}/run/step-2/.metadata": b"x", f"{bucket}/run/top": b"x"})
    names = storage.listdir(f"{base}/run/step-1", options)
    assert names == [f"f{k:04d}" for k in range(1003)]
    assert storage.listdir(f"{base}/run", options) == ["step-1", "step-2", "top"]
    fs._call_s3 = counting = CountingCalls(fs)
    try:
        assert storage.listdir(f"{base}/run/step-3", options) == []  # a new step directory
    finally:
        del fs._call_s3
    assert counting.counts == {"list_objects_v2": 1}, counting.counts
    with pytest.raises(CheckpointingError, match="bucket 'tierpoint-missing' does not exist"):
        storage.listdir("s3://tierpoint-missing/run", options)


def test_names_with_pattern_characters_remove_only_themselves(s3_bucket):  # noqa: F811
    """A step under ``run[1]``: its commit removes its own markers (a name is not a pattern), and
    nothing of the run ``run1`` that the pattern would match (a step kept incomplete by its
    coordinator's marker, after a .metadata upload of unknown outcome landed late)."""
    base, options = s3_bucket
    other = step_path(f"{base}/run1", 1)
    storage.write_file(f"{other}/.metadata", [b"late"], storage_options=options)
    storage.write_file(f"{other}/.unfinished-0", [b""], storage_options=options)
    mine = step_path(f"{base}/run[1]", 1)
    storage.write_file(f"{mine}/.unfinished-3", [b""], storage_options=options)  # a stale marker
    save({"a": torch.arange(5.0)}, mine, storage_options=options)
    assert storage.listdir(other, options) == [".metadata", ".unfinished-0"]
    assert get_latest_complete_checkpoint(f"{base}/run1", storage_options=options) is None
    assert untokened(storage.listdir(mine, options)) == [
        ".checksums-0.json",
        ".metadata",
        "__0_0.distcp",
    ]
    assert get_latest_complete_checkpoint(f"{base}/run[1]", storage_options=options) == mine


def test_a_marker_the_store_refuses_to_remove_fails_the_save(s3_bucket):  # noqa: F811
    """A bulk removal answered with a per-key error (a bucket policy that denies it) is an error,
    not a save reported committed whose step never becomes complete."""
    base, options = s3_bucket
    path = step_path(base, 1)
    storage.write_file(f"{path}/.unfinished-1", [b""], storage_options=options)  # a stale marker
    fs, _ = storage.filesystem(base, options)
    original = fs._call_s3

    async def deny_markers(method, *args, **kwargs):
        if method != "delete_objects":
            return await original(method, *args, **kwargs)
        wanted = kwargs["Delete"]["Objects"]
        denied = [o["Key"] for o in wanted if "/.unfinished-" in o["Key"]]
        rest = [o for o in wanted if o["Key"] not in denied]
        reply = {}
        if rest:
            delete = dict(kwargs["Delete"], Objects=rest)
            reply = await original(method, *args, **dict(kwargs, Delete=delete))
        errors = [{"Key": k, "Code": "AccessDenied", "Message": "denied"} for k in denied]
        return {**reply, "Errors": errors}

    fs._call_s3 = deny_markers
    try:
        with pytest.raises(CheckpointingError, match=r"unfinished markers.*AccessDenied denied"):
            save({"a": torch.arange(5.0)}, path, storage_options=options)
    finally:
        del fs._call_s3
    assert get_latest_complete_checkpoint(base, storage_options=options) is None


def test_the_steps_of_a_run_are_listed_several_at_a_time(s3_bucket):  # noqa: F811
    """Finding the latest step lists each step directory: on an object store several at a time
    (each is a round trip), with the same answer: the newest committed step without markers."""
    base, options = s3_bucket
    fs, _ = storage.filesystem(base, options)
    bucket = base[len("s3://") :]
    objects = {f"{bucket}/run/step-{s}/.metadata": b"x" for s in range(1, 13)}
    objects[f"{bucket}/run/step-12/.unfinished-1"] = b""  # committed, a rank still marked
    objects[f"{bucket}/run/step-13/__0_0.t.distcp"] = b"x"  # never committed
    fs.pipe(objects)
    original = fs._call_s3
    listing = {"now": 0, "most": 0}

    async def slow_listings(method, *args, **kwargs):
        if method != "list_objects_v2":
            return await original(method, *args, **kwargs)
        listing["now"] += 1
        listing["most"] = max(listing["most"], listing["now"])
        try:
            await asyncio.sleep(0.02)  # a store's round trip
            return await original(method, *args, **kwargs)
        finally:
            listing["now"] -= 1

    fs._call_s3 = slow_listings
    try:
        latest = get_latest_complete_checkpoint(f"{base}/run", storage_options=options)
    finally:
        del fs._call_s3
    assert latest == step_path(f"{base}/run", 11)
    assert listing["most"] > 1, listing
