"""Data file names in tests: every save names its files ``__<rank>_<k>.<token>.distcp`` with a new
token (see :mod:`tierpoint.dcp.file_plan`). Tests that compare listings take the token out; tests
that must know a name before the save (a ``/dev/full`` link in its place) fix the token first, in
the process that saves."""

from __future__ import annotations

import re
from collections.abc import Iterable

from tierpoint.dcp import writer

_TOKEN = re.compile(r"^(__\d+_\d+|\.checksums-\d+)\.[0-9a-z]+(\.distcp|\.json)$")


def untokened(names: Iterable[str]) -> list[str]:
    """Sorted names, each data file's and checksum manifest's token taken out
    (``__0_1.<token>.distcp`` -> ``__0_1.distcp``, ``.checksums-0.<token>.json`` ->
    ``.checksums-0.json``)."""
    return sorted(_TOKEN.sub(r"\1\2", n) for n in names)


def fix_file_token(token: str = "t0") -> str:
    """This process's saves name their data files with ``token`` from now on (in a rank process of
    the test; in the pytest process use the ``fixed_token`` fixture); returns it."""
    writer._new_file_token = lambda: token
    return token


def data_file(rank: int, k: int = 0, token: str = "t0") -> str:
    return f"__{rank}_{k}.{token}.distcp"
