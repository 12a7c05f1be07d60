"""A small sequence model for the tensor-parallel modes' checkpoint tests (tests/test_checkpoint_modes.py): its
activations are ``[batch, sequence, hidden]`` so the 2D and 2.5D grids can cut them (sequence 8 and width 16 divide
by ``d q = 4`` and ``q = 2``; 4 heads divide over ``q² = 4`` ranks), every weight one the grid or Megatron's split
can cut: a Linear in, blocks of LayerNorms, attention (separate q, k, v, o, widths read from its attributes, so it
splits by heads) and a Linear MLP, and a Linear head, with cross-entropy over every token. Deterministic data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.checkpoints import assert_states_close
from tests.helpers.lit import quiet_trainer

INPUTS, WIDTH, HEADS, LENGTH, CLASSES, BLOCKS = 8, 16, 4, 8, 4, 2
MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's state beside its step count


class Attention(nn.Module):
    """Causal self-attention over ``num_heads`` heads, its widths read from its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, WIDTH // HEADS
        # no key bias: softmax ignores it, so its gradient is rounding noise that Adam would scale up to lr
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH, bias=p != "k") for p in "qkv")
        self.o_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        q, k, v = (
            p(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        return self.o_proj(y)


class SeqBlock(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def seq_layers(seed: int = 0) -> list[nn.Module]:
    """The Linear in, BLOCKS blocks and the Linear head (``2 + BLOCKS`` layers)."""
    torch.manual_seed(seed)
    return [nn.Linear(INPUTS, WIDTH), *(SeqBlock() for _ in range(BLOCKS)), nn.Linear(WIDTH, CLASSES)]


def seq_dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(n, LENGTH, INPUTS, generator=g), torch.randint(0, CLASSES, (n, LENGTH), generator=g)
    )


def seq_loader(batch_size: int = 12) -> DataLoader:
    return DataLoader(seq_dataset(), batch_size=batch_size, shuffle=False)


class SeqNet(L.LightningModule):
    """The layers as one ``nn.Sequential`` (``layers``), Adam, cross-entropy over every token."""

    def __init__(self, lr: float = 0.01, **_: Any) -> None:
        super().__init__()
        self.lr = lr
        self.layers = nn.Sequential(*seq_layers())

    def configure_pipeline(self) -> nn.Sequential:
        return self.layers

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def fit_seq(root: Path, steps: int, ckpt: str | None = None, strategy: Any = None) -> tuple[L.Trainer, SeqNet]:
    """SeqNet fitted for ``steps`` steps in one process (plain Lightning unless ``strategy``), from ``ckpt`` if given,
    checkpointed every 4 steps (an epoch) under ``root / "every"``; the batches in the loader's order."""
    torch.manual_seed(0)
    model = SeqNet()
    every = L.callbacks.ModelCheckpoint(dirpath=root / "every", every_n_train_steps=4, save_top_k=-1)
    extra = {"strategy": strategy} if strategy is not None else {}
    trainer = quiet_trainer(root, max_steps=steps, callbacks=[every], use_distributed_sampler=False, **extra)
    trainer.fit(model, seq_loader(), ckpt_path=ckpt)
    return trainer, model


def assert_like_plain(path: Path, trainer: L.Trainer, model: SeqNet) -> None:
    """The single-file checkpoint at ``path`` holds ``model``'s whole (unsplit) weights and ``trainer``'s Adam state,
    under the parameters' names."""
    saved = torch.load(path, weights_only=True)
    assert_states_close(saved["state_dict"], model.state_dict())
    state = saved["optimizer_states"][0]
    assert state["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    want = trainer.optimizers[0].state_dict()["state"]
    assert state["state"].keys() == want.keys()
    for i, entry in want.items():
        assert int(state["state"][i]["step"]) == int(entry["step"])
        assert_states_close({k: state["state"][i][k] for k in MOMENTS}, {k: entry[k] for k in MOMENTS})
