"""Kills and stops aimed at phases of both tiers, on one chain of real 2-rank tiered jobs (see
:mod:`.kill_job`): each job restores what the previous one left and saves until the phase tracer
SIGKILLs one rank or the whole job, or SIGSTOPs a rank, at the n-th entry into a phase.

Asserts, for every job: no rank hangs (a peer of a killed or stopped rank raises within the
timeout; for a stop, within 3 x ``TIERPOINT_TIMEOUT`` + 10 s, with a 5 s timeout, naming the
stopped rank); disk use stays
bounded; the next job's restore returns on both ranks a step no older than any step committed
before, bit-equal to what one job saved there (never a mix, never a partial step). After the last
job, which runs without a fault, nothing waits for clean-up (dirty parts, markers, uncommitted
steps). The long runner (``benchmarks/fault_runner.py``) draws hundreds of such kills from a seed.
"""

from __future__ import annotations

import pytest

from .kill_job import kill_trial

CHAIN = [  # (kill, steps the job saves after its restore)
    ({"phase": "persistent.commit", "nth": 3, "rank": 0, "scope": "job"}, 4),
    ({"phase": "local.fsync", "nth": 9, "rank": 1, "scope": "rank"}, 3),
    ({"phase": "local.replicate", "nth": 2, "rank": 1, "scope": "stop"}, 3),  # a silent peer
    ({"phase": "restore", "nth": 3, "rank": 0, "scope": "job"}, 1),
    ({"phase": "restore", "nth": 2, "rank": 1, "scope": "stop"}, 1),  # silent mid-restore
    (None, 3),  # the last job checks the last kill's aftermath; its saves clean up
]


@pytest.mark.slow
def test_kills_and_stops_in_each_phase_lose_no_committed_step(shm_dir) -> None:
    problems = []
    killed_in = []
    for job, (kill, steps) in enumerate(CHAIN):
        trial = kill_trial(shm_dir / "ckpt", shm_dir / "logs", job, kill, steps=steps)
        problems += trial.problems
        killed_in.append(trial.killed_in)
        assert not trial.hung, trial.problems
        if trial.stop.get("raised_after_s") is not None:  # the peer raised: it names who is silent
            assert trial.stop["named"], trial.stop
    assert not problems, "\n".join(problems)
    assert killed_in == [k["phase"] if k else None for k, _ in CHAIN]  # every kill hit its phase
