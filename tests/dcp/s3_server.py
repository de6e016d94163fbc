"""A real S3-compatible server (moto's server mode) on 127.0.0.1 for the persistent tier's tests.

Use in a test module::

    from tests.dcp.s3_server import s3_bucket, s3_server  # noqa: F401 - pytest fixtures

``s3_bucket`` yields ``(url, storage_options)`` for a fresh, emptied-afterwards bucket; the
server runs once per session. Dummy AWS credentials are set in the environment while it runs (child
processes, such as spawned ranks and their background workers, inherit them).

``faulty_endpoint`` makes :class:`FaultyEndpoint` proxies in front of that server: outages (stop,
kill, restart) and injected errors for the object-store failure tests. Running this module starts
one such proxy (that is how :class:`FaultyEndpoint` starts it).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

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


# ------------------------------------------------------------------------------ a faulty endpoint
#
# ``FaultyEndpoint`` runs a small HTTP proxy in its own process in front of the session's moto
# server. Tests stop that process (SIGSTOP: the port still accepts connections, nothing answers),
# kill it (SIGKILL: connections reset, then refused) and start it again on the same port, while
# moto keeps what was stored, as a real object store does across an outage of its front end. It can
# also answer the first UploadPart requests with an HTTP error, refuse unknown credentials, and
# apply ``.metadata`` uploads late (after the client gave up waiting for the reply).

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "expect",
}
_CODES = {500: "InternalError", 503: "SlowDown", 400: "InvalidArgument", 403: "AccessDenied"}
"""The S3 error code the proxy answers an injected status with."""


def _serve_proxy(upstream: str, port: int, faults: dict[str, Any]) -> None:
    """The proxy process: forwards every request to ``upstream``; prints its port when ready."""
    import http.client
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlsplit

    target = urlsplit(upstream)
    lock = threading.Lock()
    counts = {"upload_part": 0, "failed": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _reply(self, code: int, headers: list[tuple[str, str]], body: bytes) -> None:
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, code: int, name: str, message: str) -> None:
            xml = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{name}</Code>"
                f"<Message>{message}</Message></Error>"
            ).encode()
            self._reply(code, [("Content-Type", "application/xml")], xml)

        def _handle(self) -> None:
            body = self._body()
            url = urlsplit(self.path)
            if url.path == "/__faults__":
                with lock:
                    data = json.dumps(counts).encode()
                self._reply(200, [("Content-Type", "application/json")], data)
                return
            key = faults.get("key")
            if key and f"Credential={key}/" not in self.headers.get("Authorization", ""):
                self._error(403, "InvalidAccessKeyId", "The AWS Access Key Id does not exist")
                return
            query = parse_qs(url.query)
            if self.command == "PUT" and "partNumber" in query and "uploadId" in query:
                with lock:
                    counts["upload_part"] += 1
                    fail = counts["failed"] < faults.get("fail_parts", 0)
                    counts["failed"] += fail
                if fail:
                    status = faults.get("status", 503)
                    self._error(status, _CODES[status], f"injected {status}")
                    return
            if faults.get("refuse_data_deletes") and (
                (self.command == "DELETE" and url.path.endswith(".distcp"))
                or (self.command == "POST" and "delete" in url.query and b".distcp" in body)
            ):
                self._error(403, _CODES[403], "injected: no permission to delete data objects")
                return
            failing = faults.get("failing_reads")
            if failing and self.command in ("GET", "HEAD") and failing in url.path:
                self._error(503, _CODES[503], "injected: this part of the store is unavailable")
                return
            if self.command == "PUT" and url.path.endswith("/.metadata"):
                time.sleep(faults.get("late_metadata", 0))
            time.sleep(faults.get("latency", 0))  # a store farther away than 127.0.0.1
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                keep = [
                    (k, v)
                    for k, v in resp.getheaders()
                    if k.lower() not in _HOP_BY_HOP
                    and (k.lower() != "content-length" or self.command == "HEAD")
                ]
                self._reply(resp.status, keep, data)
            finally:
                conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    class Server(ThreadingHTTPServer):
        allow_reuse_address = True
        daemon_threads = True
        request_queue_size = 128  # as moto's (werkzeug's) listen backlog

        def handle_error(self, request: object, client_address: object) -> None:
            pass  # clients that gave up while the process was stopped: nothing to report

    def exit_with_parent(parent: int) -> None:  # no proxy outlives an interrupted test run
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    server = Server(("127.0.0.1", port), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


class FaultyEndpoint:
    """An endpoint URL in front of moto that a test can stop, resume, kill and restart (see above).

    Faults: ``fail_parts``: how many UploadPart requests (the first ones) are answered with
    ``status`` (503 SlowDown, 500 InternalError, or 400 InvalidArgument: a request S3 will never
    accept). ``key``: requests signed with another access
    key id are refused (403 InvalidAccessKeyId), as S3 refuses unknown credentials.
    ``late_metadata``: seconds a PUT of a ``.metadata`` object is held before moto applies it.
    ``failing_reads``: reads (GET, HEAD) of keys containing this text are answered with 503
    SlowDown, every time (a part of the store that stays unavailable).
    ``refuse_data_deletes``: deleting a ``.distcp`` object (alone or in a bulk delete) is answered
    with 403 AccessDenied. ``latency``: seconds every request is held (benchmarks: a store farther
    away than this machine).
    """

    def __init__(self, upstream: str, **faults: Any) -> None:
        self.upstream = upstream
        self.faults = faults
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the proxy process (on the port it had before, if any).

        The first start picks the port with :func:`tierpoint.testing.free_port` (below the
        kernel's ephemeral range), not port 0: a port the kernel chose is the kernel's to hand to
        another process (a store, a gloo socket, a client) while the proxy is killed, and the
        restart on it could then fail ("address already in use") when tests run in parallel."""
        from tierpoint.testing import free_port  # here: the proxy process need not import torch

        if self.port:
            self._start()
            return
        for attempt in range(5):  # another explicit choice may take the port first
            self.port = free_port()
            try:
                self._start()
                return
            except RuntimeError:
                if attempt == 4:
                    raise

    def _start(self) -> None:
        import json

        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.dcp.s3_server",
                self.upstream,
                str(self.port),
                json.dumps(self.faults),
            ],
            cwd=root,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # the port, once it listens
        if not line.strip().isdigit():
            self.kill()
            raise RuntimeError(f"the fault proxy did not start (got {line!r})")
        self.port = int(line)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted by the kernel, nothing is answered."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: open connections are reset, new ones refused (until :meth:`start`)."""
        if self.running():
            assert self.process is not None
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(10)
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()

    def counts(self) -> dict[str, int]:
        """How many UploadPart requests arrived and how many were failed on purpose."""
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/__faults__", timeout=10) as reply:
            return json.loads(reply.read())


@pytest.fixture
def faulty_endpoint(s3_server: str) -> Iterator[Callable[..., FaultyEndpoint]]:
    """A factory of :class:`FaultyEndpoint` in front of the session's moto server; every endpoint
    made is killed afterwards."""
    made: list[FaultyEndpoint] = []

    def make(**faults: Any) -> FaultyEndpoint:
        endpoint = FaultyEndpoint(s3_server, **faults)
        made.append(endpoint)
        return endpoint

    try:
        yield make
    finally:
        for endpoint in made:
            endpoint.kill()


if __name__ == "__main__":
    import json

    _serve_proxy(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
