"""Single files the commands read besides part files: ``torch.save`` files and other writers'
safetensors files.

Call order: :func:`kind_of_file` by the name's suffix; then :func:`safetensors_header` /
:func:`safetensors_metadata` (the JSON header, its length checked against the file first;
:func:`is_part_metadata` tells tierpoint's part files, :func:`is_plain_safetensors` other writers'
intact ones) or :func:`load_pt` (``torch.load(weights_only=True)``); :func:`check_pt_crcs` checks a
``torch.save`` file's zip records against their CRC-32s (what ``tierpoint verify`` can check of it).

Invariants: no code in a file runs; a damaged file is a :class:`~tierpoint.cli.output.CommandError`
naming it.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

from .output import CommandError


def kind_of_file(path: str) -> str | None:
    """``"safetensors"`` or ``"pt"`` by the name's suffix, else None."""
    lower = path.lower()
    if lower.endswith(".safetensors"):
        return "safetensors"
    if lower.endswith((".pt", ".pth")):
        return "pt"
    return None


def safetensors_metadata(path: str) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors file's header."""
    meta = safetensors_header(path).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise CommandError(f"{path}: not a safetensors file: __metadata__ is not a map")
    return meta


def is_part_metadata(meta: dict[str, Any]) -> bool:
    """Whether a safetensors ``__metadata__`` is a tierpoint part file's (any of its keys: a damaged
    one still counts)."""
    return meta.get("format") == "tierpoint" or any(
        k in meta for k in ("tierpoint", "tierpoint_header_xxh3")
    )


def is_plain_safetensors(path: str) -> bool:
    """Whether ``path`` is another writer's safetensors file (``tierpoint convert``'s included) as
    far as its layout shows: its header parses, is no part file's, and its tensors fill the file.
    Such a file has no checksums to verify."""
    try:
        header, data_bytes = _header_and_data_bytes(path)
        meta = header.get("__metadata__") or {}
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (CommandError, OSError, TypeError, KeyError, IndexError):
        return False
    return (
        isinstance(meta, dict) and not is_part_metadata(meta) and max(ends, default=0) == data_bytes
    )


def safetensors_header(path: str) -> dict[str, Any]:
    """A safetensors file's JSON header (its length checked against the file before reading)."""
    return _header_and_data_bytes(path)[0]


def _header_and_data_bytes(path: str) -> tuple[dict[str, Any], int]:
    """The JSON header and how many bytes follow it."""
    from ..fileformat import MAX_HEADER_BYTES

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{size} bytes, too short for a safetensors header")
            n = int.from_bytes(prefix, "little")
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header length of {n} bytes in a file of {size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # (UnicodeDecodeError too)
                raise ValueError(f"the header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        return header, size - 8 - n
    except ValueError as e:
        safetensors = kind_of_file(path) == "safetensors"
        what = "corrupt, or not a safetensors file" if safetensors else "not a checkpoint file"
        raise CommandError(f"{path}: {what}: {e}") from e


def load_pt(path: str) -> Any:
    """A ``torch.save`` file's state, loaded with ``weights_only=True`` (no code runs)."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged or unsafe file: one line
        raise CommandError(f"{path}: cannot load with weights_only=True: {e}") from e


def check_pt_crcs(path: str) -> tuple[str, str]:
    """``tierpoint verify`` of a ``torch.save`` file: ``(status, detail)``: ``ok`` when every zip
    record matches its CRC-32; ``unverified`` when there are none (torch's ``compute_crc32`` off, or
    the legacy pickle format); ``FAIL`` for a mismatch, a damaged or truncated archive or another
    kind of file. Nothing is unpickled."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:1] == b"\x80":  # a pickle: torch.save's legacy format
        return (
            "unverified",
            "a legacy (pickle) torch.save file, without checksums: nothing to verify",
        )
    if magic != b"PK\x03\x04":
        return "FAIL", "not a torch.save file (neither a zip archive nor a pickle)"
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if records and all(r.CRC == 0 for r in records if r.file_size):
                return "unverified", "a torch.save file saved without CRC-32s: nothing to verify"
            bad = archive.testzip()
    # truncated, or its directory damaged (a record's compression method or flags: torch writes
    # records stored and unencrypted, so another is damage too)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
        return "FAIL", f"a damaged torch.save file: {e}"
    if bad is not None:
        return "FAIL", f"a damaged torch.save file: record {bad} fails its CRC-32"
    return "ok", f"a torch.save file: every one of its {len(records)} records matches its CRC-32"
