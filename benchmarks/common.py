"""Helpers the benchmarks share: GPT training batches from the corpus, applying a stage's layers, the LM loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def make_batches(data: Tensor, block_size: int, batch_size: int, count: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """``count`` batches of random windows of the corpus: inputs ``(B, T)`` and next-character targets."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=g).tolist()
        x = torch.stack([data[s : s + block_size] for s in starts])
        y = torch.stack([data[s + 1 : s + block_size + 1] for s in starts])
        batches.append((x, y))
    return batches


def apply_layers(layers: list[nn.Module], x: Any) -> Any:
    """A stage's layers applied in order."""
    for layer in layers:
        x = layer(x)
    return x


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
