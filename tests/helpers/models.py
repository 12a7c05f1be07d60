"""Small deterministic models for equivalence tests, including stage boundaries that carry tuples and ints."""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn


class Fork(nn.Module):
    """Returns a tuple with a float tensor, a derived float tensor and an integer tensor (no gradient)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return x, x * 2.0, (x > 0).sum(-1)


class Join(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, xs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        a, b, count = xs
        return a + torch.tanh(b) * self.scale + count.unsqueeze(-1).float() * 0.01


def make_layers(seed: int = 0, width: int = 16, inputs: int = 8, classes: int = 4) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.Linear(inputs, width),
        Fork(),
        Join(width),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, classes),
    ]


def make_batch(step: int, batch: int = 12, inputs: int = 8, classes: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, inputs, generator=g), torch.randint(0, classes, (batch,), generator=g)


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fwd: float, bwd: float) -> Tensor:  # type: ignore[override]
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        time.sleep(ctx.bwd)
        return grad, None, None


class Sleep(nn.Module):
    """Identity with known costs: forward sleeps ``fixed_f + row_f * rows`` seconds, backward ``fixed_b + row_b *
    rows`` (so small micro-batches stop getting cheaper at the fixed part)."""

    def __init__(self, fixed_f: float, row_f: float, fixed_b: float, row_b: float) -> None:
        super().__init__()
        self.costs = (fixed_f, row_f, fixed_b, row_b)

    def forward(self, x: Tensor) -> Tensor:
        fixed_f, row_f, fixed_b, row_b = self.costs
        rows = x.shape[0]
        return _SleepFn.apply(x, fixed_f + row_f * rows, fixed_b + row_b * rows)
