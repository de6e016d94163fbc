"""Sets of ranks written as runs: ``[1, 2, 3, 7]`` is ``[[1, 3], [7, 7]]``.

What a node reports for its ranks (their parts, their files) is usually alike from rank to rank, so
a record that names ranks by runs stays about as small as one rank's report: what restores gather
then grows with the number of nodes, not of ranks (see :func:`tierpoint.dist.gather_by_node`).
Pure functions; :func:`expand` inverts :func:`ranges`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def ranges(values: Iterable[int]) -> list[list[int]]:
    """``[1, 2, 3, 7]`` -> ``[[1, 3], [7, 7]]`` (sorted, duplicates dropped, ``[first, last]``
    inclusive)."""
    out: list[list[int]] = []
    for v in sorted(set(values)):
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return out


def text(values: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 4, 5, 7]`` -> ``"0-5,7"``."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges(values))


def expand(spans: Iterable[list[int]]) -> Iterator[int]:
    """The inverse of :func:`ranges`."""
    for first, last in spans:
        yield from range(first, last + 1)
