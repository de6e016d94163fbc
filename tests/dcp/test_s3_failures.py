"""The persistent tier on s3:// when the object store misbehaves: a real S3-compatible server (moto,
127.0.0.1) behind a proxy process that a test stops, kills or makes answer with errors
(:class:`tests.dcp.s3_server.FaultyEndpoint`). The tests assert that:

- a server that stops answering (SIGSTOP) in the middle of a save fails ``dcp.save``, an async
  save's ``result()``, ``get_latest_complete_checkpoint`` and ``dcp.load`` with a
  ``CheckpointingError`` naming the URL within seconds: each try of a request is bounded by the
  client's timeouts and ``UploadOptions.request_timeout`` (sending a part to a server that reads
  nothing more is bounded too), and tried ``attempts`` times; the previous step stays the latest
  and loads once the server answers again;
- a server killed in the middle of an upload: a clear error, no ``.metadata``, the multipart upload
  aborted once the server is back (the abort is retried like any request), the previous step still
  the latest and loadable;
- a ``.metadata`` upload that the server applies after the client gave up on it never makes the
  failed step look complete;
- 500 / 503 answers to UploadPart are retried: with fewer failures than attempts the save succeeds;
  with more, it fails clearly after exactly ``attempts`` tries of each part (no hidden botocore or
  s3fs retries multiplying them) and the upload is aborted; retries the user configures for the
  client (``config_kwargs``) win;
- wrong credentials, a missing bucket and an endpoint that refuses connections give a
  ``CheckpointingError`` naming the URL within seconds, and lose nothing;
- a truncated ``.distcp`` object or a garbage ``.metadata`` object is a ``CorruptCheckpointError``
  naming the object, and leaves the destination state as it was;
- data objects of an earlier save into the same step that cannot be deleted (no permission) are
  left with a WARNING; the save still commits.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.dcp import s3_server as servers
from tests.dcp.s3_server import FaultyEndpoint
from tierpoint import storage
from tierpoint.asyncsave import AsyncCallsQueue
from tierpoint.dcp import async_save, get_latest_complete_checkpoint, load, save, step_path
from tierpoint.errors import CheckpointingError, CorruptCheckpointError
from tierpoint.testing import free_port, run_ranks

from .file_names import untokened

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# The fixtures these tests use, by name.
s3_server = servers.s3_server
s3_bucket = servers.s3_bucket
faulty_endpoint = servers.faulty_endpoint

CLIENT = {"connect_timeout": 1, "read_timeout": 1}
"""The user's client timeouts (s3fs's defaults are 5 s and 15 s): they bound each try of a small
request."""

UPLOAD = storage.UploadOptions(
    part_size=16 << 20, concurrency=4, attempts=2, backoff=0.05, request_timeout=2
)
"""Parts larger than the loopback socket buffers: sending one to a stopped server blocks."""

BIG = 8 << 20  # float32 elements: 32 MiB, two full parts of UPLOAD (and the step value)


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


def _within(limit: float, fn: Callable[[], Any]) -> Outcome:
    """``fn()`` on a thread; the test fails if it has not returned within ``limit`` seconds."""
    outcome = Outcome()

    def run() -> None:
        start = time.monotonic()
        try:
            outcome.value = fn()
        except BaseException as e:  # noqa: BLE001 - examined by the test
            outcome.error = e
        outcome.seconds = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} still waiting after {limit} s: it hangs")
    return outcome


def _all_within(limit: float, calls: dict[str, Callable[[], Any]]) -> dict[str, Outcome]:
    """The calls at once, each on its own thread, each bounded as :func:`_within` bounds one."""
    found: dict[str, Outcome] = {}
    threads = [
        threading.Thread(target=lambda k=k, f=f: found.update({k: _within(limit, f)}))
        for k, f in calls.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(found) == set(calls), f"{set(calls) - set(found)} still waiting: they hang"
    return found


def _warm_up(queue: AsyncCallsQueue, base: str, options: dict) -> None:
    """Start ``queue``'s worker and have it use the store through ``options`` once (one small
    object, under ``base``/warm-up, no step of it), before a test times a save through it: the
    worker's start-up and its first use of the client (imports, the service model: seconds of
    CPU) are not what the test bounds, and on a machine loaded by tests running in parallel they
    took most of that bound."""
    queue.wait_ready()
    warm = async_save(
        {"x": torch.zeros(4)}, f"{base}/warm-up", queue=queue, storage_options=options
    )
    warm.result(timeout=120)


def _after_new_parts(endpoint: FaultyEndpoint, action: Callable[[], None]) -> threading.Thread:
    """Runs ``action`` as soon as ``endpoint`` receives an UploadPart request (from now on)."""
    seen = endpoint.counts()["upload_part"]

    def watch() -> None:
        deadline = time.monotonic() + 30
        while endpoint.counts()["upload_part"] <= seen and time.monotonic() < deadline:
            time.sleep(0.005)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _state(seed: int, numel: int = BIG) -> dict[str, Any]:
    return {"w": torch.randn(numel, generator=torch.Generator().manual_seed(seed)), "step": seed}


def _through(endpoint: FaultyEndpoint | str, **client: Any) -> dict[str, Any]:
    url = endpoint if isinstance(endpoint, str) else endpoint.url
    return {"endpoint_url": url, "config_kwargs": {**CLIENT, **client}}


def _first_step(base: str, options: dict, numel: int = BIG) -> dict[str, Any]:
    """Save step 1 straight to the server (no faults): what a failed later save must not lose."""
    first = _state(1, numel)
    save(first, step_path(base, 1), storage_options=options)
    return first


def _second_step_within(
    limit: float, base: str, options: dict, upload: storage.UploadOptions
) -> Outcome:
    """Save step 2 (one writer thread) through ``options``, bounded by ``limit`` seconds."""
    return _within(
        limit,
        lambda: save(
            _state(2), step_path(base, 2), storage_options=options, thread_count=1, upload=upload
        ),
    )


def _assert_latest_loads(base: str, options: dict, state: dict[str, Any]) -> None:
    """The newest complete step under ``base`` is ``state``'s and loads back exactly."""
    latest = get_latest_complete_checkpoint(base, storage_options=options)
    assert latest == step_path(base, state["step"])
    out = {"w": torch.zeros_like(state["w"]), "step": -1}
    load(out, latest, storage_options=options)
    assert torch.equal(out["w"], state["w"]) and out["step"] == state["step"]


