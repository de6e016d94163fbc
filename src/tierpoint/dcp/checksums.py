"""Checksums of the persistent tier: one pickle-free JSON manifest per rank and save.

torch DCP files carry no checksums. Every rank that writes data files for a save also writes a
manifest with the xxh3-64 checksum of every item it wrote (the item's bytes as ``.metadata``
locates them: ``[offset, offset + length)`` of its data file; for a tensor, its whole
``torch.save`` record). Its name derives from the rank's data file names, token included
(:func:`manifest_name`: ``__3_0.<token>.distcp`` -> ``.checksums-3.<token>.json``), so a manifest of
an earlier save into the same step never passes for this save's. Format::

    {"format": "tierpoint-dcp-checksums", "version": 1, "algorithm": "xxh3-64",
     "files": {"__3_0.<token>.distcp": [[offset, length, "<16 hex digits>"], ...], ...}}

Call order. Writing (the worker job that writes a rank's files, or the synchronous write):
``ranges = results.ranges(token)`` (:mod:`tierpoint.dcp.write_results`); per data file
``range_checksums(file_views, ranges[name])`` over the bytes as they are written (or as they lie
in the file staged in place); then :func:`manifest_bytes` written with the data files, before the
job reports success, so before the finalize gathers the outcomes and before ``.metadata`` is
written: a committed step has every manifest. Reading: :func:`parse_manifest` on the bytes of the
manifest of each data file read (bounded size, every type checked, no code run);
:meth:`Manifest.checksum` of an item; a mismatch is a
:class:`~tierpoint.dcp.safe_pickle.CorruptDCPError` naming file and item.

Invariants:
- A data file without a save token in its name was written by torch's own writer, without
  checksums: it loads unverified, and ``verify`` says so. A tierpoint data file (a token) always
  has its manifest: one that is missing or unreadable, or lacks an item that ``.metadata`` names,
  is damage.
- Checksums are computed off the training thread for async saves (in the worker, from the staging
  memory or the file staged in place), by the saving thread for synchronous ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from ..snapshot_copy import LANES
from .safe_pickle import CorruptDCPError, file_name_problem

FORMAT = "tierpoint-dcp-checksums"
VERSION = 1
ALGORITHM = "xxh3-64"
MANIFEST_PREFIX = ".checksums-"
MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest accepted (about a million items)."""
MAX_OFFSET = 1 << 62

_DATA_FILE = re.compile(r"^__([0-9]{1,9})_[0-9]{1,9}\.([0-9a-z]{1,64})\.distcp$")
_MANIFEST = re.compile(r"^\.checksums-[0-9]{1,9}\.[0-9a-z]{1,64}\.json$")
_HEX = re.compile(r"^[0-9a-f]{16}$")
_HASH_PIECE = 8 << 20


def manifest_name(data_file: str) -> str | None:
    """The manifest that holds the checksums of ``data_file`` (None for a name without a save
    token: torch's own writer, which writes no manifest)."""
    m = _DATA_FILE.match(data_file)
    return f"{MANIFEST_PREFIX}{int(m.group(1))}.{m.group(2)}.json" if m else None


def is_manifest(name: str) -> bool:
    return bool(_MANIFEST.match(name))


def range_checksums(
    views: Sequence[Any], ranges: Sequence[tuple[int, int]], lanes: int = LANES
) -> list[str]:
    """The xxh3-64 of bytes ``[offset, offset + length)`` of the concatenation of ``views`` (a
    file's content in pieces, as it is written), for each range, on ``lanes`` threads (xxhash
    releases the GIL)."""
    pieces = [memoryview(v).cast("B") for v in views]
    try:
        if lanes < 2 or len(ranges) < 2:
            return _hash_ranges(pieces, ranges)
        with ThreadPoolExecutor(
            min(lanes, len(ranges)), thread_name_prefix="tierpoint-hash"
        ) as pool:
            return list(pool.map(lambda r: _hash_ranges(pieces, [r])[0], ranges))
    finally:  # a mapping can be closed only once no view of it is left (every lane ended)
        for piece in pieces:
            piece.release()


