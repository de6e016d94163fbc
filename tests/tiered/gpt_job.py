"""One rank of a small GPT-style training job that checkpoints only through
TieredCheckpointManager; run by torchrun (``python -m tests.tiered.gpt_job``), one torchrun per
simulated node. ``--kill STEP`` makes ``--kill-ranks`` SIGKILL themselves right after the save
scheduled at STEP (the save is in flight); rank 0 writes the final parameters to ``--result``."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from tierpoint import RankLocal, TieredCheckpointManager, fileformat

VOCAB, WIDTH, CONTEXT, BATCH = 64, 32, 16, 4


class Gpt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.1, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.blocks(self.embed(tokens) + self.position, mask=mask, is_causal=True))


class Loader:
    """Deterministic synthetic batches; its position and generator are checkpointed."""

    def __init__(self, rank: int) -> None:
        self.generator = torch.Generator().manual_seed(7 + rank)
        self.position = 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=self.generator)

    def state_dict(self) -> dict:
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.position = sd["position"]
        self.generator.set_state(sd["generator"])


class TorchRng:
    """The process's global RNG (dropout draws from it)."""

    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["cpu"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill", type=int, default=-1)
    parser.add_argument("--kill-ranks", default="")
    parser.add_argument("--result", required=True)
    parser.add_argument("--no-checkpoint", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Gpt()
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))
    state = {
        "model": model,
        "optimizer": optimizer,
        "schedule": schedule,
        "loader": RankLocal(Loader(rank)),
        "rng": RankLocal(TorchRng()),
    }
    manager = None
    start = 0
    if not args.no_checkpoint:
        root = Path(args.root)
        node = int(os.environ["GROUP_RANK"])
        manager = TieredCheckpointManager(
            str(root / f"node{node}"),
            str(root / "persistent"),
            "gpt",
            local_every=3,
            persistent_every=6,
            keep_persistent=2,
        )
        start = manager.restore(state) or 0
        if rank == 0:
            record = manager.last_restore
            print(f"resumed at step {start} from {record.tier}", flush=True)
    for step in range(start + 1, args.steps + 1):
        batch = state["loader"].value.next()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        schedule.step()
        if manager is not None:
            manager.maybe_save(step, state)
        if step == args.kill and str(rank) in args.kill_ranks.split(","):
            os.kill(os.getpid(), signal.SIGKILL)
    if manager is not None:
        manager.close()
    if rank == 0:
        fileformat.write(args.result, dict(model.state_dict()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
