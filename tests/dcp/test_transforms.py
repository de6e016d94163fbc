"""Stream transforms: decoded within the size an item can have; unknown ones refused by name."""

from __future__ import annotations

import pytest

from tierpoint.dcp.safe_pickle import CorruptDCPError
from tierpoint.dcp.transforms import decode
from tierpoint.errors import UnsupportedStateError


def test_zstd_decodes_within_its_limit_and_a_bomb_is_refused():
    zstandard = pytest.importorskip("zstandard")
    packed = zstandard.ZstdCompressor().compress(bytes(4 << 20))
    assert decode(packed, ["stream.zstd/1"], 4 << 20, "f.distcp", "w") == bytes(4 << 20)
    with pytest.raises(CorruptDCPError, match="decodes to more than the 1048576 bytes"):
        decode(packed, ["stream.zstd/1"], 1 << 20, "f.distcp", "w")
    with pytest.raises(CorruptDCPError, match="does not decode"):
        decode(b"not zstd at all", ["stream.zstd/1"], 1 << 20, "f.distcp", "w")


def test_an_unknown_transform_is_named():
    with pytest.raises(UnsupportedStateError, match="'stream.lz4/1'.*Unknown extension"):
        decode(b"", ["stream.lz4/1"], 10, "f.distcp", "w")
