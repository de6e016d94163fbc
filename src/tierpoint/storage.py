"""Paths and URLs over one small API: local files (direct system calls, fsynced) or any fsspec URL.

Every function takes a local path, a ``file://`` URL or an fsspec URL (``s3://bucket/key``, ...) plus
optional ``storage_options`` (passed to fsspec, e.g. ``{"endpoint_url": ...}`` for s3fs).

Call order for a checkpoint directory: :func:`makedirs`, :func:`touch` a marker, :func:`write_file`
each data file, :func:`publish` the commit file last, :func:`remove` the marker. Readers use
:func:`listdir`, :func:`exists`, :func:`read_bytes`.

Invariants:
- Local writes are durable when the call returns: files are fsynced, and so is the directory that
  names them (after create, rename and remove). Large files that are fsynced anyway bypass the page
  cache on disk file systems (:mod:`tierpoint.direct_write`).
- :func:`publish` is atomic: a reader sees the old content or the new, never a part (local: tmp file,
  fsync, rename; object stores: one PUT).
- Large uploads to S3 are multipart, parts sent in parallel and each retried on transient errors
  (bounded attempts with backoff); a failed upload is aborted (the abort retried like any request),
  leaving no object behind.
- Every object-store request is tried :class:`UploadOptions` ``attempts`` times (the S3 client's
  own retries are off unless ``storage_options`` configure them), each try bounded by the client's
  connect and read timeouts and by ``request_timeout``: a server that stops answering is an error,
  not a hang.
- Listings never come from fsspec's listing cache (it is invalidated first), so a rank sees what the
  store holds now.
- Every failure is a :class:`~tierpoint.errors.CheckpointingError` naming the path and the reason.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import direct_write
from .errors import CheckpointingError

logger = logging.getLogger("tierpoint")

Views = Sequence["bytes | bytearray | memoryview"]

_IO_CHUNK = 1 << 30
_WRITEV_BATCH = 512
_SMALL = 1 << 20


@dataclass(frozen=True)
class UploadOptions:
    """How objects are sent to object stores.

    Objects larger than ``part_size`` are sent as a multipart upload (S3) with up to ``concurrency``
    parts in flight; each request is tried ``attempts`` times, waiting ``backoff * 2**k`` seconds.
    One try of a request may take ``request_timeout`` seconds in all, sending its body included
    (on fsspec's async filesystems, s3fs among them: the client's own read timeout does not bound
    sending a body to a server that stopped reading).
    """

    part_size: int = 32 << 20
    concurrency: int = 4
    attempts: int = 5
    backoff: float = 0.2
    request_timeout: float = 120.0


DEFAULT_UPLOAD = UploadOptions()

_S3_MIN_PART = 5 << 20
_S3_MAX_PARTS = 10_000


# ---------------------------------------------------------------------------------------- naming


def checkpoint_path(value: Any, argument: str = "path") -> str:
    """``value`` as a path or URL string; anything else is a clear error naming ``argument``."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return path
    hint = (
        " (get_latest_complete_checkpoint returns None when no checkpoint exists)"
        if value is None
        else ""
    )
    raise CheckpointingError(
        f"{argument} must be a path or URL string (not empty), got {type(value).__name__}{hint}"
    )


def is_local(url: str | os.PathLike) -> bool:
    """Whether ``url`` names a local path (plain path or ``file://``)."""
    text = os.fspath(url)
    return "://" not in text or text.startswith("file://")


def local_path(url: str | os.PathLike) -> str:
    """The file system path of a local ``url`` (``file://`` removed)."""
    text = os.fspath(url)
    return text[len("file://") :] if text.startswith("file://") else text


def join(url: str | os.PathLike, *names: str) -> str:
    """``url`` with ``names`` appended (``/`` separators for URLs)."""
    text = os.fspath(url)
    if is_local(text):
        return os.path.join(text, *names)
    return posixpath.join(text.rstrip("/"), *names)