@dataclass
class FirstStep:
    """Step 1 saved straight to the server, and a proxy in front of it for what follows."""

    base: str
    direct: dict
    endpoint: FaultyEndpoint
    options: dict  # through the proxy
    first: dict[str, Any]


@pytest.fixture
def first_step(
    s3_bucket: tuple[str, dict], faulty_endpoint: Callable[..., FaultyEndpoint]
) -> Callable[..., FirstStep]:
    """``first_step(numel=BIG, **faults)``: step 1 saved, then a proxy with ``faults`` started."""

    def make(numel: int = BIG, **faults: Any) -> FirstStep:
        base, direct = s3_bucket
        first = _first_step(base, direct, numel)
        endpoint = faulty_endpoint(**faults)
        return FirstStep(base, direct, endpoint, _through(endpoint), first)

    return make


def _assert_step_2_failed(outcome: Outcome, named: str, setup: FirstStep, *, clean: bool) -> None:
    """Saving step 2 raised a CheckpointingError naming ``named``; step 2 was never committed
    (``clean``: nothing of it is left, no open multipart upload either); step 1 still loads."""
    base, direct = setup.base, setup.direct
    assert isinstance(outcome.error, CheckpointingError), outcome
    assert named in str(outcome.error)
    if clean:
        assert _open_uploads(base, direct) == []
        assert storage.listdir(step_path(base, 2), direct) == []  # no .metadata, data, marker
    else:
        assert ".metadata" not in storage.listdir(step_path(base, 2), direct)
    _assert_latest_loads(base, direct, setup.first)


def _data_files(path: str, options: dict) -> list[str]:
    return sorted(n for n in storage.listdir(path, options) if n.endswith(".distcp"))


def _open_uploads(base: str, options: dict) -> list:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=options["endpoint_url"], skip_instance_cache=True)
    reply = fs.call_s3("list_multipart_uploads", Bucket=base[len("s3://") :])
    return reply.get("Uploads", [])


