"""A GPT-style job on 2 nodes x 2 ranks (torchrun on 127.0.0.1) that checkpoints only through
TieredCheckpointManager is killed with SIGKILL at random steps, each time with a save in flight:
one rank; a whole node whose local directory is then wiped (restored from peers); every node, with
every local directory wiped (restored from the persistent tier). It finishes with parameters bit
for bit equal to an uninterrupted run."""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

import torch

from tierpoint import fileformat
from tierpoint.demo import torchrun

STEPS = 30
NODES = argparse.Namespace(nodes=2, ranks_per_node=2)


def _run(work: Path, log: Path, *extra: str) -> int:
    args = [f"--root={work / 'ckpt'}", f"--steps={STEPS}", *extra]
    return torchrun(NODES, args, log, module="tests.tiered.gpt_job")


def test_killed_three_ways_the_job_ends_bit_equal_to_an_uninterrupted_run(shm_dir: Path, capsys):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    log = shm_dir / "torchrun.log"
    # Kill right after a scheduled save (every 3 steps), with at least one step between kills.
    first = rng.choice([6, 9])
    second = rng.choice([s for s in (12, 15, 18) if s > first])
    third = rng.choice([s for s in (21, 24, 27) if s > second])
    plan = [
        (first, str(rng.choice(range(4))), None, "local"),  # one rank
        (second, "2,3", "node1", "peers"),  # node 1, its directory wiped
        (third, "0,1,2,3", "all", "persistent"),  # everything local is gone
    ]
    outcome = [f"seed {seed}"]
    for step, ranks, wipe, _ in plan:  # each launch after the first resumes
        code = _run(shm_dir, log, f"--kill={step}", f"--kill-ranks={ranks}", "--result=x")
        assert code != 0, outcome
        if wipe == "node1":
            shutil.rmtree(shm_dir / "ckpt" / "node1")
        elif wipe == "all":
            for node in ("node0", "node1"):
                shutil.rmtree(shm_dir / "ckpt" / node)
        outcome.append(f"killed ranks {ranks} at step {step}")
    result = shm_dir / "resumed.part"
    assert _run(shm_dir, log, f"--result={result}") == 0, log.read_text()[-3000:]
    reference = shm_dir / "reference.part"
    assert _run(shm_dir, log, "--no-checkpoint", f"--result={reference}") == 0
    resumes = [line.split() for line in capsys.readouterr().out.splitlines() if "resumed" in line]
    assert [words[-1] for words in resumes] == ["None", "local", "peers", "persistent"], resumes
    steps = [int(words[3]) for words in resumes[1:]]
    outcome.append(f"resumed at steps {steps}")
    for (killed, *_), resumed_at in zip(plan[:2], steps):
        assert killed - 3 <= resumed_at <= killed, outcome  # the save in flight, or the one before
    assert steps[2] % 6 == 0 and plan[2][0] - 9 <= steps[2] <= plan[2][0], outcome
    resumed, expected = fileformat.read(result), fileformat.read(reference)
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected), outcome