def basename(url: str | os.PathLike) -> str:
    return posixpath.basename(os.fspath(url).rstrip("/"))


_S3_SCHEMES = ("s3://", "s3a://")
_s3_filesystems: dict[str, Any] = {}
_s3_filesystems_lock = threading.Lock()


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem for a non-local ``url`` and the path inside it (instances are cached).

    ``s3://`` URLs get tierpoint's own s3fs instance (per process and options), whose requests
    are tried once by botocore and by s3fs: tierpoint retries each request itself
    (:class:`UploadOptions` ``attempts``), so that is the real number of tries and a server that
    stops answering fails a request after ``attempts`` connect or read timeouts (s3fs's defaults:
    5 s and 15 s) instead of 25 times that. ``config_kwargs`` in ``storage_options`` win
    (``{"retries": {...}}`` there brings botocore's retries back).
    """
    from fsspec.core import url_to_fs

    options = dict(storage_options or {})
    try:
        if not url.startswith(_S3_SCHEMES):
            return url_to_fs(url, **options)
        from fsspec.utils import tokenize

        options["config_kwargs"] = {
            "retries": {"total_max_attempts": 1},
            **dict(options.get("config_kwargs") or {}),
        }
        key = tokenize(os.getpid(), url.split("://", 1)[0], options)
        with _s3_filesystems_lock:
            fs = _s3_filesystems.get(key)
            if fs is None:
                fs, _ = url_to_fs(url, skip_instance_cache=True, **options)
                fs.retries = 1  # s3fs's own retry loop (an attribute, not an option)
                _s3_filesystems[key] = fs
        return fs, type(fs)._strip_protocol(url)
    except (ImportError, ValueError) as e:
        raise CheckpointingError(f"cannot open storage for {url}: {e}") from e


# ---------------------------------------------------------------------------------------- errors


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        return f"{e.strerror or e} [{name}]"
    return f"{type(e).__name__}: {e}"


def failure(action: str, url: str | os.PathLike, e: BaseException) -> CheckpointingError:
    """The error to raise when ``action`` ("writing", ...) on ``url`` failed with ``e``: names the
    file and the reason (``ENOSPC`` and the like)."""
    if isinstance(e, CheckpointingError):
        return e
    err = CheckpointingError(f"{action} {os.fspath(url)} failed: {_reason(e)}")
    err.path = os.fspath(url)  # type: ignore[attr-defined]
    return err


# ---------------------------------------------------------------------------------------- local


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view[:_IO_CHUNK])
        view = view[n:]


def _write_views(fd: int, views: Iterable[bytes | bytearray | memoryview]) -> int:
    """Write views back to back; small ones gathered into one ``writev``. Returns bytes written."""
    batch: list[memoryview] = []
    batch_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            written = os.writev(fd, batch)
            if written != batch_bytes:  # partial writev: finish the rest piece by piece
                rest = written
                for v in batch:
                    if rest >= len(v):
                        rest -= len(v)
                        continue
                    _write_all(fd, v[rest:])
                    rest = 0
            batch, batch_bytes = [], 0

    for raw in views:
        v = memoryview(raw).cast("B") if not isinstance(raw, bytes) else memoryview(raw)
        total += len(v)
        if len(v) >= _SMALL:
            flush()
            _write_all(fd, v)
        elif len(v):
            batch.append(v)
            batch_bytes += len(v)
            if len(batch) >= _WRITEV_BATCH or batch_bytes >= _SMALL:
                flush()
    flush()
    return total


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries durable (local paths only; a no-op for URLs)."""
    if not is_local(path):
        return
    fd = os.open(local_path(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local(path: str, views: Views, fsync: bool) -> int:
    if fsync and direct_write.suitable(path, views):
        written = direct_write.write_file(path, views)
        if written is not None:
            return written
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        total = _write_views(fd, views)
        if fsync:
            os.fsync(fd)
        return total
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- remote


def _transient(e: BaseException) -> bool:
    """Whether an object-store error is worth retrying."""
    if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError, ValueError)):
        return False
    status, code = _http_status(e)
    if status is not None and 400 <= status < 500:
        return status in (408, 429) or code in _RETRIED_CLIENT_ERRORS
    if isinstance(e, (OSError, ConnectionError, TimeoutError)):
        return True
    if {c.__name__ for c in type(e).__mro__} & _TRANSIENT_CLASSES:
        return True
    name = type(e).__name__
    return any(k in name for k in ("Timeout", "Connection", "Throttl", "Endpoint", "Payload"))


def _http_status(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of the reply behind ``e`` (s3fs keeps botocore's error as
    the cause of the one it raises), or ``(None, None)``: no reply came."""
    seen: BaseException | None = e
    for _ in range(4):
        if seen is None:
            break
        reply = getattr(seen, "response", None)
        if isinstance(reply, dict):
            status = reply.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (int(status) if status else None), reply.get("Error", {}).get("Code")
        seen = seen.__cause__ or seen.__context__
    return None, None


_RETRIED_CLIENT_ERRORS = {
    "RequestTimeout",
    "IncompleteBody",
    "BadDigest",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "OperationAborted",
}
"""4xx replies that a later try may not get (the body was cut short or damaged on the way, the
store throttles); any other 4xx will be answered again and fails at once."""

_TRANSIENT_CLASSES = {"HTTPClientError", "IncompleteRead", "ResponseParserError"}
"""Client errors s3fs itself retries (botocore's HTTPClientError covers a reply cut short); the
client tierpoint uses leaves every retry to :func:`_with_retries`."""


def _with_retries(what: str, options: UploadOptions, fn: Any, *args: Any, **kwargs: Any) -> Any:
    for attempt in range(options.attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            if attempt + 1 >= options.attempts or not _transient(e):
                raise
            wait = options.backoff * (2**attempt)
            logger.warning("%s failed (%s); retrying in %.1f s", what, _reason(e), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _bounded(fn: Any, timeout: float, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` where ``fn`` is a blocking method of an fsspec async filesystem
    (its ``timeout`` cancels the request); an expired deadline becomes a :class:`TimeoutError`."""
    from fsspec.exceptions import FSTimeoutError

    try:
        return fn(*args, timeout=timeout, **kwargs)
    except FSTimeoutError:
        raise TimeoutError(f"no reply within {timeout:g} s") from None


def request(
    what: str,
    fs: Any,
    method: str,
    *args: Any,
    upload: UploadOptions = DEFAULT_UPLOAD,
    **kwargs: Any,
) -> Any:
    """``fs.<method>(*args, **kwargs)``: one request to an object store, retried on transient errors
    as ``upload`` says, each try bounded by ``upload.request_timeout`` on async filesystems."""
    from fsspec.asyn import AsyncFileSystem

    fn = getattr(fs, method)
    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        return _with_retries(what, upload, _bounded, fn, upload.request_timeout, *args, **kwargs)
    return _with_retries(what, upload, fn, *args, **kwargs)


def _is_s3(fs: Any) -> bool:
    return type(fs).__name__ == "S3FileSystem" and hasattr(fs, "_call_s3")


def _s3_request(what: str, fs: Any, method: str, options: UploadOptions, **kwargs: Any) -> Any:
    """One S3 API call (botocore's ``method``), retried and bounded like :func:`request`."""
    from fsspec.asyn import sync

    call = partial(_bounded, partial(sync, fs.loop, fs._call_s3), options.request_timeout)
    return _with_retries(what, options, call, method, **kwargs)


def _slice_views(views: Sequence[memoryview], begin: int, end: int) -> bytes:
    """Bytes ``[begin, end)`` of the concatenation of ``views``."""
    out = bytearray(end - begin)
    pos = 0
    filled = 0
    for v in views:
        n = len(v)
        if pos + n > begin and pos < end:
            lo = max(begin - pos, 0)
            hi = min(end - pos, n)
            out[filled : filled + hi - lo] = v[lo:hi]
            filled += hi - lo
        pos += n
        if pos >= end:
            break
    return bytes(out)


def _s3_multipart(
    fs: Any, path: str, views: Sequence[memoryview], total: int, options: UploadOptions
) -> None:
    bucket, key, _ = fs.split_path(path)
    part_size = max(options.part_size, _S3_MIN_PART, -(-total // _S3_MAX_PARTS))
    ranges = [(b, min(b + part_size, total)) for b in range(0, total, part_size)]
    created = _s3_request(
        f"starting the upload of {path}",
        fs,
        "create_multipart_upload",
        options,
        Bucket=bucket,
        Key=key,
    )
    upload_id = created["UploadId"]

    def put(number: int, begin: int, end: int) -> dict[str, Any]:
        body = _slice_views(views, begin, end)
        reply = _s3_request(
            f"uploading part {number} of {path}",
            fs,
            "upload_part",
            options,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": reply["ETag"]}

    try:
        with ThreadPoolExecutor(min(options.concurrency, len(ranges))) as pool:
            futures = [pool.submit(put, i + 1, b, e) for i, (b, e) in enumerate(ranges)]
            parts = [f.result() for f in futures]
        _s3_request(
            f"completing the upload of {path}",
            fs,
            "complete_multipart_upload",
            options,
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        try:
            _s3_request(
                f"aborting the upload of {path}",
                fs,
                "abort_multipart_upload",
                options,
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
            )
        except Exception as e:  # noqa: BLE001 - the original failure matters more
            logger.warning(
                "aborting the upload of %s failed (%s): multipart upload %s stays on the server "
                "until it is aborted (or a lifecycle rule expires it)",
                path,
                _reason(e),
                upload_id,
            )
        raise


def _write_remote(
    url: str, views: Views, storage_options: Mapping[str, Any] | None, options: UploadOptions
) -> int:
    fs, path = filesystem(url, storage_options)
    mvs = [memoryview(v).cast("B") if not isinstance(v, bytes) else memoryview(v) for v in views]
    total = sum(len(v) for v in mvs)
    if _is_s3(fs) and total > options.part_size:
        _s3_multipart(fs, path, mvs, total, options)
    elif total <= options.part_size:
        data = _slice_views(mvs, 0, total)
        request(f"uploading {url}", fs, "pipe_file", path, data, upload=options)
    else:  # another object store: its own streaming (chunked) upload

        def stream() -> None:
            with fs.open(path, "wb", block_size=options.part_size) as f:
                for v in mvs:
                    f.write(v)

        _with_retries(f"uploading {url}", options, stream)
    fs.invalidate_cache(posixpath.dirname(path))
    return total


# ---------------------------------------------------------------------------------------- API


def makedirs(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> None:
    """Create a directory and its parents (durably, for local paths); a no-op on object stores."""
    try:
        if is_local(url):
            path = os.path.abspath(local_path(url))
            missing = []
            while path and not os.path.isdir(path):
                missing.append(path)
                path = os.path.dirname(path)
            for p in reversed(missing):
                try:
                    os.mkdir(p)
                except FileExistsError:
                    if not os.path.isdir(p):
                        raise NotADirectoryError(errno.ENOTDIR, "not a directory", p) from None
                fsync_dir(os.path.dirname(p))
        else:
            fs, path = filesystem(os.fspath(url), storage_options)
            if not _is_s3(fs):
                fs.makedirs(path, exist_ok=True)
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("creating directory", url, e) from e


def write_file(
    url: str | os.PathLike,
    views: Views,
    *,
    storage_options: Mapping[str, Any] | None = None,
    fsync: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> int:
    """Write ``views`` back to back as the whole content of ``url``; returns the byte count.

    Local files are written in place and fsynced (the caller fsyncs the directory once after a batch
    of files, see :func:`fsync_dir`); object-store files appear only when complete.
    """
    try:
        if is_local(url):
            return _write_local(local_path(url), views, fsync)
        return _write_remote(os.fspath(url), views, storage_options, upload)
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("writing", url, e) from e


def publish(
    url: str | os.PathLike,
    data: bytes,
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Atomically make ``url`` hold ``data`` (local: tmp, fsync, rename, fsync dir; else one PUT)."""
    try:
        if is_local(url):
            path = local_path(url)
            tmp = f"{path}.tmp"
            _write_local(tmp, [data], fsync=True)
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        else:
            fs, path = filesystem(os.fspath(url), storage_options)
            request(f"uploading {url}", fs, "pipe_file", path, bytes(data), upload=upload)
            fs.invalidate_cache(posixpath.dirname(path))
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("publishing", url, e) from e


def touch(
    url: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Create an empty file (a marker), durably."""
    try:
        if is_local(url):
            path = local_path(url)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            os.close(fd)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
        else:
            fs, path = filesystem(os.fspath(url), storage_options)
            request(f"creating {url}", fs, "pipe_file", path, b"", upload=upload)
            fs.invalidate_cache(posixpath.dirname(path))
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("creating", url, e) from e


def remove(
    url: str | os.PathLike,
    *,
    storage_options: Mapping[str, Any] | None = None,
    missing_ok: bool = True,
    sync_dir: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> bool:
    """Remove a file; returns whether it existed. Local removals are made durable unless
    ``sync_dir`` is false; remote ones are retried as ``upload`` says."""
    try:
        if is_local(url):
            path = local_path(url)
            try:
                os.unlink(path)
            except FileNotFoundError:
                if not missing_ok:
                    raise
                return False
            if sync_dir:
                fsync_dir(os.path.dirname(os.path.abspath(path)))
            return True
        fs, path = filesystem(os.fspath(url), storage_options)
        try:
            request(f"removing {url}", fs, "rm_file", path, upload=upload)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return False
        finally:
            fs.invalidate_cache(posixpath.dirname(path))
        return True
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("removing", url, e) from e


def remove_files(
    directory: str | os.PathLike,
    names: Sequence[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> None:
    """Remove the files ``names`` of ``directory`` (missing ones are fine): locally with one
    directory sync for all, on an object store in one bulk request (retried as ``upload`` says)."""
    if not names:
        return
    try:
        if is_local(directory):
            for name in names:
                try:
                    os.unlink(os.path.join(local_path(directory), name))
                except FileNotFoundError:
                    pass
            fsync_dir(directory)
            return
        fs, path = filesystem(os.fspath(directory), storage_options)
        paths = [posixpath.join(path, name) for name in names]
        try:
            request(f"removing {len(paths)} files in {directory}", fs, "rm", paths, upload=upload)
        except FileNotFoundError:
            pass
        finally:
            fs.invalidate_cache(path)
    except Exception as e:  # noqa: BLE001 - reported with the directory
        raise failure(f"removing {len(names)} files in", directory, e) from e


def remove_dir_if_empty(
    url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Remove an empty local directory (quietly keeps a non-empty one); no-op on object stores."""
    if not is_local(url):
        return
    try:
        os.rmdir(local_path(url))
        fsync_dir(os.path.dirname(os.path.abspath(local_path(url))))
    except OSError:
        pass


def check_bucket(
    fs: Any, path: str, url: str | os.PathLike, upload: UploadOptions = DEFAULT_UPLOAD
) -> None:
    """Raise if ``path`` (on an S3 filesystem) lies in a bucket that does not exist: a missing
    object there is a wrong URL, not an empty checkpoint directory."""
    if not _is_s3(fs):
        return
    bucket = path.split("/", 1)[0]
    if not request(f"inspecting bucket {bucket}", fs, "exists", bucket, upload=upload):
        raise CheckpointingError(f"{os.fspath(url)}: bucket {bucket!r} does not exist")


def listdir(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> list[str]:
    """Names directly under ``url`` (files and directories); empty when it does not exist. Remote
    listings are retried as ``upload`` says."""
    try:
        if is_local(url):
            try:
                return sorted(os.listdir(local_path(url)))
            except (FileNotFoundError, NotADirectoryError):
                return []
        fs, path = filesystem(os.fspath(url), storage_options)
        fs.invalidate_cache(path)
        try:
            entries = request(f"listing {url}", fs, "ls", path, detail=False, upload=upload)
        except FileNotFoundError:
            check_bucket(fs, path, url, upload)
            return []
        prefix = path.rstrip("/") + "/"
        return sorted(
            {
                e.rstrip("/")[len(prefix) :]
                if e.startswith(prefix)
                else posixpath.basename(e.rstrip("/"))
                for e in entries
                if e.rstrip("/") != path.rstrip("/")
            }
        )
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("listing", url, e) from e


def isdir(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bool:
    try:
        if is_local(url):
            return os.path.isdir(local_path(url))
        fs, path = filesystem(os.fspath(url), storage_options)
        fs.invalidate_cache(path)
        return bool(request(f"inspecting {url}", fs, "isdir", path))
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("inspecting", url, e) from e


def exists(
    url: str | os.PathLike,
    storage_options: Mapping[str, Any] | None = None,
    upload: UploadOptions = DEFAULT_UPLOAD,
) -> bool:
    """Whether ``url`` exists (remote checks are retried as ``upload`` says)."""
    try:
        if is_local(url):
            return os.path.exists(local_path(url))
        fs, path = filesystem(os.fspath(url), storage_options)
        fs.invalidate_cache(posixpath.dirname(path))
        return bool(request(f"inspecting {url}", fs, "exists", path, upload=upload))
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("inspecting", url, e) from e


def read_bytes(url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> bytes:
    try:
        if is_local(url):
            with open(local_path(url), "rb") as f:
                return f.read()
        fs, path = filesystem(os.fspath(url), storage_options)
        return bytes(request(f"reading {url}", fs, "cat_file", path))
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise failure("reading", url, e) from e


def write_files_parallel(
    jobs: Sequence[tuple[str, Views]],
    *,
    threads: int,
    storage_options: Mapping[str, Any] | None = None,
    fsync: bool = True,
    upload: UploadOptions = DEFAULT_UPLOAD,
    timeout: float | None = None,
) -> list[int]:
    """Write several files on ``threads`` threads (each file whole by one thread), then fsync the
    directories that name them. Raises the first failure (naming its file); waits at most
    ``timeout`` seconds."""
    if not jobs:
        return []
    results: list[int] = [0] * len(jobs)
    errors: list[BaseException] = []
    lock = threading.Lock()
    pending = list(enumerate(jobs))

    def run() -> None:
        while True:
            with lock:
                if not pending or errors:
                    return
                i, (url, views) = pending.pop(0)
            try:
                results[i] = write_file(
                    url, views, storage_options=storage_options, fsync=fsync, upload=upload
                )
            except BaseException as e:  # noqa: BLE001 - raised by the caller below
                with lock:
                    errors.append(e)
                return

    workers = [
        threading.Thread(target=run, name=f"tierpoint-write-{k}", daemon=True)
        for k in range(max(1, min(threads, len(jobs))))
    ]
    for w in workers:
        w.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for w in workers:
        w.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if w.is_alive():
            raise CheckpointingError(
                f"writing {len(jobs)} files did not finish within {timeout:g} s"
            )
    if errors:
        raise errors[0]
    if fsync:
        for d in sorted({os.path.dirname(local_path(u)) for u, _ in jobs if is_local(u)}):
            try:
                fsync_dir(d or ".")
            except OSError as e:
                raise failure("syncing directory", d, e) from e
    return results