# ------------------------------------------------------------------ the server stops answering


def test_a_server_that_stops_answering_fails_save_latest_and_load_in_seconds(
    first_step: Callable[..., FirstStep],
) -> None:
    setup = first_step()
    base, endpoint, options = setup.base, setup.endpoint, setup.options

    found: dict[str, Outcome] = {}

    def stop_then_look() -> None:
        endpoint.pause()
        looks = {
            "latest": lambda: get_latest_complete_checkpoint(base, storage_options=options),
            "load": lambda: load(_state(0), step_path(base, 1), storage_options=options),
        }
        found.update(_all_within(25, looks))

    watcher = _after_new_parts(endpoint, stop_then_look)
    try:
        saved = _second_step_within(25, base, options, UPLOAD)
        watcher.join(30)
    finally:
        endpoint.resume()

    for what, outcome in found.items():
        assert isinstance(outcome.error, CheckpointingError), (what, outcome)
        assert base in str(outcome.error) and "timeout" in str(outcome.error).lower()
        assert outcome.seconds < 15, (what, outcome)
    assert set(found) == {"latest", "load"}
    _assert_step_2_failed(saved, step_path(base, 2), setup, clean=False)


def test_an_async_save_to_a_server_that_stops_answering_fails_in_seconds(
    first_step: Callable[..., FirstStep],
) -> None:
    setup = first_step()
    base, endpoint, options = setup.base, setup.endpoint, setup.options
    with AsyncCallsQueue(timeout=60) as queue:
        _warm_up(queue, base, options)
        watcher = _after_new_parts(endpoint, endpoint.pause)
        future = async_save(
            _state(2),
            step_path(base, 2),
            queue=queue,
            storage_options=options,
            thread_count=1,
            upload=dataclasses.replace(UPLOAD, attempts=1),
        )
        try:
            outcome = _within(25, future.result)
            watcher.join(30)
        finally:
            endpoint.resume()
    _assert_step_2_failed(outcome, step_path(base, 2), setup, clean=False)


# ------------------------------------------------------------------ the server dies


def test_a_server_killed_mid_upload_fails_the_save_and_the_upload_is_aborted_when_it_is_back(
    first_step: Callable[..., FirstStep],
) -> None:
    setup = first_step()
    base, endpoint, options = setup.base, setup.endpoint, setup.options

    class BackWhileAborting(logging.Handler):
        """Restarts the server when tierpoint is about to retry the abort of an upload."""

        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("aborting the upload") and "retrying" in message:
                if not endpoint.running():
                    endpoint.start()

    handler = BackWhileAborting(logging.WARNING)
    logging.getLogger("tierpoint").addHandler(handler)
    one_part_at_a_time = dataclasses.replace(UPLOAD, concurrency=1)
    try:
        watcher = _after_new_parts(endpoint, endpoint.kill)
        outcome = _second_step_within(20, base, options, one_part_at_a_time)
        watcher.join(30)
    finally:
        logging.getLogger("tierpoint").removeHandler(handler)
        if not endpoint.running():
            endpoint.start()

    _assert_step_2_failed(outcome, f"{step_path(base, 2)}/__0_0.", setup, clean=True)


def test_a_metadata_upload_applied_after_the_client_gave_up_never_completes_the_step(
    first_step: Callable[..., FirstStep],
) -> None:
    setup = first_step(1024, late_metadata=10)
    base, direct, endpoint = setup.base, setup.direct, setup.endpoint
    # every request of the save gets 5 s (on a loaded machine a small upload to the local server
    # has taken over 3 s); the held .metadata upload takes 10
    once = storage.UploadOptions(attempts=1, request_timeout=5)
    outcome = _within(
        25,
        lambda: save(
            _state(2, 1024), step_path(base, 2), storage_options=_through(endpoint), upload=once
        ),
    )
    assert isinstance(outcome.error, CheckpointingError), outcome
    assert f"{step_path(base, 2)}/.metadata" in str(outcome.error)
    deadline = time.monotonic() + 15
    while not storage.exists(f"{step_path(base, 2)}/.metadata", direct):  # the late commit
        assert time.monotonic() < deadline, "the held .metadata upload never reached the server"
        time.sleep(0.1)
    assert ".unfinished-0" in storage.listdir(step_path(base, 2), direct)
    _assert_latest_loads(base, direct, setup.first)


