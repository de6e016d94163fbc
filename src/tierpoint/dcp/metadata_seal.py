"""A checksum sealed onto the end of ``.metadata``, so that a damaged commit never loads as another.

torch's ``.metadata`` is a bare pickle: a flipped bit can leave one that still loads and means
another checkpoint (a key renamed, a size or an offset changed), which the data files' checksums
(:mod:`tierpoint.dcp.checksums`) cannot always tell. tierpoint's commit appends one line after the
pickle's STOP opcode, ``b"\\ntierpoint-seal xxh3-64 <16 hex digits>\\n"``: the xxh3-64 of the
pickle's bytes. ``pickle.load`` (torch's readers) stops at STOP and never reads it, so plain torch
still loads the checkpoint. Written by hand: torch's format has no place for a checksum.

Call order: the commit publishes :func:`sealed` bytes (one atomic rename or PUT: the seal is never
apart from its pickle); every read calls :func:`unsealed` before anything is unpickled.

Invariants:
- A ``.metadata`` ends either with its pickle (torch's writers, tierpoint before the seal: loaded
  unverified) or with one seal; anything else after the pickle is damage (the unpickler refuses
  stray bytes). A pickle never ends with a newline, so it is never taken for a seal.
- A seal whose checksum differs from the pickle's is damage (:class:`SealMismatch`, which
  :func:`~tierpoint.dcp.safe_pickle.safe_loads` raises as a corrupt file), found before the pickle
  is read.
"""

from __future__ import annotations

import re

import xxhash

_SEAL = re.compile(rb"\ntierpoint-seal xxh3-64 ([0-9a-f]{16})\n\Z")
SEAL_LENGTH = len(b"\ntierpoint-seal xxh3-64 \n") + 16
"""Bytes a seal adds to ``.metadata``."""


class SealMismatch(ValueError):
    """The seal of ``.metadata`` does not match its pickle."""


def sealed(data: bytes) -> bytes:
    """``data`` (a pickle) followed by its seal."""
    return b"%s\ntierpoint-seal xxh3-64 %s\n" % (data, xxhash.xxh3_64_hexdigest(data).encode())


def unsealed(data: bytes) -> tuple[bytes, bool]:
    """The pickle of ``.metadata`` bytes ``data`` and whether it was sealed; raises
    :class:`SealMismatch` if its seal does not match it."""
    found = _SEAL.search(data, max(0, len(data) - SEAL_LENGTH))
    if found is None:
        return data, False
    body = data[: found.start()]
    recorded = found.group(1).decode()
    actual = xxhash.xxh3_64_hexdigest(body)
    if actual != recorded:
        raise SealMismatch(
            f"checksum mismatch: the metadata hashes to {actual}, its seal says {recorded}"
        )
    return body, True
