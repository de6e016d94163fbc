"""The persistent background worker process (one per rank) and the handle the training process holds.

Call order (training process): ``Worker()`` spawns the process once; ``submit(call_id, fn, args,
kwargs)`` sends a call (staging buffers in the arguments are shared by file descriptor the first
time and referred to by id afterwards; a large call message travels in a memfd, so sending never
waits for the worker); ``results()`` collects finished calls without blocking; ``exitcode`` tells
whether the process died; ``stop()`` / ``kill()`` end it. ``preload(modules)`` imports the modules
of calls to come while the worker is idle (a first call then finds them).

Worker process: receives calls over its pipe, runs them one at a time, each in the working
directory the trainer had when it submitted the call (relative paths mean the same to both),
answers ``(call_id, ok, result_or_message, error_type)`` (a result pickle cannot send: ``None``).
It ends the moment its trainer process dies, in the middle of a call too
(:func:`_die_with_trainer`), and exits when the pipe closes, so no worker outlives its rank; it
lives as long as that process, whichever of its threads started it. It ignores SIGINT and SIGTERM
from its first instruction on: a Ctrl-C (sent to the terminal's whole process group) and a
job-wide SIGTERM (Slurm's preemption notice) are the trainer's to handle, and the saves in flight
finish; the trainer stops it (``stop`` / ``kill``), and Linux kills it with its trainer.

Invariants: the worker knows no file format and no tier. A call is any function at the top level of
an importable module (it travels by module and name; the tiers keep theirs in their own ``jobs``
modules, e.g. :mod:`tierpoint.local.jobs`, :mod:`tierpoint.dcp.jobs`); a staging buffer argument
arrives as a :class:`BufferRef`, whose bytes :func:`resolve_buffer` gives; so does a
:class:`~tierpoint.staging.SourceFile` (mapped read-only: a job reads a file the trainer's tensors
view instead of a staging copy of them). Files jobs fill stay mapped between calls
(:mod:`.target_files`), swept while the worker is idle.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import mmap
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

from ..errors import CheckpointingError, CoordinationTimeoutError, error_text
from ..staging import SourceFile, StagingBuffer
from . import target_files

logger = logging.getLogger("tierpoint")

SWEEP_EVERY = 1.0
"""Seconds between the idle worker's sweeps of the files it keeps mapped (:mod:`.target_files`)."""
_PARENT_POLL_S = 0.2
"""How often a worker without a pidfd of its trainer checks that the trainer is still its parent."""

_buffers: dict[str, memoryview] = {}
"""Worker side: staging buffers mapped from the trainer, by id."""
_INLINE_BYTES = 16 << 10
"""A call's pickled message up to this size goes through the pipe; a larger one (a plan of many
tensors) goes through a memfd whose descriptor the pipe carries: the pipe's buffer (about 200 KiB)
never fills, so sending a call never waits for a worker that is busy or still starting."""


@dataclass(frozen=True)
class BufferRef:
    """A staging buffer as the worker knows it."""

    id: str
    nbytes: int


SHARED = (StagingBuffer, SourceFile)
"""What travels to the worker as shared memory (by descriptor, once), not as bytes."""


def resolve_buffer(buffer: StagingBuffer | SourceFile | BufferRef) -> memoryview:
    """The bytes of a staging buffer or a source file (read-only), in the trainer (direct) or in
    the worker (mapped by id)."""
    if isinstance(buffer, StagingBuffer):
        return memoryview(buffer.tensor.numpy())
    if isinstance(buffer, SourceFile):
        return buffer.view()
    return _buffers[buffer.id][: buffer.nbytes]


