"""Fixtures of the DCP tests."""

from __future__ import annotations

import pytest

from tierpoint.dcp import writer


@pytest.fixture
def fixed_token(monkeypatch) -> str:
    """Saves in this test name their data files with the token ``t0`` (see ``file_names``)."""
    monkeypatch.setattr(writer, "_new_file_token", lambda: "t0")
    return "t0"