# ------------------------------------------------------------------ errors the server answers


def test_transient_part_errors_are_retried_until_the_save_succeeds(
    s3_bucket: tuple[str, dict],
    faulty_endpoint: Callable[..., FaultyEndpoint],
) -> None:
    base, direct = s3_bucket
    endpoint = faulty_endpoint(fail_parts=2, status=503)
    state = _state(1, 3 << 20)  # 12 MiB: parts of 5, 5 and 2 MiB
    three = storage.UploadOptions(part_size=5 << 20, attempts=3, backoff=0.05)
    save(
        state, step_path(base, 1), storage_options=_through(endpoint), thread_count=1, upload=three
    )
    assert endpoint.counts() == {"upload_part": 3 + 2, "failed": 2}
    _assert_latest_loads(base, direct, state)


@pytest.mark.parametrize("status", [500, 503, 400])
def test_more_part_failures_than_attempts_fail_the_save_and_abort_the_upload(
    first_step: Callable[..., FirstStep],
    status: int,
) -> None:
    setup = first_step(1024, fail_parts=1_000_000, status=status)
    base, endpoint = setup.base, setup.endpoint
    two = storage.UploadOptions(part_size=5 << 20, attempts=2, backoff=0.05)
    outcome = _within(
        20,
        lambda: save(
            _state(2, 3 << 20),
            step_path(base, 2),
            storage_options=_through(endpoint),
            thread_count=1,
            upload=two,
        ),
    )
    _assert_step_2_failed(outcome, f"{step_path(base, 2)}/__0_0.", setup, clean=True)
    assert f"injected {status}" in str(outcome.error)
    # Three parts, no hidden retries; a request the store refuses for good (400) is not repeated.
    tries = two.attempts if status >= 500 else 1
    assert endpoint.counts()["upload_part"] == 3 * tries


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_failed_save_over_a_committed_step_leaves_it_uncommitted(
    first_step: Callable[..., FirstStep], kind: str
) -> None:
    """overwrite=True un-commits the step before new data is written (on an object store the
    worker does it, after its marker): when the new save fails, the step is not complete, so no
    restore takes the old values for the new step's."""
    setup = first_step(1024, fail_parts=1_000_000)
    path, options = step_path(setup.base, 1), _through(setup.endpoint)
    two = storage.UploadOptions(part_size=5 << 20, attempts=1, backoff=0.05)
    kwargs = {"storage_options": options, "thread_count": 1, "upload": two, "overwrite": True}
    if kind == "sync":
        outcome = _within(20, lambda: save(_state(2, 3 << 20), path, **kwargs))
    else:
        with AsyncCallsQueue() as queue:
            _warm_up(queue, setup.base, options)
            future = async_save(_state(2, 3 << 20), path, queue=queue, **kwargs)
            outcome = _within(20, lambda: future.result(timeout=20))
    assert isinstance(outcome.error, CheckpointingError), outcome
    names = storage.listdir(path, setup.direct)
    assert ".metadata" not in names and not [n for n in names if n.startswith(".unfinished")]
    assert get_latest_complete_checkpoint(setup.base, storage_options=setup.direct) is None


def test_retries_the_user_configures_for_the_client_win(
    s3_bucket: tuple[str, dict],
    faulty_endpoint: Callable[..., FaultyEndpoint],
) -> None:
    base, direct = s3_bucket
    endpoint = faulty_endpoint(fail_parts=1_000_000)
    retries = {"total_max_attempts": 2, "mode": "standard"}
    options = _through(endpoint, retries=retries)
    fs, _ = storage.filesystem(base, options)
    assert fs.config_kwargs == {**CLIENT, "retries": retries}
    two = storage.UploadOptions(part_size=5 << 20, attempts=2, backoff=0.05)
    with pytest.raises(CheckpointingError, match="injected 503"):
        save(_state(1, 3 << 20), step_path(base, 1), storage_options=options, upload=two)
    assert endpoint.counts()["upload_part"] == 3 * 2 * 2  # parts x tierpoint's x botocore's
    assert _open_uploads(base, direct) == []


