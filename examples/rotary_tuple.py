"""Blocks that take extra inputs: a rotary cache (cos, sin) and an attention mask carried from stage to stage in a
tuple, as most LLM blocks need, pipelined over 2 CPU processes.

    python examples/rotary_tuple.py                   # 60 steps on the standard library's docstrings, loss printed
    python examples/rotary_tuple.py --check           # 3 steps, then compare with one process (exits 1 if apart)

The pattern: the first layer turns token ids into ``(x, cos, sin, mask)``; every block takes that tuple and returns
it with a new ``x``; the head takes the tuple and returns the logits. Where the pipeline cuts, the tuple crosses as it
is: ``x`` requires grad and gets its gradient back, ``cos``, ``sin`` and the boolean ``mask`` ride along (they are
made once, by the first stage). No other change to a block's code.
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
from torch.utils.data import DataLoader, TensorDataset

import lightning_avgpipe  # registers strategy="avgpipe"

Carry = tuple[Tensor, Tensor, Tensor, Tensor]  # (x, cos, sin, mask)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of ``x`` (..., T, head_dim)."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        half = dim // heads // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(block, dtype=torch.float32), freq)
        self.register_buffer("cos", torch.cat((angles.cos(), angles.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((angles.sin(), angles.sin()), dim=-1), persistent=False)

    def forward(self, ids: Tensor) -> Carry:
        T = ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()  # causal: True where attention may look
        return self.tokens(ids), self.cos[:T], self.sin[:T], mask


class Block(nn.Module):
    """Pre-norm attention with rotary q and k under the carried mask, then an MLP: ``Carry -> Carry``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, carry: Carry) -> Carry:
        x, cos, sin, mask = carry
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.norm1(x)).split(C, -1)
        )
        attn = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=mask)
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x)), cos, sin, mask


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, carry: Carry) -> Tensor:
        return self.out(self.norm(carry[0]))


class RotaryLM(L.LightningModule):
    def __init__(self, vocab: int, dim: int = 64, heads: int = 4, depth: int = 4, block: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(
            Embed(vocab, dim, heads, block), *(Block(dim, heads) for _ in range(depth)), Head(dim, vocab)
        )

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, ids: Tensor) -> Tensor:
        return self.layers(ids)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, targets = batch
        loss = F.cross_entropy(self(ids).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def text_batches(block: int, count: int) -> tuple[TensorDataset, int]:
    """``count`` windows of ``block`` characters of the standard library's docstrings (inputs, next characters)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from text_data import encode, stdlib_docstrings

    data, chars = encode(stdlib_docstrings(200_000))
    starts = torch.randint(0, len(data) - block - 1, (count,), generator=torch.Generator().manual_seed(0))
    ids = torch.stack([data[s : s + block] for s in starts.tolist()])
    targets = torch.stack([data[s + 1 : s + block + 1] for s in starts.tolist()])
    return TensorDataset(ids, targets), len(chars)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--check", action="store_true", help="train 3 steps and compare with one process")
    args = p.parse_args(argv)
    steps = 3 if args.check else args.steps
    lightning_avgpipe.share_cpu_threads(2)
    L.seed_everything(0, verbose=False)
    data, vocab = text_batches(32, 16 * steps)
    model = RotaryLM(vocab)
    initial = copy.deepcopy(model.layers)
    strategy = lightning_avgpipe.AvgPipeStrategy(num_microbatches=args.microbatches)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir="runs/rotary_tuple",
    )
    loader = DataLoader(data, batch_size=16)  # one pipeline group reads it in order, as one device does
    trainer.fit(model, loader)
    state = strategy.lightning_module_state_dict()  # collective: the unsplit model's state dict on rank 0
    if not trainer.is_global_zero:
        return 0
    uniform = torch.log(torch.tensor(float(vocab))).item()
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.3f} (uniform guess: {uniform:.3f})")
    if not args.check:
        return 0
    ref = nn.Sequential(*initial)  # one process, accumulation over the same micro-batches
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    for ids, targets in loader:
        opt.zero_grad()
        for mi, mt in zip(ids.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
            loss = F.cross_entropy(ref(mi).flatten(0, 1), mt.flatten()) * (len(mi) / len(ids))
            loss.backward()
        opt.step()
    worst = max((state[f"layers.{k}"] - v).abs().max().item() for k, v in ref.state_dict().items())
    print(f"max |pipelined - one process with accumulation| = {worst:.2e} over every weight")
    print("check: OK" if worst < 1e-5 else "check: FAILED")
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
