"""Corruption fuzzing of every file kind tierpoint writes, on one real 2-rank job (see
:mod:`.corruption_job`): local parts (own copies and replicas), DCP data, ``.metadata``, checksum
manifests and stale markers, damaged by bit flips, truncation, appended bytes and files swapped
between ranks or steps.

Asserts, for every trial: the damage is detected by tierpoint's own checks (or is harmless: every
value read bit-equal), never silent; the tiered restore returns the newest step bit for bit (an
intact copy always exists) and a restore from the persistent tier alone the newest step, or the
older one when the newest is damaged. Seeds are fixed (``TIERPOINT_FAULT_SEED`` shifts them, the
long runner draws many more); a failure names its seed, replayed with
``benchmarks/fault_runner.py --replay-corruption SEED``.
"""

from __future__ import annotations

import os

from .corruption_job import problems, run_corruption_trials

FIRST = int(os.environ.get("TIERPOINT_FAULT_SEED", 0))
TRIALS = 30

REGRESSIONS = [28]
"""Seeds that once found a bug, replayed on every run. 28: rank 0's own part of step 6 swapped
with its part of step 5 (both intact, each under the other's name); the scan ignored both, yet the
load read the file under the step-6 name and restored step 5's values as step 6 (fixed: the load
checks a part's metadata against its name and fetches the replica)."""


def test_damaged_files_are_detected_and_restore_falls_back(shm_dir) -> None:
    seeds = sorted({*REGRESSIONS, *range(FIRST, FIRST + TRIALS)})
    log = shm_dir / "trials.jsonl"
    results = run_corruption_trials(shm_dir / "ckpt", seeds, log, timeout=120)
    records = [r for rank in results for r in rank]
    assert len(records) == 2 * len(seeds)
    bad = problems(records)
    assert not bad, "\n".join(bad)
    outcomes = {r["outcome"] for r in records}
    assert "detected" in outcomes
    kinds = {r["mutation"]["file_kind"] for r in records}
    assert kinds == {"part", "distcp", "metadata", "manifest", "marker"}, kinds