# ------------------------------------------------------------------ wrong set-up


def test_an_endpoint_that_refuses_connections_fails_clearly_in_seconds(
    s3_server: str,
) -> None:
    base = "s3://tierpoint-refused/run"
    options = _through(f"http://127.0.0.1:{free_port()}")
    calls = {
        "save": lambda: save(
            _state(1, 16), step_path(base, 1), storage_options=options, upload=UPLOAD
        ),
        "latest": lambda: get_latest_complete_checkpoint(base, storage_options=options),
        "load": lambda: load(_state(0, 16), step_path(base, 1), storage_options=options),
    }
    for what, outcome in _all_within(20, calls).items():
        assert isinstance(outcome.error, CheckpointingError), (what, outcome)
        assert base in str(outcome.error) and "Could not connect" in str(outcome.error)
        assert outcome.seconds < 8, (what, outcome)


def test_wrong_credentials_fail_clearly_in_seconds_and_lose_nothing(
    s3_bucket: tuple[str, dict],
    faulty_endpoint: Callable[..., FaultyEndpoint],
) -> None:
    base, direct = s3_bucket
    endpoint = faulty_endpoint(key="tierpoint-test")  # the key the environment holds
    first = _first_step(base, _through(endpoint), 1024)
    wrong = {**_through(endpoint), "key": "intruder", "secret": "intruder"}
    calls = {
        "save": lambda: save(_state(2, 1024), step_path(base, 2), storage_options=wrong),
        "latest": lambda: get_latest_complete_checkpoint(base, storage_options=wrong),
        "load": lambda: load(_state(0, 1024), step_path(base, 1), storage_options=wrong),
    }
    for what, outcome in _all_within(20, calls).items():
        assert isinstance(outcome.error, CheckpointingError), (what, outcome)
        assert base in str(outcome.error) and "PermissionError" in str(outcome.error)
        assert outcome.seconds < 5, (what, outcome)
    assert storage.listdir(step_path(base, 2), direct) == []
    _assert_latest_loads(base, direct, first)


def test_loading_from_a_missing_bucket_names_the_url(s3_server: str) -> None:
    url = "s3://tierpoint-no-such-bucket/run/step-1"
    with pytest.raises(CheckpointingError, match="bucket 'tierpoint-no-such-bucket' does not"):
        load(_state(0, 16), url, storage_options=_through(s3_server))


# ------------------------------------------------------------------ damaged objects


