"""What fills each stage at the first training step, once its optimizer has stepped (the state exists then): weights,
gradients, optimizer state, activations in flight, communication buffers and the rest of the process's peak, printed
by rank 0 one line per rank and logged as ``memory/<part>_mib`` (counted by ``runtime/memory.py``)."""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_avgpipe.runtime.controller import StepController


def report_after_first_step(precision: Any, module: pl.LightningModule, controller: StepController) -> None:
    """Wrap ``precision.optimizer_step`` (every optimizer step goes through it) until the first step has run: then
    report the breakdown (:func:`report_memory`) and take the wrapper off. The controller is held weakly: a fit
    that ends before its first step (a resume at ``max_steps``) leaves the wrapper on, and it must not keep the
    step's process groups alive past the strategy's ``close`` (``runtime/failures/shutdown.py``)."""
    own = "optimizer_step" in vars(precision)
    original = precision.optimizer_step
    step = weakref.ref(controller)

    def optimizer_step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            out = original(optimizer, *args, **kwargs)
        finally:
            if own:
                precision.optimizer_step = original
            else:
                del precision.optimizer_step
        held = step()
        if held is not None:
            report_memory(module, held)
        return out

    precision.optimizer_step = optimizer_step


def report_memory(module: pl.LightningModule, controller: StepController) -> None:
    """Log this rank's breakdown and have rank 0 print every rank's (collective over the job: every rank's first
    optimizer step calls it)."""
    top = controller.pipeline.topology
    breakdown = controller.memory_breakdown(module.trainer.strategy.optimizers)
    row = (top.rank, top.stage, breakdown)
    rows: list[Any] | None = [row]
    if top.world_size > 1:
        rows = [None] * top.world_size if top.rank == 0 else None
        dist.gather_object(row, rows, dst=0)
    for rank, stage, parts in sorted(rows or []):
        rank_zero_info(f"AvgPipe: rank {rank} (stage {stage}) at the first training step: {parts.describe()}.")
    for name, value in breakdown.scalars().items():
        module.log(name, value, on_step=True, on_epoch=False)
