"""A CNN with BatchNorm on scikit-learn's digits, pipelined over 2 CPU processes, and what BatchNorm does there.

    python examples/cnn_batchnorm.py                  # train 5 epochs, 4 micro-batches, print the test accuracy
    python examples/cnn_batchnorm.py --check          # 3 steps, then compare with one process (exits 1 if apart)

A pipeline runs each batch as M micro-batches, so a BatchNorm layer normalises each micro-batch by its own statistics
and updates its running statistics once per micro-batch, M times a step. That is plain training with gradient
accumulation over the same micro-batches, not training on the whole batch at once: ``--check`` trains a few steps
with ``strategy="avgpipe"`` and then, on rank 0, the same model in one process with accumulation over the same
micro-batches, and compares every weight, running mean and variance, and ``num_batches_tracked`` (M per step).
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_avgpipe  # registers strategy="avgpipe"

if __package__ in (None, ""):  # run as a script: the sibling example is importable from this folder
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from digits import DigitsDataModule  # noqa: E402


def cnn_layers() -> list[nn.Module]:
    """Three pipeline layers: two convolution blocks with BatchNorm, then the classifier."""
    return [
        nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
        nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 10)),
    ]


class DigitsCNN(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(*cnn_layers())

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def accumulated(model: nn.Module, batches: list[tuple[Tensor, Tensor]], m: int, lr: float) -> nn.Module:
    """What the pipeline computes, in one process: per batch, M micro-batches forward in training mode (BatchNorm on
    each one's statistics, its running statistics updated M times), the losses weighted by size, one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for x, y in batches:
        opt.zero_grad()
        for mx, my in zip(x.tensor_split(m), y.tensor_split(m)):
            (F.cross_entropy(model(mx), my) * (len(my) / len(y))).backward()
        opt.step()
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--check", action="store_true", help="train --steps steps and compare with one process")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lightning_avgpipe.share_cpu_threads(2)
    L.seed_everything(args.seed, verbose=False)
    model, data = DigitsCNN(), DigitsDataModule(batch_size=64)
    initial = copy.deepcopy(model.layers)
    strategy = lightning_avgpipe.AvgPipeStrategy(num_microbatches=args.microbatches)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.steps if args.check else -1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not args.check,
        default_root_dir="runs/cnn_batchnorm",
    )
    # one pipeline group reads the loader as it is: in order for --check, shuffled (alike on both ranks) otherwise
    train = DataLoader(data.train, batch_size=64, shuffle=not args.check)
    trainer.fit(model, train)
    if not args.check:
        result = trainer.test(model, data.test_dataloader())
        if trainer.is_global_zero:
            print(f"test accuracy {result[0]['test_acc']:.3f}")
        return 0
    state = strategy.lightning_module_state_dict()  # collective: the unsplit model's state dict on rank 0
    if not trainer.is_global_zero:
        return 0
    batches = [(x, y) for (x, y), _ in zip(train, range(args.steps))]
    whole = accumulated(copy.deepcopy(initial), batches, 1, model.hparams.lr).state_dict()  # the batch at once
    reference = accumulated(initial, batches, args.microbatches, model.hparams.lr).state_dict()
    worst = max((state[f"layers.{k}"].float() - v.float()).abs().max().item() for k, v in reference.items())
    tracked = {k: int(v) for k, v in reference.items() if k.endswith("num_batches_tracked")}
    piped = {k: int(state[f"layers.{k}"]) for k in tracked}
    print(
        f"max |pipelined - one process with accumulation over the micro-batches| = {worst:.2e} over every weight "
        f"and BatchNorm statistic; num_batches_tracked {piped} (M x steps = {args.microbatches * args.steps})"
    )
    apart = max((state[f"layers.{k}"].float() - v.float()).abs().max().item() for k, v in whole.items())
    print(f"(against one process on each whole batch, BatchNorm over all 64 samples at once: {apart:.2e} apart)")
    ok = worst < 1e-5 and piped == tracked and set(piped.values()) == {args.microbatches * args.steps}
    print("check: OK" if ok else "check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
