"""A GPT-style character language model on the standard library's docstrings, trained with strategy="avgpipe".

    python examples/char_gpt.py                       # 2 CPU processes, 1F1B, 4 micro-batches
    python examples/char_gpt.py --devices 4 --schedule afab --max-steps 100

The model is an ordinary LightningModule (it trains unchanged with strategy="ddp" or on one device); two small
additions make it pipeline-ready: ``configure_pipeline()`` returns its layers in order, and ``forward`` applies
them in order.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_avgpipe  # registers strategy="avgpipe"

try:
    from examples.gpt_args import add_model_args, check_model_args, model_sizes
    from examples.text_data import CharDataset, encode, stdlib_docstrings
except ImportError:  # run as a script from examples/
    from gpt_args import add_model_args, check_model_args, model_sizes  # type: ignore[no-redef]
    from text_data import CharDataset, encode, stdlib_docstrings  # type: ignore[no-redef]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64  # context length in characters
    n_layer: int = 4  # transformer blocks, each a pipeline layer
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) -> (B, T, C)
        t = idx.shape[1]
        return self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd  # widths read from here: tensor parallelism sets a shard's
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        hidden = 4 * cfg.n_embd
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, hidden), nn.GELU(), nn.Linear(hidden, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.p = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, C)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, T, V)
        return self.out(self.ln(x))


def gpt_layers(cfg: GPTConfig) -> nn.Sequential:
    return nn.Sequential(Embed(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), Head(cfg))


class CharGPT(L.LightningModule):
    """A character GPT whose layers are embedding, ``n_layer`` transformer blocks and the output head."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        self.layers = gpt_layers(self.cfg)
        if tie_weights:  # the output head reads logits off the token embedding (one (V, C) matrix, two layers)
            self.layers[-1].out.weight = self.layers[0].tok.weight
        self.example_input_array = torch.zeros(8, block_size, dtype=torch.long)  # profiles partition="balanced"

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, idx: Tensor) -> Tensor:
        return self.layers(idx)

    def _loss(self, batch: Any) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_bpc", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class CharDataModule(L.LightningDataModule):
    """The standard library's docstrings as characters, 90% train and 10% validation."""

    def __init__(self, block_size: int = 64, batch_size: int = 32, max_chars: int = 1_000_000) -> None:
        super().__init__()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_chars = max_chars
        data, self.chars = encode(stdlib_docstrings(max_chars))
        cut = int(0.9 * len(data))
        self.train_data, self.val_data = data[:cut], data[cut:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            CharDataset(self.train_data, self.block_size), batch_size=self.batch_size, shuffle=True, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(CharDataset(self.val_data, self.block_size), batch_size=self.batch_size)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--partition", default="balanced")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    add_model_args(p, **model_sizes(GPTConfig()))
    p.add_argument("--precision", default="32-true")
    p.add_argument("--pipelines", type=int, default=1, help="N parallel pipelines (AvgPipe's elastic averaging)")
    p.add_argument("--advance-forwards", default="auto", help="k for --schedule advance: an int or 'auto'")
    p.add_argument("--trace-dir", default=None, help="write step timelines (JSON for Perfetto + PNG) here")
    p.add_argument("--tune", action="store_true", help="choose micro-batches and pipelines with AvgPipeTuner first")
    p.add_argument("--memory-limit-mb", type=float, default=None, help="the tuner's per-stage memory limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tie-weights",
        action="store_true",
        help="share the token embedding's weight with the output head (on the first and last stages)",
    )
    args = p.parse_args(argv)
    check_model_args(p, args)
    if args.accelerator == "cpu":
        lightning_avgpipe.share_cpu_threads(args.devices)  # before the model starts torch's thread pool
    L.seed_everything(args.seed, verbose=False)
    dm = CharDataModule(block_size=args.block_size, batch_size=args.batch_size)
    model = CharGPT(vocab_size=dm.vocab_size, tie_weights=args.tie_weights, **model_sizes(args))
    k = args.advance_forwards if args.advance_forwards == "auto" else int(args.advance_forwards)
    strategy = lightning_avgpipe.AvgPipeStrategy(
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        partition=args.partition,
        num_pipelines=args.pipelines,
        advance_forwards=k,
        trace_dir=args.trace_dir,
        trace_steps=[5],
    )
    callbacks = []
    if args.tune:
        limit = args.memory_limit_mb * 2**20 if args.memory_limit_mb else None
        callbacks.append(lightning_avgpipe.AvgPipeTuner(memory_limit=limit, num_pipelines=4))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=20,
        check_val_every_n_epoch=None,  # every 100 steps across epochs: N pipelines shorten an epoch
        precision=args.precision,
        log_every_n_steps=10,
        default_root_dir="runs/char_gpt",
    )
    trainer.fit(model, dm)
    if trainer.is_global_zero:
        print(
            f"final val_loss {float(trainer.callback_metrics['val_loss']):.3f} "
            f"(uniform guess: {math.log(dm.vocab_size):.3f})"
        )


if __name__ == "__main__":
    main()