def _die_with_trainer(parent_pid: int | None, from_main_thread: bool) -> None:
    """End this process the moment the trainer process dies, so that no orphan keeps writing.

    Linux's ``PR_SET_PDEATHSIG`` fires when the *thread* that started this process exits, not the
    process: a queue made on a thread that then ended (a set-up thread, a pool's) lost its worker
    and the save in flight with it. It is used only when the trainer's main thread started us
    (that thread ends with the process); otherwise a thread waits on a pidfd of the trainer
    process (where there is none, it polls for this process's parent to change) and kills this
    process when it exits."""
    if from_main_thread or parent_pid is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - not Linux: the pipe still ends us
            pass
        return
    try:
        pidfd: int | None = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # no pidfd (a kernel before 5.3, a seccomp filter), or gone
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the trainer process has exited
        else:  # an orphan is adopted by another process: its parent changes
            while os.getppid() == parent_pid:
                time.sleep(_PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tierpoint-trainer-watch", daemon=True).start()


def _close_mapping(m: mmap.mmap) -> None:
    """Unmap a dropped staging buffer. Views of it may outlive a failed call (its traceback holds
    them until collected): collect once, and if some are still alive leave the unmapping to them."""
    try:
        m.close()
        return
    except BufferError:
        gc.collect()
    try:
        m.close()
    except BufferError:
        pass  # unmapped when its last view goes


def _read_call(conn: Any, nbytes: int) -> Any:
    """Worker side: the call message the trainer put in a memfd (:data:`_INLINE_BYTES`)."""
    fd = reduction.recv_handle(conn)
    try:
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as data:
            return reduction.ForkingPickler.loads(data)
    finally:
        os.close(fd)


def _cwd() -> str | None:
    """The training process's working directory now (None if it was removed)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _enter(cwd: str | None) -> None:
    """Worker side: run a call in the directory the trainer was in when it submitted it, so that a
    relative path in its arguments names what it named to the trainer (the worker otherwise keeps
    the directory it started in, while the trainer may have changed directory since)."""
    if cwd is not None and cwd != _cwd():
        os.chdir(cwd)


_IOPRIO_ENV = "TIERPOINT_WORKER_IO_CLASS"


def _deprioritize(nice: int, io_class: str | None) -> None:
    """Raise this process's nice value to ``nice`` (never lower it) and, when given, set its I/O
    scheduling class with ``ionice``; a failure leaves the priority as it was."""
    increment = nice - os.nice(0)
    if increment > 0:
        os.nice(increment)
    ionice = shutil.which("ionice") if io_class else None
    if io_class and ionice is None:
        print("tierpoint worker: ionice not found; I/O priority unchanged", file=sys.stderr)
    elif ionice is not None:
        done = subprocess.run(
            [ionice, "-c", io_class, "-p", str(os.getpid())], capture_output=True, check=False
        )
        if done.returncode:
            print(f"tierpoint worker: ionice -c {io_class} failed", file=sys.stderr)


_START = (  # the worker's program: the signals ignored before anything is imported
    "import signal\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "from tierpoint.asyncsave._entry import main\n"
    "main()\n"
)


def worker_main(conn: Any, parent_pid: int | None = None, from_main_thread: bool = True) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):  # the trainer's to handle (module docstring)
        signal.signal(signum, signal.SIG_IGN)
    _die_with_trainer(parent_pid, from_main_thread)
    # Yield the CPU to training: checkpoint writes only need what training leaves idle (and still
    # progress when it leaves none, at a small share).
    _deprioritize(int(os.environ.get("TIERPOINT_WORKER_NICE", "19")), os.environ.get(_IOPRIO_ENV))
    if parent_pid is not None and os.getppid() != parent_pid:
        return  # the trainer died before we were ready
    maps: dict[str, mmap.mmap] = {}
    target_files.keep_mappings()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            while not conn.poll(SWEEP_EVERY):
                target_files.sweep()  # a deleted file's pages go within about a second
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        if msg[0] == "call_file":
            msg = _read_call(conn, msg[1])
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "buffer":
            _, buf_id, nbytes, writable = msg
            fd = reduction.recv_handle(conn)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            maps[buf_id] = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=prot)
            os.close(fd)
            _buffers[buf_id] = memoryview(maps[buf_id])
        elif kind == "import":
            for name in msg[1]:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the call that needs it reports the error
                    pass
        elif kind == "drop":
            _buffers.pop(msg[1], None)
            m = maps.pop(msg[1], None)
            if m is not None:
                _close_mapping(m)
        elif kind == "call":
            target_files.sweep()  # (calls may come more often than idle seconds)
            _, call_id, fn, args, kwargs, cwd = msg
            try:
                _enter(cwd)
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - reported to the trainer, which decides
                conn.send((call_id, False, error_text(e), type(e).__name__))
                continue
            try:
                conn.send((call_id, True, result, None))
            except OSError:
                return  # the trainer is gone
            except Exception:  # noqa: BLE001 - the result cannot be pickled (nothing was sent)
                # The call succeeded: its result is not what the trainer waits for (the queue, as
                # NVRx's, does not use it), so this must not fail the call and undo its work.
                conn.send((call_id, True, None, None))


class Worker:
    """Handle on one background worker process (``nice``: its nice value, default
    ``TIERPOINT_WORKER_NICE`` or 19; ``io_class``: its ``ionice`` class, default unchanged).

    The worker is started as ``python -c`` :data:`_START` (not by multiprocessing's spawn, which
    would re-import the user's training script) and talks over an inherited socket pair.
    """

    def __init__(self, nice: int | None = None, io_class: int | None = None) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        if nice is not None:
            env["TIERPOINT_WORKER_NICE"] = str(nice)
        if io_class is not None:
            env[_IOPRIO_ENV] = str(io_class)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _START,
                str(child_sock.fileno()),
                str(os.getpid()),
                str(int(threading.current_thread() is threading.main_thread())),
            ],
            pass_fds=[child_sock.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._sent: set[str] = set()
        self._lock = threading.Lock()
        self.ready_at: float | None = None  # time.monotonic() when the worker reported ready
        self._early: list[tuple[int, bool, Any, str | None]] = []

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def _transport(self, value: Any) -> Any:
        if isinstance(value, SHARED):
            if value.id not in self._sent:
                writable = isinstance(value, StagingBuffer)  # a source file is only read
                self._conn.send(("buffer", value.id, value.nbytes, writable))
                reduction.send_handle(self._conn, value.fd, self.process.pid)
                self._sent.add(value.id)
            return BufferRef(value.id, value.nbytes)
        return value

    def submit(self, call_id: int, fn: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        with self._lock:
            args = tuple(self._transport(a) for a in args)
            kwargs = {k: self._transport(v) for k, v in kwargs.items()}
            message = reduction.ForkingPickler.dumps(("call", call_id, fn, args, kwargs, _cwd()))
            if len(message) <= _INLINE_BYTES:
                self._conn.send_bytes(message)  # (what ``send`` of the tuple sends)
                return
            fd = os.memfd_create("tierpoint-call", os.MFD_CLOEXEC)
            try:
                with open(fd, "wb", closefd=False) as f:
                    f.write(message)
                self._conn.send(("call_file", len(message)))
                reduction.send_handle(self._conn, fd, self.process.pid)
            finally:
                os.close(fd)  # the worker holds its own descriptor once sent

    def preload(self, modules: list[str]) -> None:
        """Have the worker import ``modules`` now, before the first call that needs them."""
        with self._lock:
            self._conn.send(("import", list(modules)))

    def drop_buffers(self, keep: set[str]) -> None:
        """Unmap staging buffers the trainer no longer uses."""
        with self._lock:
            self._drop(self._sent - keep)
            self._sent &= keep

    def forget(self, buffer_ids: set[str]) -> None:
        """Unmap these shared files now (source files no later call reads)."""
        with self._lock:
            self._drop(buffer_ids & self._sent)
            self._sent -= buffer_ids

    def _drop(self, buffer_ids: set[str]) -> None:
        """Tell the worker to unmap ``buffer_ids``; nothing to do when it died (its mappings went
        with it, and the queue notes the death against its calls). Under ``_lock``."""
        try:
            for buf_id in buffer_ids:
                self._conn.send(("drop", buf_id))
        except OSError:
            pass

    def results(self, wait: float = 0.0) -> list[tuple[int, bool, Any, str | None]]:
        """Finished calls, waiting at most ``wait`` seconds for the first one."""
        out, self._early = self._early, []
        try:
            while self._conn.poll(wait if not out else 0):
                msg = self._conn.recv()
                if msg[0] == "ready":
                    self.ready_at = time.monotonic()
                else:
                    out.append(msg)
        except (EOFError, OSError):
            pass  # the worker died; exitcode tells
        return out

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the worker finished starting (imports done); raise if it died or timed out."""
        deadline = time.monotonic() + timeout
        while self.ready_at is None:
            if self.exitcode is not None:
                raise CheckpointingError(
                    f"the background worker exited while starting (code {self.exitcode})"
                )
            if time.monotonic() > deadline:
                raise CoordinationTimeoutError(
                    f"the background worker did not start within {timeout:g} s"
                )
            self._early.extend(self.results(0.05))

    def stop(self, timeout: float = 2.0) -> None:
        try:
            with self._lock:
                self._conn.send(("stop",))
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._conn.close()

    def kill(self) -> None:
        """SIGKILL the worker and reap it; a worker that does not end within 10 s (a process stuck
        in the kernel, e.g. on a hung file system) is left to the system, with a WARNING."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            logger.warning(
                "the background worker (pid %d) did not end within 10 s of SIGKILL; left behind",
                self.process.pid,
            )
