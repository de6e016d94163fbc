"""Stream transforms on DCP items (torch's ``_extensions``, e.g. ``ZStandard``): decoded on read.

torch's ``FileSystemWriter(path, _extensions=[ZStandard()])`` passes each item's bytes through the
extensions and records their descriptors (``"stream.zstd/1"``) in the item's ``_StorageInfo.
transform_descriptors``. :class:`~tierpoint.dcp.reader.Reader` calls :func:`decode` on such an
item's stored bytes (before anything is written into the caller's state) and then reads the result
like an untransformed item. tierpoint's own writer applies no transforms.

Call order: ``decode(raw, descriptors, limit, where, fqn)`` once per transformed item.

Invariants:
- A transform is looked up in torch's ``ExtensionRegistry`` (or the one given); one it does not
  know, or one whose module is not installed (zstd needs ``zstandard`` or ``pyzstd``), is refused
  with an :class:`~tierpoint.errors.UnsupportedStateError` naming it: the file is not called
  corrupt.
- At most ``limit`` bytes are produced: a stream that decodes to more (a compression bomb) is a
  :class:`~tierpoint.dcp.safe_pickle.CorruptDCPError`, and so is a stream that fails to decode.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from ..errors import UnsupportedStateError
from .safe_pickle import CorruptDCPError

_PIECE = 1 << 20


def decode(
    raw: bytes,
    descriptors: Sequence[str],
    limit: int,
    where: str,
    fqn: str,
    registry: ExtensionRegistry | None = None,
) -> bytes:
    """The bytes of an item stored as ``raw`` through the transforms ``descriptors`` (in the order
    torch records them: the first is undone first)."""
    stream: io.RawIOBase | io.BufferedIOBase = io.BytesIO(raw)
    for descriptor in descriptors:
        extension = _extension(descriptor, where, fqn, registry)
        stream = extension.transform_from(stream)  # type: ignore[arg-type,assignment]
    out = bytearray()
    try:
        while True:
            piece = stream.read(min(_PIECE, limit + 1 - len(out)))
            if not piece:
                break
            out += piece
            if len(out) > limit:
                raise CorruptDCPError(
                    where,
                    f"item {fqn!r}: its {', '.join(descriptors)} stream decodes to more than "
                    f"the {limit} bytes the item can hold",
                )
    except CorruptDCPError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure means a damaged stream
        raise CorruptDCPError(
            where, f"item {fqn!r}: its {', '.join(descriptors)} stream does not decode: {e!r:.200}"
        ) from None
    return bytes(out)


def _extension(
    descriptor: object, where: str, fqn: str, registry: ExtensionRegistry | None
) -> StreamTransformExtension:
    if not isinstance(descriptor, str):
        raise CorruptDCPError(where, f"item {fqn!r}: transform descriptor {descriptor!r:.60}")
    try:
        (extension,) = (registry or ExtensionRegistry()).from_descriptor_list([descriptor])
    except Exception as e:  # noqa: BLE001 - torch says ValueError; a registry may say more
        hint = ""
        if descriptor.startswith("stream.zstd"):
            hint = " (pip install zstandard, or tierpoint[zstd])"
        raise UnsupportedStateError(
            fqn,
            f"stored in {where} with the stream transform {descriptor!r}, which cannot be read "
            f"here: {e}{hint}",
        ) from None
    if not isinstance(extension, StreamTransformExtension):
        raise UnsupportedStateError(
            fqn, f"stored in {where} with {descriptor!r}, which is not a stream transform"
        )
    return extension
