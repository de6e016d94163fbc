"""The bytes torch DCP stores for one tensor, produced without serializing the tensor's data.

torch's ``FileSystemReader`` reads each tensor of a ``.distcp`` file with ``torch.load`` on the slice
``[offset, offset + length)``: a slice holds exactly what ``torch.save(tensor)`` writes for a
contiguous CPU tensor whose storage is the tensor. That is a zip archive whose members are all
stored uncompressed, so its bytes are ``head + raw tensor bytes + tail``, where ``head`` and ``tail``
depend only on the dtype and the shape when no CRC-32 is recorded (torch's own
``set_crc32_options(False)`` mode, which ``torch.load`` reads).

:func:`record_template` computes ``(head, tail)`` once per (dtype, shape) by running ``torch.save``
on an uninitialised tensor of that dtype and shape into a stream that keeps every piece except the
tensor's data (never read, never copied); the result is cached. The data starts at a multiple of 64
bytes from the start of the record (torch's storage alignment), so a record placed at a 64-aligned
file offset has 64-aligned data.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.serialization import get_crc32_options, set_crc32_options

RECORD_ALIGNMENT = 64
_lock = threading.Lock()


@dataclass(frozen=True)
class RecordTemplate:
    """``head`` + ``nbytes`` raw bytes + ``tail`` is the torch.save record of one tensor."""

    head: bytes
    tail: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


class _Recorder:
    """A write-only stream that keeps torch.save's pieces except the tensor data (left as a gap)."""

    def __init__(self, data_ptr: int, nbytes: int) -> None:
        self.pieces: list[bytes | None] = []
        self._ptr = data_ptr
        self._nbytes = nbytes
        self.pos = 0

    def write(self, piece: object) -> int:
        view = memoryview(piece).cast("B")  # type: ignore[arg-type]
        n = len(view)
        is_data = (
            self._nbytes > 0
            and n == self._nbytes
            and np.frombuffer(view, dtype=np.uint8).ctypes.data == self._ptr
        )
        self.pieces.append(None if is_data else bytes(view))
        self.pos += n
        return n

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=1 << 16)
def record_template(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordTemplate:
    """The head and tail of ``torch.save`` of a contiguous ``dtype`` tensor of ``shape``."""
    tensor = torch.empty(shape, dtype=dtype)  # never touched: the recorder skips its bytes
    nbytes = tensor.numel() * tensor.element_size()
    recorder = _Recorder(tensor.data_ptr(), nbytes)
    with _lock:
        crc = get_crc32_options()
        set_crc32_options(False)
        try:
            torch.save(tensor, recorder)
        finally:
            set_crc32_options(crc)
    gaps = [i for i, p in enumerate(recorder.pieces) if p is None]
    if nbytes == 0:
        return RecordTemplate(b"".join(p for p in recorder.pieces if p is not None), b"", 0)
    if len(gaps) != 1:
        raise RuntimeError(
            f"torch.save wrote the data of a {dtype} {list(shape)} tensor in an unexpected way"
        )
    head = b"".join(p for p in recorder.pieces[: gaps[0]] if p is not None)
    tail = b"".join(p for p in recorder.pieces[gaps[0] + 1 :] if p is not None)
    return RecordTemplate(head, tail, nbytes)


def aligned(offset: int) -> int:
    """``offset`` rounded up to the record alignment."""
    return -(-offset // RECORD_ALIGNMENT) * RECORD_ALIGNMENT
