"""The remote store: any fsspec URL (``s3://bucket/key``, ...), every request retried and bounded.

Call order: as for any :class:`~tierpoint.storage.store.Store`; :mod:`tierpoint.storage` makes a
:class:`RemoteStore` for each call on a non-local URL with the caller's ``storage_options``
(passed to fsspec, e.g. ``{"endpoint_url": ...}`` for s3fs) and :class:`UploadOptions`.
:func:`filesystem` gives the (cached) fsspec filesystem behind a URL.

Invariants:
- Objects appear only complete: small ones in one PUT, large ones on S3 as a multipart upload whose
  parts are sent in parallel and each retried; a failed upload is aborted (the abort retried like
  any request), leaving no object behind. Other stores use their own streaming upload.
- Every request goes through :mod:`.retries` (tries, backoff, per-try deadline).
- Listings never come from fsspec's listing cache (it is invalidated first), so a rank sees what the
  store holds now; every write invalidates its directory's entry.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointingError
from ..files import Views
from .retries import (
    DEFAULT_UPLOAD,
    UploadOptions,
    grace,
    request,
    s3_request,
    under_this_deadline,
    with_retries,
)
from .store import Store, reason

logger = logging.getLogger("tierpoint")

_S3_MIN_PART = 5 << 20
_S3_MAX_PARTS = 10_000
_ABORT_GRACE = 5.0  # seconds an upload's abort gets past a deadline that failed the upload
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


def _is_s3(fs: Any) -> bool:
    return type(fs).__name__ == "S3FileSystem" and hasattr(fs, "_call_s3")


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


def _s3_names(fs: Any, path: str, url: str, upload: UploadOptions) -> list[str]:
    """The names directly under ``path`` on S3 (objects and common prefixes), sorted: one
    ListObjectsV2 request per thousand names. Written by hand because s3fs's ``ls`` of a prefix
    that holds nothing (a new step directory) lists its parent too, two requests on the caller's
    thread where one answers."""
    bucket, _, key = path.partition("/")
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    names: set[str] = set()
    where = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
    while True:
        page = s3_request(f"listing {url}", fs, "list_objects_v2", upload, **where)
        names.update(o["Key"][len(prefix) :] for o in page.get("Contents", []))
        names.update(p["Prefix"][len(prefix) :].rstrip("/") for p in page.get("CommonPrefixes", []))
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            break
        where["ContinuationToken"] = token
    names.discard("")  # the prefix itself (an empty "directory" object)
    return sorted(names)


_S3_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes


def _s3_delete(fs: Any, paths: Sequence[str], url: str, upload: UploadOptions) -> None:
    """Delete the objects ``paths`` (``bucket/key``; missing ones are fine) in DeleteObjects
    requests of up to a thousand keys; raise if the store refused any. Written by hand because
    s3fs's ``rm`` of a list takes names with ``[``, ``*`` or ``?`` for patterns (matching other
    keys, or none) and drops the per-key errors of a bulk reply."""
    by_bucket: dict[str, list[str]] = {}
    for one in paths:
        bucket, _, key = one.partition("/")
        by_bucket.setdefault(bucket, []).append(key)
    for bucket, keys in by_bucket.items():
        for start in range(0, len(keys), _S3_DELETE_BATCH):
            batch = keys[start : start + _S3_DELETE_BATCH]
            objects = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
            what = f"removing {len(batch)} objects in {url}"
            reply = s3_request(what, fs, "delete_objects", upload, Bucket=bucket, Delete=objects)
            errors = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise OSError(
                    f"{len(errors)} of {len(batch)} objects were not removed, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}".rstrip()
                )


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
    where = {"Bucket": bucket, "Key": key}
    created = s3_request(
        f"starting the upload of {path}", fs, "create_multipart_upload", options, **where
    )
    where["UploadId"] = created["UploadId"]

    def put(number: int, begin: int, end: int) -> dict[str, Any]:
        body = _slice_views(views, begin, end)
        what = f"uploading part {number} of {path}"
        reply = s3_request(what, fs, "upload_part", options, PartNumber=number, Body=body, **where)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    try:
        with ThreadPoolExecutor(min(options.concurrency, len(ranges))) as pool:
            bounded = under_this_deadline(put)  # (a commit's deadline holds for its parts too)
            futures = [pool.submit(bounded, i + 1, b, e) for i, (b, e) in enumerate(ranges)]
            parts = [f.result() for f in futures]
        s3_request(
            f"completing the upload of {path}",
            fs,
            "complete_multipart_upload",
            options,
            MultipartUpload={"Parts": parts},
            **where,
        )
    except BaseException:
        try:
            with grace(_ABORT_GRACE):  # a deadline that failed the upload lets its abort run
                s3_request(
                    f"aborting the upload of {path}", fs, "abort_multipart_upload", options, **where
                )
        except Exception as e:  # noqa: BLE001 - the original failure matters more
            logger.warning(
                "aborting the upload of %s failed (%s): multipart upload %s stays on the server "
                "until it is aborted (or a lifecycle rule expires it)",
                path,
                reason(e),
                where["UploadId"],
            )
        raise


class RemoteStore(Store):
    """fsspec URLs, opened with ``storage_options``; requests tried as ``upload`` says."""

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        upload: UploadOptions = DEFAULT_UPLOAD,
    ) -> None:
        self.storage_options = storage_options
        self.upload = upload

    def _open(self, url: str | os.PathLike) -> tuple[Any, str]:
        return filesystem(os.fspath(url), self.storage_options)

    def _request(self, what: str, fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return request(what, fs, method, *args, upload=self.upload, **kwargs)

    def makedirs(self, url: str) -> None:
        fs, path = self._open(url)
        if not _is_s3(fs):
            fs.makedirs(path, exist_ok=True)

    def write_file(self, url: str, views: Views, fsync: bool) -> int:
        fs, path = self._open(url)
        options = self.upload
        mvs = [memoryview(v) if isinstance(v, bytes) else memoryview(v).cast("B") for v in views]
        total = sum(len(v) for v in mvs)
        if _is_s3(fs) and total > options.part_size:
            _s3_multipart(fs, path, mvs, total, options)
        elif total <= options.part_size:
            self._request(f"uploading {url}", fs, "pipe_file", path, _slice_views(mvs, 0, total))
        else:  # another object store: its own streaming (chunked) upload

            def stream() -> None:
                with fs.open(path, "wb", block_size=options.part_size) as f:
                    for v in mvs:
                        f.write(v)

            with_retries(f"uploading {url}", options, stream)
        fs.invalidate_cache(posixpath.dirname(path))
        return total

    def publish(self, url: str, data: bytes) -> None:
        fs, path = self._open(url)
        self._request(f"uploading {url}", fs, "pipe_file", path, bytes(data))
        fs.invalidate_cache(posixpath.dirname(path))

    def touch(self, url: str) -> None:
        fs, path = self._open(url)
        self._request(f"creating {url}", fs, "pipe_file", path, b"")
        fs.invalidate_cache(posixpath.dirname(path))

    def remove(self, url: str, missing_ok: bool, sync_dir: bool) -> bool:
        fs, path = self._open(url)
        try:
            self._request(f"removing {url}", fs, "rm_file", path)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return False
        finally:
            fs.invalidate_cache(posixpath.dirname(path))
        return True

    def remove_files(self, directory: str, names: Sequence[str]) -> None:
        fs, path = self._open(directory)
        paths = [posixpath.join(path, name) for name in names]
        try:
            if _is_s3(fs):
                _s3_delete(fs, paths, directory, self.upload)
                return
            for one in paths:  # rm_file: a name is a name (rm would expand "[", "*", "?")
                with contextlib.suppress(FileNotFoundError):
                    self._request(f"removing {one}", fs, "rm_file", one)
        finally:
            fs.invalidate_cache(path)

    def remove_dir_if_empty(self, url: str) -> None:
        """Directories are implicit on object stores: nothing to remove."""

    def listdir(self, url: str) -> list[str]:
        fs, path = self._open(url)
        fs.invalidate_cache(path)
        try:
            if _is_s3(fs):
                return _s3_names(fs, path, url, self.upload)
            entries = self._request(f"listing {url}", fs, "ls", path, detail=False)
        except FileNotFoundError:
            check_bucket(fs, path, url, self.upload)
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

    def isdir(self, url: str) -> bool:
        fs, path = self._open(url)
        fs.invalidate_cache(path)
        return bool(self._request(f"inspecting {url}", fs, "isdir", path))

    def exists(self, url: str) -> bool:
        fs, path = self._open(url)
        fs.invalidate_cache(posixpath.dirname(path))
        return bool(self._request(f"inspecting {url}", fs, "exists", path))

    def read_bytes(self, url: str) -> bytes:
        fs, path = self._open(url)
        return bytes(self._request(f"reading {url}", fs, "cat_file", path))

    def fsync_dir(self, url: str) -> None:
        """Nothing to sync: an object is durable once its upload is answered."""
