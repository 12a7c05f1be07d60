"""LightningCLI with lightning_avgpipe imported first, so ``--trainer.strategy avgpipe`` resolves."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_avgpipe  # noqa: F401 - registers strategy="avgpipe"


def cli_main(args: list[str] | None = None, **kwargs: Any) -> LightningCLI:
    """Run LightningCLI over any LightningModule / LightningDataModule given by class path in a config or flags."""
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return LightningCLI(args=args, **kwargs)
