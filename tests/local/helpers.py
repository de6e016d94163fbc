"""States and comparisons shared by the local-tier tests."""

from __future__ import annotations

import logging
from pathlib import Path

import torch


class WarningRecords(logging.Handler):
    """Collects the messages of tierpoint's warnings in this process from now on."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("tierpoint").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def make_state(rank: int, iteration: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + iteration)
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "optimizer": {"step": iteration, "exp_avg": [torch.randn(64, 33, generator=g)], "lr": 0.1},
        "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g),
        "meta": ("rank", rank),
    }


def assert_bitwise_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dtype != torch.bool else a,
            b.view(torch.uint8) if b.dtype != torch.bool else b,
        )
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b and type(a) is type(b)


def flip_tensor_byte(path: str | Path) -> bytes:
    """Flip a byte near the end of a part file (a tensor byte: the header stays valid, the checksum
    does not); returns the damaged contents."""
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    return bytes(data)
