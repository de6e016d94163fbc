"""The part file: one rank's share of one checkpoint, pickle-free, checksummed, safetensors-compatible.

Layout (the safetensors layout, so ``safetensors.safe_open`` reads the tensors)::

    [u64 little-endian N][N bytes of JSON header, space-padded][tensor bytes, back to back]

The JSON header maps each tensor name to ``{"dtype", "shape", "data_offsets"}`` and carries
``"__metadata__"``, a str -> str map holding:

- ``"format": "tierpoint"`` and ``"tierpoint"``: a JSON document with the format ``version``, the state
  ``skeleton`` (see :mod:`tierpoint.tree`), caller ``extra`` metadata, and one record per tensor
  ``[name, torch dtype, shape, xxh3-64 hex of its bytes, device it was saved from]``;
- ``"tierpoint_header_xxh3"``: xxh3-64 of the header bytes with this value set to sixteen ``0``.

Dtypes safetensors lacks (complex, float8 variants other than e4m3fn/e5m2, ...) are written as ``U8``
entries of shape ``[nbytes]``; their true dtype and shape are in the record, and reading restores them
exactly. Tensor bytes are stored little-endian in the tensor's own memory order (C-contiguous).

Call order: ``write(path, state)`` or ``write_flat(path, flat)``; ``read(path)`` / ``read_flat(path)``;
``read_header(path)`` for a cheap structural check; ``verify(path)`` for a full one.

Modules: :mod:`.plan` lays a state out and builds the header, :mod:`.writing` writes and seals,
:mod:`.header` decodes and validates a header, :mod:`.reading` reads and verifies,
:mod:`.tensor_bytes` views and hashes tensor bytes. This package re-exports their public names.

Invariants:
- A file becomes visible under its final name only complete: written to a dirty name, fsynced,
  renamed, directory fsynced.
- Nothing read from a file is trusted: the header is size-capped, parsed without pickle, checked against
  its checksum, and every offset, dtype and shape is validated against the file's size before anything
  is allocated. Every failure is a :class:`CorruptCheckpointError` naming the file and the reason.
"""

from ..files import dirty_name, fsync_dir, reserve  # the ground floor's, for older callers
from .header import (
    CHECKSUM_KEY,
    DATA_ALIGNMENT,
    DTYPES,
    FORMAT_VERSION,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    PartHeader,
    TensorRecord,
)
from .plan import PartPlan, plan_part
from .reading import (
    PartVerifier,
    is_mapped,
    read,
    read_flat,
    read_header,
    unflatten_checked,
    verify,
)
from .tensor_bytes import byte_view, checksum
from .writing import (
    PartWritten,
    prepare_planned,
    seal_planned,
    write,
    write_flat,
    write_planned,
)

__all__ = [
    "CHECKSUM_KEY",
    "DATA_ALIGNMENT",
    "DTYPES",
    "FORMAT_VERSION",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "PartHeader",
    "PartPlan",
    "PartVerifier",
    "TensorRecord",
    "PartWritten",
    "byte_view",
    "checksum",
    "dirty_name",
    "fsync_dir",
    "is_mapped",
    "plan_part",
    "prepare_planned",
    "read",
    "read_flat",
    "read_header",
    "reserve",
    "seal_planned",
    "unflatten_checked",
    "verify",
    "write",
    "write_flat",
    "write_planned",
]
