"""tierpoint's exceptions: one family, picklable with their attributes (torch DCP pickles rank errors)."""

from __future__ import annotations

import pickle

import pytest

from tierpoint.errors import (
    CheckpointingError,
    CorruptCheckpointError,
    UnsupportedStateError,
    agreed_error,
)


@pytest.mark.parametrize(
    "error",
    [
        CheckpointingError("plain", {1: "rank 1 failed"}),
        CorruptCheckpointError("/x/part.safetensors", "checksum mismatch"),
        UnsupportedStateError("optimizer.fn", "a function"),
        agreed_error("CorruptCheckpointError", "agreed", {0: "bad"}),
    ],
)
def test_errors_survive_pickling(error: CheckpointingError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy.__dict__ == error.__dict__
    assert isinstance(copy, CheckpointingError)
