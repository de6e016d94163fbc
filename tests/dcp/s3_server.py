"""A real S3-compatible server (moto's server mode) on 127.0.0.1 for the persistent tier's tests.

Use in a test module::

    from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures

``s3_bucket`` yields ``(url, storage_options)`` for a fresh, emptied-afterwards bucket; the
server runs once per session. Dummy AWS credentials are set in the environment while it runs (child
processes, such as spawned ranks and their background workers, inherit them).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator

import pytest

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tierpoint-test",
    "AWS_SECRET_ACCESS_KEY": "tierpoint-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server started for this session."""
    server_module = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    saved = {k: os.environ.get(k) for k in _CREDENTIALS}
    os.environ.update(_CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[tuple[str, dict]]:
    """``("s3://<fresh bucket>", storage_options)``; the bucket is emptied and removed afterwards."""
    import s3fs

    options = {"endpoint_url": s3_server}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"tierpoint-{os.getpid()}-{next(_buckets)}"
    fs.mkdir(bucket)
    try:
        yield f"s3://{bucket}", options
    finally:
        fs.invalidate_cache()
        if fs.exists(bucket):
            fs.rm(bucket, recursive=True)
