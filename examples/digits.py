"""A classifier on scikit-learn's digits (ships with the package, no download), trained with strategy="avgpipe".

    python examples/digits.py                 # 2 CPU processes, 1F1B, 4 micro-batches, torchmetrics accuracy

The module trains unchanged on one device (``--strategy auto --devices 1``) or under ``ddp``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_avgpipe  # registers strategy="avgpipe"


class DigitsMLP(L.LightningModule):
    """A 64 -> hidden -> 10 multilayer perceptron; every Linear/activation pair is a pipeline layer."""

    def __init__(self, hidden: int = 256, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        widths = [64] + [hidden] * depth
        blocks: list[nn.Module] = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
        self.layers = nn.Sequential(*blocks, nn.Linear(hidden, 10))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)
        self.example_input_array = torch.zeros(16, 64)

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 8x8 digits (1,797 images), scaled to [0, 1], split 1,200 / 297 / 300."""

    def __init__(self, batch_size: int = 64) -> None:
        super().__init__()
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        self.batch_size = batch_size
        self.train = TensorDataset(x[:1200], y[:1200])
        self.val = TensorDataset(x[1200:1497], y[1200:1497])
        self.test = TensorDataset(x[1497:], y[1497:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=self.batch_size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="avgpipe", help="'avgpipe', or 'auto'/'ddp' to compare")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lightning_avgpipe.share_cpu_threads(args.devices)  # before the model starts torch's thread pool
    L.seed_everything(args.seed, verbose=False)
    strategy: Any = args.strategy
    if args.strategy == "avgpipe":
        strategy = lightning_avgpipe.AvgPipeStrategy(num_microbatches=args.microbatches, schedule=args.schedule)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        log_every_n_steps=5,
        default_root_dir="runs/digits",
    )
    model, dm = DigitsMLP(), DigitsDataModule()
    trainer.fit(model, dm)
    result = trainer.test(model, dm)
    if trainer.is_global_zero:
        print(f"test accuracy {result[0]['test_acc']:.3f}")


if __name__ == "__main__":
    main()
