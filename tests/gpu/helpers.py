"""States and checks shared by the CUDA tests (``tests/gpu``), which are skipped without CUDA.

``TIERPOINT_TEST_DEVICE=cpu`` runs them on the CPU instead (to check the tests themselves on a
machine without a GPU); by default they use ``cuda`` and are skipped when CUDA is not available.
Every test is self-contained: ``pytest tests/gpu/test_x.py::test_y`` runs it alone, and
``benchmarks/gpu_device_run.sh`` runs each in its own process (one CUDA failure must not hide the rest).
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("TIERPOINT_TEST_DEVICE", "cuda")

needs_gpu = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"
)


def model_state(seed: int, layers: int = 4, width: int = 256, device: str = DEVICE) -> dict:
    """A transformer-like training state: fp32 weights and Adam moments and bf16 norms on the
    device, CPU step counters (a mixed CPU/device state, as optimizers keep it)."""
    g = torch.Generator().manual_seed(seed)
    model, exp_avg, exp_avg_sq, steps = {}, {}, {}, {}
    for k in range(layers):
        for name, shape, dtype in (
            (f"layer{k}.attn.w", (width, 3 * width), torch.float32),
            (f"layer{k}.mlp.w", (width, 4 * width), torch.float32),
            (f"layer{k}.norm.w", (width,), torch.bfloat16),
        ):
            w = torch.randn(shape, generator=g).to(dtype)
            model[name] = w.to(device)
            exp_avg[name] = torch.randn(shape, generator=g).to(device)
            exp_avg_sq[name] = torch.rand(shape, generator=g).to(device)
            steps[name] = torch.tensor(float(seed))  # CPU, as torch.optim keeps it
    return {
        "model": model,
        "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": steps},
        "iteration": seed,
    }


def odd_state(seed: int, device: str = DEVICE) -> dict:
    """Tensors as real states hold them besides plain weights: views (transposed, sliced, at an
    offset into their storage, expanded, channels-last), one tensor under two keys (tied
    weights), a 0-dim and an empty one, small and integer dtypes, a parameter that requires grad
    (a state of module parameters, not of ``state_dict()``), and a CPU tensor beside them."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(64, 48, generator=g).to(device)
    tied = torch.randn(32, 16, generator=g).to(device)
    image = torch.randn(2, 3, 4, 5, generator=g).to(device)
    return {
        "transposed": base.t(),
        "sliced": base[5:20, 3:40],
        "offset": base.view(-1)[7:1000],
        "expanded": torch.randn(1, 16, generator=g).to(device).expand(8, 16),
        "channels_last": image.to(memory_format=torch.channels_last),
        "tied": {"embed": tied, "head": tied},
        "scalar": torch.tensor(3.5, device=device),
        "empty": torch.empty(0, 5, device=device),
        "bool": (torch.randn(33, generator=g) > 0).to(device),
        "int8": torch.randint(-100, 100, (17,), generator=g, dtype=torch.int8).to(device),
        "float16": torch.randn(9, 3, generator=g).half().to(device),
        "bfloat16": torch.randn(7, generator=g).bfloat16().to(device),
        "int64": torch.arange(13, device=device) * seed,
        "parameter": torch.nn.Parameter(torch.randn(6, 4, generator=g).to(device)),
        "on_cpu": torch.randn(5, generator=g),
    }


def clone(state: object) -> object:
    """A deep copy of a state, tensors cloned on their own devices."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    return state


def scribble(state: object) -> None:
    """Change every tensor in place (training going on right after a snapshot)."""
    if isinstance(state, torch.Tensor):
        if state.numel() > 1 and 0 in state.stride():
            return  # an expanded view: its elements share memory (in-place ops refuse it)
        with torch.no_grad():  # a parameter too
            state.add_(1) if state.is_floating_point() else state.fill_(7)
    elif isinstance(state, dict):
        for v in state.values():
            scribble(v)


def assert_same(got: object, want: object) -> None:
    """Bit for bit, same dtype, shape and device type."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert (got.dtype, got.shape, got.device.type) == (want.dtype, want.shape, want.device.type)
        assert torch.equal(_bytes(got), _bytes(want))
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want)
        for k in want:
            assert_same(got[k], want[k])
    else:
        assert got == want


def cuda_still_works() -> None:
    """CUDA is usable in this process (no error left pending, no poisoned context)."""
    if DEVICE != "cuda":
        return
    x = torch.randn(8, device="cuda")
    assert torch.isfinite((x * 2).sum()).item()
    torch.cuda.synchronize()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
