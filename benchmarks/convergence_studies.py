"""The convergence benchmark's methods, its three studies and their data (``benchmarks/convergence.py``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.gpt_args import model_sizes


@dataclass(frozen=True)
class Method:
    """One way to train on the stream: plain at B, plain at N·B (``averaging="exact"``), or elastic averaging."""

    name: str
    kind: str  # "plain-B", "exact" or "elastic"
    about: str
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    period: int = 1

    def strategy_options(self) -> dict[str, Any]:
        """The ``AvgPipeStrategy`` arguments that train this way (besides ``num_pipelines``)."""
        if self.kind == "exact":
            return {"averaging": "exact"}
        if self.kind == "elastic":
            return {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "averaging_period": self.period}
        return {}


SPECS = {
    m.name: m
    for m in (
        Method("pipe-B", "plain-B", "plain training at the user's batch B (N = 1)"),
        Method("pipe-NB", "exact", "averaging='exact': the N batches of a step as one batch of N·B"),
        Method("avgpipe-N", "elastic", "the paper's rule: elastic averaging, the reference moves by the mean update"),
        Method(
            "outer-N",
            "elastic",
            "elastic averaging with DiLoCo's outer Nesterov optimizer (outer_lr 0.7, outer_momentum 0.9)",
            outer_lr=0.7,
            outer_momentum=0.9,
        ),
        Method(
            "period-N", "elastic", "elastic averaging with averaging_period H = 4 (the paper's outer step)", period=4
        ),
    )
}


METHODS = tuple(SPECS)


TUNER_ROWS = ("pipe-B", "pipe-NB", "avgpipe-N")  # the settings AvgPipeTuner predicts and chooses among


ELASTIC = tuple(m for m in METHODS if SPECS[m].kind == "elastic")


COLORS = {
    "pipe-B": "tab:blue",
    "pipe-NB": "tab:orange",
    "avgpipe-N": "tab:green",
    "outer-N": "tab:red",
    "period-N": "tab:purple",
}


@dataclass
class Study:
    """One data set, one model, one optimizer, one budget: everything the three methods share."""

    name: str
    metric: str  # "val_acc" (higher is better) or "val_loss" (lower is better)
    target: float
    batch: int  # B, per pipeline / replica
    budget_samples: int  # equal for every method
    eval_every: int  # samples between evaluations (a multiple of N·B, so every method evaluates at the same points)
    lr_center: float
    lr_ratio: float
    grid_points: int
    final_window: int = 0  # "final" metric = mean of the evaluations in the last final_window samples (0: the last)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "val_acc"

    def reached(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target


def make_studies(args: argparse.Namespace) -> dict[str, Study]:
    n = args.pipelines
    quick = args.quick
    studies = {}
    # digits: 1,200 training images; budget in epochs of them
    b = args.digits_batch
    per_iter = n * b
    epochs = 2 if quick else args.digits_epochs
    budget = _round_up(epochs * 1200, 2 * per_iter)
    studies["digits"] = Study(
        name="digits",
        metric="val_acc",
        target=args.digits_target,
        batch=b,
        budget_samples=budget,
        eval_every=2 * per_iter,
        lr_center=args.digits_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        final_window=0 if quick else 1200,  # accuracy on 297 images jumps by 1-2% between evaluations: one epoch
        description="scikit-learn digits (1,200 train / 297 val images), examples/digits.py DigitsMLP "
        "(64-256x4-10), Adam",
    )
    b = args.text_batch
    per_iter = n * b
    iters = 8 if quick else args.text_iters  # iterations of pipe-NB / avgpipe (N·B windows each)
    every = max(1, iters // (4 if quick else 16)) * per_iter
    studies["text"] = Study(
        name="text",
        metric="val_loss",
        target=args.text_target,
        batch=b,
        budget_samples=_round_up(iters * per_iter, every),
        eval_every=every,
        lr_center=args.text_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        description=f"stdlib docstrings, windows of {args.block_size} characters, examples/char_gpt.py GPT "
        f"(n_layer {args.n_layer}, n_embd {args.n_embd}, n_head {args.n_head}), AdamW(weight_decay=0.01); "
        f"validation loss on {args.text_val_windows} fixed validation windows",
        extra={**model_sizes(args), "corpus_chars": args.corpus_chars, "val_windows": args.text_val_windows},
    )
    b = args.digits_batch
    per_iter = n * b
    epochs = 2 if quick else args.digits_epochs
    studies["digits-cnn"] = Study(
        name="digits-cnn",
        metric="val_acc",
        target=args.digits_target,
        batch=b,
        budget_samples=_round_up(epochs * 1200, 2 * per_iter),
        eval_every=2 * per_iter,
        lr_center=args.cnn_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        final_window=0 if quick else 1200,
        description="scikit-learn digits as 1x8x8 images, a small CNN (conv 16, conv 32, max-pool, linear 64, "
        "linear 10), SGD with momentum 0.9",
    )
    return {name: studies[name] for name in args.datasets}


def digits_cnn() -> nn.Sequential:
    """A convolutional model of the digits: another model family than the MLP and the GPT, and another optimizer."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Data:
    """A study's tensors, its model factory, its loss and its evaluation."""

    def __init__(self, study: Study) -> None:
        self.study = study
        if study.name in ("digits", "digits-cnn"):
            from examples.digits import DigitsDataModule

            digits = DigitsDataModule()
            self.x, self.y = digits.train.tensors
            self.vx, self.vy = digits.val.tensors
        else:
            from examples.char_gpt import CharDataModule

            e = study.extra
            text = CharDataModule(block_size=e["block_size"], max_chars=e["corpus_chars"])
            self.vocab = text.vocab_size

            def windows(data: Tensor) -> tuple[Tensor, Tensor]:
                count = (len(data) - 1) // e["block_size"]
                chunks = data[: count * e["block_size"] + 1]
                x = chunks[:-1].view(count, e["block_size"])
                y = chunks[1:].view(count, e["block_size"])
                return x, y  # the windows of examples.text_data.CharDataset, stacked

            self.x, self.y = windows(text.train_data)
            vx, vy = windows(text.val_data)
            pick = torch.linspace(0, len(vx) - 1, min(e["val_windows"], len(vx))).long()  # spread over the text
            self.vx, self.vy = vx[pick], vy[pick]

    def model(self, seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        if self.study.name == "digits":
            from examples.digits import DigitsMLP

            return DigitsMLP().layers  # its pipeline layers: 4 x (Linear 256 + ReLU), Linear 10
        if self.study.name == "digits-cnn":
            return digits_cnn()
        from examples.char_gpt import GPTConfig, gpt_layers

        e = self.study.extra
        return gpt_layers(GPTConfig(vocab_size=self.vocab, **model_sizes(e), dropout=0.0))

    def optimizer(self, params: Any, lr: float) -> torch.optim.Optimizer:
        if self.study.name == "digits":
            return torch.optim.Adam(params, lr=lr)  # DigitsMLP.configure_optimizers
        if self.study.name == "digits-cnn":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)  # CharGPT.configure_optimizers

    @staticmethod
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(validation loss, validation accuracy) of ``model`` on the whole validation set."""
        with torch.no_grad():
            chunks = [(model(x), y) for x, y in zip(self.vx.split(256), self.vy.split(256))]
        total = sum(self.loss(lg, y).item() * y.numel() for lg, y in chunks) / self.vy.numel()
        correct = sum((lg.argmax(-1) == y).sum().item() for lg, y in chunks) / self.vy.numel()
        return total, correct


def sample_stream(size: int, count: int, seed: int) -> Tensor:
    """The first ``count`` indices of shuffled epochs over ``size`` samples: every method cuts the same stream."""
    g = torch.Generator().manual_seed(10_000 + seed)
    parts, have = [], 0
    while have < count:
        parts.append(torch.randperm(size, generator=g))
        have += size
    return torch.cat(parts)[:count]


_DATA: dict[str, Data] = {}


def data_for(study: Study) -> Data:
    """The study's data, loaded once per process (forked workers inherit the parent's)."""
    if study.name not in _DATA:
        _DATA[study.name] = Data(study)
    return _DATA[study.name]
