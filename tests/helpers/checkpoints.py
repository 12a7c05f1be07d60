"""Checkpoints that move between layouts: plain Lightning runs of PipeNet (Adam) checkpointed every epoch, the
comparison of their weights, the tensor-parallel plan and mesh the layout tests share, and the replicas a
checkpoint's optimizer entry holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from tests.helpers.lit import PipeNet, loader, quiet_trainer

STEPS = 4  # one epoch of 48 samples in batches of 12
# every run reads the batches in the loader's order (a distributed strategy would otherwise shuffle them), and is
# checkpointed by ModelCheckpoint during training (a save_checkpoint after fit stopped at max_steps does not resume
# exactly, with or without this strategy)
PLAIN_ORDER = {"use_distributed_sampler": False}

TP_PLAN = {"layers.3": "colwise", "layers.5": "rowwise"}  # PipeNet's Linear(16, 16) then Linear(16, 4), on stage 1
TP = {"num_stages": 2, "num_microbatches": 2, "partition": [3, 3], "tensor_parallel_size": 2}


def fit_with_checkpoints(
    root: Path, steps: int, ckpt: str | None = None, strategy: Any = None, named: bool = False
) -> tuple[pl.Trainer, PipeNet]:
    """PipeNet with Adam (lr 0.01) fitted for ``steps`` steps in one process, from ``ckpt`` if given, checkpointed
    every STEPS steps under ``root / "every"``; ``named``: its optimizer built over named parameters."""
    torch.manual_seed(0)
    model = PipeNet(optimizer="adam", lr=0.01)
    if named:  # an optimizer over named parameters: its state dict names them
        model.configure_optimizers = lambda: torch.optim.Adam(model.named_parameters(), lr=0.01)  # type: ignore[method-assign]
    every = pl.callbacks.ModelCheckpoint(dirpath=root / "every", every_n_train_steps=STEPS, save_top_k=-1)
    trainer = quiet_trainer(
        root, max_steps=steps, callbacks=[every], **PLAIN_ORDER, **({"strategy": strategy} if strategy else {})
    )
    trainer.fit(model, loader(), ckpt_path=ckpt)
    return trainer, model


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def replicas_from_checkpoint(path: Path) -> dict[tuple[int, int], list[dict[str, torch.Tensor]]]:
    """(global rank) -> per replica, the stage's layer states, from the checkpoint's optimizer entry."""
    state = torch.load(path, weights_only=False)["optimizer_states"][0]
    return {rank: entry["replicas"] for rank, entry in enumerate(state["avgpipe_ranks"])}


def fit_pipenet(
    root: Path, steps: int, ckpt: Any = None, sdc: bool = True, **checkpointing: Any
) -> tuple[pl.Trainer, PipeNet]:
    """PipeNet with Adam (lr 0.01) under AvgPipeStrategy (one process, M = 2) for ``steps`` steps, from ``ckpt`` if
    given, checkpointed by ``ModelCheckpoint(**checkpointing)`` (every 4 steps by default) under ``root / "every"``;
    ``sdc``: ``save_distributed_checkpoint``."""
    from lightning_avgpipe import AvgPipeStrategy

    torch.manual_seed(0)
    model = PipeNet(optimizer="adam", lr=0.01)
    every = pl.callbacks.ModelCheckpoint(dirpath=root / "every", **(checkpointing or {"every_n_train_steps": 4}))
    strategy = AvgPipeStrategy(num_microbatches=2, save_distributed_checkpoint=sdc)
    trainer = quiet_trainer(root, max_steps=steps, callbacks=[every], strategy=strategy, **PLAIN_ORDER)
    trainer.fit(model, loader(), ckpt_path=ckpt)
    return trainer, model
