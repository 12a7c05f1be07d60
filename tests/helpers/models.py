"""Small deterministic models for equivalence tests, including stage boundaries that carry tuples and ints."""

from __future__ import annotations

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
