"""One rank of the demo's training job: a small GPT-style model trained data-parallel over gloo,
checkpointed only through :class:`~tierpoint.TieredCheckpointManager`.

Run by torchrun (one per simulated node; see :mod:`tierpoint.demo`)::

    python -m tierpoint.demo.job --root DIR --steps N [--kill STEP --kill-ranks 2,3] --report F

Everything that decides the next step is in the checkpoint: parameters, AdamW moments, the LR
schedule, each rank's data-loader position and generator, and each rank's global RNG (dropout), so
a resumed run continues bit for bit. ``--kill STEP`` makes the ranks of ``--kill-ranks`` SIGKILL
themselves right after ``maybe_save(STEP)`` returned (a save may then be in flight). Rank 0 writes a
JSON report (where it resumed from, the manager's records) and the final parameters (``--result``,
a tierpoint part file).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import fileformat
from ..tiered import RankLocal, TieredCheckpointManager


class Gpt(torch.nn.Module):
    """Token and position embeddings, causal transformer blocks, a language-model head."""

    def __init__(self, vocab: int, width: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        block = torch.nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.1, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        hidden = self.blocks(self.embed(tokens) + self.position, mask=mask, is_causal=True)
        return self.head(hidden)


class Loader:
    """Deterministic synthetic token batches; its position and generator are checkpointed."""

    def __init__(self, rank: int, vocab: int, context: int, batch: int = 4) -> None:
        self.generator = torch.Generator().manual_seed(7 + rank)
        self.shape = (batch, context + 1)
        self.vocab = vocab
        self.position = 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return torch.randint(0, self.vocab, self.shape, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = sd["position"]
        self.generator.set_state(sd["generator"])


class GlobalRng:
    """This process's global RNG (dropout draws from it)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        torch.set_rng_state(sd["cpu"])


def build_state(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Gpt(args.vocab, args.width, args.layers, args.context)
    torch.manual_seed(1000 + rank)  # each rank's own dropout stream
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))
    return {
        "model": model,
        "optimizer": optimizer,
        "schedule": schedule,
        "loader": RankLocal(Loader(rank, args.vocab, args.context)),
        "rng": RankLocal(GlobalRng()),
    }


def train_step(state: dict[str, Any], world: int) -> float:
    model, optimizer = state["model"], state["optimizer"]
    batch = state["loader"].value.next()
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    optimizer.step()
    state["schedule"].step()
    return loss.item()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tierpoint.demo.job")
    p.add_argument("--root", required=True, help="each node's local tier is ROOT/node<N>")
    p.add_argument("--persistent", help="persistent tier (default ROOT/persistent)")
    p.add_argument("--endpoint-url", help="S3 endpoint for an s3:// --persistent")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--local-every", type=int, default=3)
    p.add_argument("--persistent-every", type=int, default=6)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--kill", type=int, default=-1)
    p.add_argument("--kill-ranks", default="")
    p.add_argument("--report", help="rank 0 writes a JSON report here")
    p.add_argument("--result", help="rank 0 writes the final parameters here")
    p.add_argument("--no-checkpoint", action="store_true")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    state = build_state(rank, args)
    report: dict[str, Any] = {"start": 0, "restore": None}
    manager = None
    if not args.no_checkpoint:
        root = Path(args.root)
        node = int(os.environ.get("GROUP_RANK", "0"))
        options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
        manager = TieredCheckpointManager(
            str(root / f"node{node}"),
            args.persistent or str(root / "persistent"),
            "demo",
            local_every=args.local_every,
            persistent_every=args.persistent_every,
            keep_persistent=2,
            storage_options=options,
        )
        report["start"] = manager.restore(state) or 0
        report["restore"] = manager.last_restore.as_dict() if manager.last_restore else None
        if rank == 0 and args.report:  # now: this launch may be killed before its end
            Path(args.report).write_text(json.dumps(report))
        restored = manager.last_restore
        if rank == 0 and restored is not None:
            for reason in restored.skipped:
                print(f"  skipped: {reason}", flush=True)
            if restored.step is not None:
                print(
                    f"  resumed at step {restored.step} from the {restored.tier} tier in "
                    f"{restored.seconds:.2f} s (agreed by all {world} ranks)",
                    flush=True,
                )
    started = time.perf_counter()
    for step in range(report["start"] + 1, args.steps + 1):
        loss = train_step(state, world)
        if manager is not None:
            saved = manager.maybe_save(step, state)
            if rank == 0 and saved:
                print(
                    f"  step {step:3d}  loss {loss:.4f}  saved to {' + '.join(saved)}", flush=True
                )
        if step == args.kill and str(rank) in args.kill_ranks.split(","):
            print(f"  [rank {rank}] step {step}: SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    report["train_seconds"] = time.perf_counter() - started
    if manager is not None:
        manager.close()
        report["stats"] = manager.stats()
    if rank == 0:
        if args.result:
            fileformat.write(args.result, dict(state["model"].state_dict()))
        if args.report:
            Path(args.report).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
