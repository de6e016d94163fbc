"""tierpoint's exceptions: one family, picklable with their attributes (torch DCP pickles rank errors);
agreed messages name each failing rank and each error class once."""

from __future__ import annotations

import pickle

import pytest

from tierpoint.errors import (
    CheckpointingError,
    CorruptCheckpointError,
    UnsupportedStateError,
    agreed_error,
    error_text,
    failed_on_ranks,
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


def test_agreed_messages_name_each_rank_and_class_once() -> None:
    inner = CheckpointingError("writing /ckpt/__1_0.distcp failed: No space left [ENOSPC]")
    reported = error_text(inner)
    assert (
        reported == "CheckpointingError: writing /ckpt/__1_0.distcp failed: No space left [ENOSPC]"
    )
    # Re-raised from its reported text (as a writer does), it is still named once.
    assert error_text(CheckpointingError(reported)) == reported
    assert error_text(OSError("disk gone")) == "OSError: disk gone"
    one = failed_on_ranks("saving step 3", {1: reported})
    assert one == f"saving step 3 failed on rank 1: {reported}"
    two = failed_on_ranks("saving step 3", {2: "OSError: b", 0: "OSError: a"})
    assert two == "saving step 3 failed on ranks 0, 2: rank 0: OSError: a; rank 2: OSError: b"