def _hash_ranges(pieces: list[memoryview], ranges: Sequence[tuple[int, int]]) -> list[str]:
    out: list[str] = []
    k, start = 0, 0  # pieces[k] holds file bytes [start, start + len(pieces[k]))
    for offset, length in ranges:
        hasher = xxhash.xxh3_64()
        at, end = offset, offset + length
        if at < start:  # a range before the last one: search from the first piece again
            k, start = 0, 0
        while at < end:
            while k < len(pieces) and start + len(pieces[k]) <= at:
                start += len(pieces[k])
                k += 1
            if k == len(pieces):
                raise ValueError(f"range [{offset}, {end}) lies beyond the data ({start} bytes)")
            upto = min(end, start + len(pieces[k]), at + _HASH_PIECE)
            with pieces[k][at - start : upto - start] as chunk:
                hasher.update(chunk)
            at = upto
        out.append(hasher.hexdigest())
    return out


def manifest_bytes(checksums: Mapping[str, Sequence[tuple[int, int, str]]]) -> bytes:
    """The manifest holding ``{data file: [(offset, length, checksum), ...]}``."""
    files = {name: [[o, n, h] for o, n, h in entries] for name, entries in checksums.items()}
    doc = {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "files": files}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: ``{data file: {(offset, length): checksum}}``."""

    location: str
    files: dict[str, dict[tuple[int, int], str]]

    def checksum(self, data_file: str, offset: int, length: int, location: str, what: str) -> str:
        """The recorded checksum of the item at ``[offset, offset + length)`` of ``data_file``;
        a :class:`CorruptDCPError` naming the file's ``location`` and ``what`` if the manifest
        does not record it."""
        found = self.files.get(data_file, {}).get((offset, length))
        if found is None:
            raise CorruptDCPError(location, f"{what}: no checksum recorded in {self.location}")
        return found


def parse_manifest(data: bytes, location: str) -> Manifest:
    """Parse and check a manifest's bytes (at most :data:`MAX_MANIFEST_BYTES`); anything
    malformed is a :class:`CorruptDCPError` naming ``location``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptDCPError(
            location, f"{len(data)} bytes of checksums, over {MAX_MANIFEST_BYTES}"
        )
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptDCPError(location, f"not a checksum manifest ({str(e)[:120]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorruptDCPError(location, "not a tierpoint checksum manifest")
    if doc.get("version") != VERSION or doc.get("algorithm") != ALGORITHM:
        raise CorruptDCPError(
            location,
            f"unsupported manifest version {str(doc.get('version'))[:20]} / algorithm "
            f"{str(doc.get('algorithm'))[:20]}",
        )
    raw = doc.get("files")
    if not isinstance(raw, dict):
        raise CorruptDCPError(location, "'files' is not an object")
    files: dict[str, dict[tuple[int, int], str]] = {}
    for name, entries in raw.items():
        problem = file_name_problem(name)
        if problem or not isinstance(entries, list):
            raise CorruptDCPError(location, problem or f"entries of {name[:80]!r} are not a list")
        files[name] = {}
        for entry in entries:
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and all(type(v) is int and 0 <= v < MAX_OFFSET for v in entry[:2])
                and isinstance(entry[2], str)
                and _HEX.match(entry[2])
            ):
                raise CorruptDCPError(
                    location, f"malformed entry {str(entry)[:80]} for {name[:80]!r}"
                )
            files[name][(entry[0], entry[1])] = entry[2]
    return Manifest(location, files)


def mismatch(data_file: str, what: str, expected: str, got: str) -> CorruptDCPError:
    """The error for an item whose bytes do not have their recorded checksum."""
    return CorruptDCPError(
        data_file, f"checksum mismatch in {what} (recorded {expected}, read {got})"
    )


__all__ = [
    "Manifest",
    "is_manifest",
    "manifest_bytes",
    "manifest_name",
    "mismatch",
    "parse_manifest",
    "range_checksums",
]