@pytest.mark.parametrize("damage", ["truncated data", "missing data", "garbage metadata"])
def test_a_damaged_checkpoint_on_s3_is_a_corrupt_checkpoint_error(
    s3_bucket: tuple[str, dict],
    damage: str,
) -> None:
    base, direct = s3_bucket
    path = step_path(base, 1)
    save(_state(1, 1 << 18), path, storage_options=direct, thread_count=1)
    if damage == "truncated data":
        name, reason = _data_files(path, direct)[0], "truncated"
        whole = storage.read_bytes(f"{path}/{name}", direct)
        storage.write_file(f"{path}/{name}", [whole[: len(whole) // 2]], storage_options=direct)
    elif damage == "missing data":  # (no hint of node-local disks: every rank sees the store)
        name, reason = _data_files(path, direct)[0], "missing DCP data file$"
        storage.remove_files(path, [name], storage_options=direct)
    else:
        name, reason = ".metadata", ""
        storage.publish(f"{path}/{name}", b"\x80\x05garbage" * 100, storage_options=direct)
    out = _state(0, 1 << 18)
    before = out["w"].clone()
    with pytest.raises(CorruptCheckpointError, match=f"{path}/{name}.*{reason}"):
        load(out, path, storage_options=direct)
    assert torch.equal(out["w"], before) and out["step"] == 0


def test_earlier_data_objects_that_cannot_be_deleted_never_fail_the_save(
    s3_bucket: tuple[str, dict],
    faulty_endpoint: Callable[..., FaultyEndpoint],
    caplog: pytest.LogCaptureFixture,
) -> None:
    base, direct = s3_bucket
    path = step_path(base, 1)
    two_tensors = {**_state(1, 1 << 18), "v": torch.ones(1 << 18)}
    save(two_tensors, path, storage_options=direct, thread_count=2)
    first = _data_files(path, direct)
    assert untokened(first) == ["__0_0.distcp", "__0_1.distcp"]
    earlier = sorted(n for n in storage.listdir(path, direct) if n != ".metadata")  # + checksums
    options = _through(faulty_endpoint(refuse_data_deletes=True))
    second = _state(2, 1 << 18)
    with caplog.at_level(logging.WARNING, logger="tierpoint"):
        save(second, path, storage_options=options, thread_count=1, upload=UPLOAD, overwrite=True)
    left = f"left ({', '.join(earlier)}), unreferenced"
    assert any(left in r.getMessage() and "permission" in r.getMessage() for r in caplog.records), (
        caplog.text
    )
    assert set(first) <= set(storage.listdir(path, direct))  # unreferenced, harmless
    assert get_latest_complete_checkpoint(base, storage_options=direct) == path
    out = {"w": torch.zeros_like(second["w"]), "step": -1}
    load(out, path, storage_options=direct)
    assert torch.equal(out["w"], second["w"]) and out["step"] == 2


def _save_on_a_store_that_stops_answering(
    rank: int, world: int, base: str, options: list[dict], healthy: dict
) -> str:
    """Save step 2 through ``options[rank]`` (where the store stops answering: each request may
    take up to 5 tries of 4 s, far more than the others wait), then step 3 through ``healthy``."""
    slow = storage.UploadOptions(attempts=5, backoff=0.05, request_timeout=4)
    try:
        save(_state(2, 1024), step_path(base, 2), storage_options=options[rank], upload=slow)
        outcome = "saved"
    except CheckpointingError as e:
        outcome = str(e)
    save(_state(3, 1024), step_path(base, 3), storage_options=healthy)  # the job's group lives on
    return outcome


def test_a_store_that_stops_answering_in_the_planning_fails_the_save_not_the_job(
    first_step: Callable[..., FirstStep],
) -> None:
    """The store stops answering the coordinator's requests of the planning (its set-up, then
    the clean-up after it): they used to run to their last retry on the training thread, past the
    other rank's wait in the planning's vote (``TIERPOINT_TIMEOUT``), which failed the job's
    coordination for good. They end within half of it: the save fails on every rank, the next one
    commits."""
    setup = first_step(1024)
    stalled = _through(setup.endpoint, read_timeout=30)  # each try cut by request_timeout alone
    setup.endpoint.pause()
    try:
        outcomes = run_ranks(
            _save_on_a_store_that_stops_answering,
            2,
            setup.base,
            [stalled, setup.direct],  # the store stops answering the coordinator
            setup.direct,
            env={"TIERPOINT_TIMEOUT": "8"},
            timeout=120,
        )
    finally:
        setup.endpoint.resume()
    assert all("rank 0" in o and "out of time" in o for o in outcomes), outcomes
    assert ".metadata" in storage.listdir(step_path(setup.base, 3), setup.direct)


def test_a_commit_to_a_store_that_stops_answering_fails_the_save_not_the_job(
    first_step: Callable[..., FirstStep],
) -> None:
    """The coordinator's ``.metadata`` upload is held: its retries used to outlast the other
    ranks' wait (``TIERPOINT_TIMEOUT``), which failed the job's coordination for good (every
    later save raised). They end within half of it: this save fails on every rank, the next one
    commits."""
    setup = first_step(1024, late_metadata=60)
    env = {"TIERPOINT_TIMEOUT": "8"}
    outcomes = run_ranks(
        _save_on_a_store_that_stops_answering,
        2,
        setup.base,
        [_through(setup.endpoint, read_timeout=30)] * 2,  # each try cut by request_timeout alone
        setup.direct,
        env=env,
        timeout=90,
    )
    assert all(".metadata" in o and "out of time" in o for o in outcomes), outcomes
    assert ".metadata" in storage.listdir(step_path(setup.base, 3), setup.direct)
