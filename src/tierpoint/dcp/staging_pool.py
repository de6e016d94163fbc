"""Staging buffers for async DCP saves, laid out as the files' tensor sections and reused across saves.

Call order: ``buf = pool.acquire(files)`` when a save snapshots (the buffer already holds every
record's head, tail and padding; only tensor data is copied in), the worker writes from it,
``pool.release(buf)`` once the save is finalized or aborted.

On a RAM file system (tmpfs, /dev/shm) the staging memory can be the checkpoint file itself:
``buf = pool.acquire(files, in_place_dir=step_dir)`` returns a file-backed buffer (an unnamed file of
that file system, see :class:`tierpoint.staging.StagingBuffer`); the snapshot fills it and names it
(:meth:`~tierpoint.staging.StagingBuffer.link`), then ``pool.consumed(buf)`` hands it over and starts
preparing the next one (allocated, faulted in and templated) in a background thread, so that the
next save finds it ready and nothing is left for the worker to write.

``pool.warm_up(nbytes, device, in_place_dir)`` (:func:`tierpoint.dcp.warm_up`), ahead of the first
save, prepares one buffer in the background (allocated for an upper bound of the save's tensor
sections, its pages faulted in, pinned for a state on a device): the first ``acquire`` whose layout
fits takes it, whatever the layout (planning has not happened yet), and writes its templates.

Invariants:
- A buffer is allocated once per layout (:attr:`RankFiles.key`) and reused by later saves of the
  same layout: host memory stays flat. A save never gets a buffer another unfinished save still uses
  (with several saves in flight, the pool holds one buffer per save in flight).
- A free buffer of another layout is freed when a new layout is acquired (the layout changed).
- The buffers are :class:`tierpoint.staging.StagingBuffer` (memfd shared memory), so the background
  worker maps them by file descriptor without copying. Every buffer leaves the pool through its
  ``close`` (which unpins it before unmapping it), or, dropped, through its finalizer.
- In-place buffers are never reused (they became checkpoint files); at most one spare is held, for
  the layout and file system of the last one consumed. If the file system has no room for one,
  ``acquire`` falls back to a memfd buffer and the save is written as usual. After ``close()`` no
  spare is prepared (a save still in flight gives its used-up buffer back without one) until the
  pool is used again.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy

from ..staging import StagingBuffer
from .file_plan import RankFiles

logger = logging.getLogger("tierpoint")

_SPARE_WAIT = 120.0
"""Seconds a save (or ``close``) waits for a spare still being prepared before going on without it."""


class StagingPool:
    """Reusable staging buffers, keyed by file layout (see the module docstring)."""

    def __init__(self) -> None:
        self._free: list[tuple[tuple, StagingBuffer]] = []
        self._busy: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._spare: tuple[tuple, int, StagingBuffer] | None = None  # (layout key, st_dev, buffer)
        self._preparing: list[threading.Thread] = []  # started threads preparing a spare
        self._closed = False  # set by close(), cleared by the next acquire(): no spare meanwhile
        self._warm: tuple[int | None, StagingBuffer] | None = None  # (st_dev if in place, buffer)
        self.allocations = 0
        """How many buffers were ever allocated (tests check reuse with it)."""

    def acquire(self, files: RankFiles, in_place_dir: str | None = None) -> StagingBuffer:
        """A buffer laid out as ``files``; file-backed on ``in_place_dir``'s file system if given
        (a spare prepared earlier when it fits), else memfd memory."""
        with self._lock:
            self._closed = False
        self._join_preparing(_SPARE_WAIT)
        if in_place_dir is not None:
            buf = self._in_place_buffer(files, in_place_dir)
            if buf is not None:
                return buf
        with self._lock:
            for k, (key, buf) in enumerate(self._free):
                if key == files.key:
                    del self._free[k]
                    self._busy[buf.id] = key
                    return buf
            for _, stale in self._free:  # another layout: it is not coming back
                stale.close()
            self._free.clear()
        buf = self._take_warm(files, None) or self._allocate(files)
        with self._lock:
            self._busy[buf.id] = files.key
        return buf

    def release(self, buf: StagingBuffer) -> None:
        with self._lock:
            key = self._busy.pop(buf.id, None)
            if key is not None and not buf.file_backed:
                self._free.append((key, buf))
                return
        if key is not None:  # an in-place buffer whose snapshot failed: its file was never named
            buf.close()

    def consumed(self, buf: StagingBuffer, files: RankFiles, directory: str) -> None:
        """``buf`` (file-backed) became a checkpoint file: drop it and prepare the next save's
        buffer for the same layout in ``directory``'s file system, in the background."""
        with self._lock:
            self._busy.pop(buf.id, None)
        self._join_preparing(_SPARE_WAIT)
        thread = threading.Thread(
            target=self._prepare_spare,
            args=(buf, files, directory),
            name="tierpoint-spare-staging",
            daemon=True,
        )
        with self._lock:  # started and listed at once: a join or close() sees it
            if not self._closed:
                thread.start()
                self._preparing.append(thread)
                return
        buf.close()

    def warm_up(self, nbytes: int, device: int | None, in_place_dir: str | None = None) -> None:
        """Prepare, in a background thread, one buffer of ``nbytes`` for the next save that has no
        buffer of its layout yet: its pages faulted in, pinned for copies from ``device`` (a CUDA
        index, or None), file-backed on ``in_place_dir``'s file system if given (see
        :func:`tierpoint.dcp.warm_up`). Replaces a buffer an earlier call prepared and no save took."""
        self._join_preparing(_SPARE_WAIT)

        def prepare() -> None:
            try:
                buf = StagingBuffer(nbytes, in_place_dir)
                buf.prepare(device)
                where = os.stat(in_place_dir).st_dev if in_place_dir is not None else None
            except Exception as e:  # noqa: BLE001 - the first save allocates itself
                logger.warning("preparing staging memory ahead of the first save failed: %s", e)
                return
            with self._lock:
                old, self._warm = self._warm, (where, buf)
                self.allocations += 1
            if old is not None:
                old[1].close()

        thread = threading.Thread(target=prepare, name="tierpoint-warm-up", daemon=True)
        with self._lock:
            self._closed = False
            thread.start()
            self._preparing.append(thread)

    def wait_for_spare(self, timeout: float | None = None) -> bool:
        """Wait until the background preparation of the next in-place buffer (if any) is over;
        False if it still runs after ``timeout`` seconds. (Nothing needs this: the next save waits
        itself. It lets a benchmark or a latency-sensitive phase start on a quiet machine.)"""
        self._join_preparing(timeout)
        with self._lock:
            return not self._preparing

    def close(self) -> None:
        """Free every buffer held (the spare file too); a save still in flight prepares no spare.
        The pool can be used again afterwards."""
        with self._lock:
            self._closed = True
        self._join_preparing(_SPARE_WAIT)
        with self._lock:
            for _, buf in self._free:
                buf.close()
            self._free.clear()
            if self._spare is not None:
                self._spare[2].close()
                self._spare = None
            if self._warm is not None:
                self._warm[1].close()
                self._warm = None

    @property
    def bytes_held(self) -> int:
        with self._lock:
            spare = self._spare[2].nbytes if self._spare is not None else 0
            warm = self._warm[1].nbytes if self._warm is not None else 0
            return sum(b.nbytes for _, b in self._free) + spare + warm

    # ------------------------------------------------------------------ in-place buffers

    def _take_warm(self, files: RankFiles, device: int | None) -> StagingBuffer | None:
        """The buffer :meth:`warm_up` prepared, if it is big enough and of the wanted kind (memfd:
        ``device`` None; else file-backed on that file system), its templates written; else None."""
        with self._lock:
            warm = self._warm
            if warm is None or warm[0] != device or warm[1].nbytes < files.staging_bytes:
                return None
            self._warm = None
        return _templated(warm[1], files)

    def _in_place_buffer(self, files: RankFiles, directory: str) -> StagingBuffer | None:
        device = os.stat(directory).st_dev
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            key, spare_device, buf = spare
            if key == files.key and spare_device == device:
                with self._lock:
                    self._busy[buf.id] = key
                return buf
            buf.close()
        try:
            buf = self._take_warm(files, device) or self._allocate(files, directory)
        except OSError as e:
            logger.info("no room to stage in place in %s (%s): staging in memory", directory, e)
            return None
        with self._lock:
            self._busy[buf.id] = files.key
        return buf

    def _allocate(self, files: RankFiles, directory: str | None = None) -> StagingBuffer:
        buf = _allocate(files, directory)
        with self._lock:
            self.allocations += 1
        return buf

    def _prepare_spare(self, used: StagingBuffer, files: RankFiles, directory: str) -> None:
        pin_for = used.pinned_for
        used.close()  # unpinning and unmapping a large buffer takes a while: off the trainer
        with self._lock:
            if self._closed:  # closed meanwhile: no spare to hold
                return
        try:
            device = os.stat(directory).st_dev
            buf = _allocate(files, directory)
            buf.prepare(pin_for)  # pinned ahead of the save that fills it, as the used one was
        except Exception as e:  # noqa: BLE001 - the next save allocates (or falls back) itself
            logger.debug("could not prepare a spare staging file in %s: %s", directory, e)
            return
        with self._lock:
            self.allocations += 1
            if self._closed:
                old: tuple[tuple, int, StagingBuffer] | None = (files.key, device, buf)
            else:
                old, self._spare = self._spare, (files.key, device, buf)
        if old is not None:
            old[2].close()

    def _join_preparing(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            threads = list(self._preparing)
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._preparing = [t for t in self._preparing if t.is_alive()]


def _allocate(files: RankFiles, directory: str | None = None) -> StagingBuffer:
    return _templated(StagingBuffer(files.staging_bytes, directory), files)


def _templated(buf: StagingBuffer, files: RankFiles) -> StagingBuffer:
    """``buf`` with ``files``' templates written and its tensors' views made (closed if that
    fails)."""
    try:
        _write_templates(buf, files)
        buf.views_for(files.key, files.views)  # a spare's in the background, not in the save
    except BaseException:
        buf.close()
        raise
    return buf


def _write_templates(buf: StagingBuffer, files: RankFiles) -> None:
    """Put every record's head and tail in place (the memory starts zeroed: padding is done)."""
    memory = buf.tensor.numpy()  # a view; writing bytes through numpy costs less than torch's
    for f in files.files:
        for slot in f.tensors:
            at = f.staging_base + slot.offset
            head, tail = slot.template.head, slot.template.tail
            memory[at : at + len(head)] = numpy.frombuffer(head, dtype=numpy.uint8)
            if tail:
                at += len(head) + slot.template.nbytes
                memory[at : at + len(tail)] = numpy.frombuffer(tail, dtype=numpy.uint8)
