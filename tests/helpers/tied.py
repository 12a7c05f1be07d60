"""A tiny GPT-shaped language model whose output head shares the token embedding's weight, and its reference.

Layers: the token embedding, two residual MLP blocks, the head (``head.weight is embed.weight``), so any partition
over 2 or 4 stages puts the embedding on the first stage and the head on the last.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.lit import train_elastic

VOCAB, WIDTH, LENGTH = 13, 16, 6


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * 0.5)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight)  # (B, T, C)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Head(nn.Module):
    """The output projection; its weight is the embedding's (set by ``tie``)."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.weight = embed.weight

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()  # (B, T, VOCAB)


def tied_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    embed = Embed()
    return [embed, Block(), Block(), Head(embed)]


def token_dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (n, LENGTH + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def token_loader(batch_size: int = 12) -> DataLoader:
    return DataLoader(token_dataset(), batch_size=batch_size, shuffle=False)


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class TiedLM(L.LightningModule):
    def __init__(self, lr: float = 0.1, optimizer: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(*tied_layers())

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return _optimizer(self.parameters(), self.hparams.lr, self.hparams.optimizer)


class LateTiedLM(TiedLM):
    """TiedLM whose layers are built in ``configure_model`` (under AvgPipe: on the meta device), same values."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.layers

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.layers = nn.Sequential(*tied_layers())


def _optimizer(params: Any, lr: float, name: str) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.Adam(params, lr=lr) if name == "adam" else torch.optim.SGD(params, lr=lr, momentum=0.9)


def reference_tied(
    steps: int, m: int, pipelines: int = 1, lr: float = 0.1, optimizer: str = "adam", batch_size: int = 12
) -> tuple[list[float], dict[str, Tensor]]:
    """Single-process training of the tied model, as Lightning feeds it: the loader's order (D = 1), replica n
    of N taking batch t*N + n, each replica's loss the mean over its micro-batches, then (N > 1) the elastic rule.
    Returns the per-iteration loss (mean over replicas) and the reference's state dict under the module's names."""
    layers = tied_layers()
    losses, _ = train_elastic(
        layers, lambda ps: _optimizer(ps, lr, optimizer), token_dataset(), lm_loss, steps, m, pipelines, batch_size
    )
    state = nn.Sequential(*layers).state_dict(keep_vars=False)
    return losses, {f"layers.{k}": v for k, v in state.items()}
