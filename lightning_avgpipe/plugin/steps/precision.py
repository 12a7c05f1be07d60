"""``precision="16-mixed"`` for a pipeline: one loss scale for the whole job (docs/strategy.md#16-mixed).

Lightning's ``MixedPrecision`` scales the loss in ``pre_backward`` and lets its ``GradScaler`` find overflows in the
gradients it unscales. Under the strategy the backward runs inside the pipeline's step, and each rank unscales only
its stage's gradients. So:

- the strategy passes ``scaler.get_scale()`` to ``StagePipeline.train_step(loss_scale=...)``, which multiplies every
  unit's loss before its backward: every stage's gradients carry the scale;
- after the unscale, :func:`agree_on_overflow` all-reduces the overflow flag over every rank (every stage of every
  pipeline group), so an inf or NaN anywhere skips the step everywhere, and every scaler updates its scale from
  the same verdict: the scale stays equal on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_avgpipe.plugin.compat import AfterClosureMixedPrecision


class PipelineMixedPrecision(AfterClosureMixedPrecision):
    """Lightning's ``MixedPrecision`` (``16-mixed``) with the loss scaled inside the pipeline and one overflow verdict
    for the job. Made by the strategy from the Trainer's plugin (its scaler is kept)."""

    def __init__(self, plugin: MixedPrecision) -> None:
        super().__init__(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """What every unit's loss is multiplied by before its backward (``None``: no scaling). Scaling a one
        through the scaler also starts its scale, which ``unscale_`` requires."""
        if self.scaler is None:
            return None
        return self.scaler.scale(torch.ones((), device=self.device))

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        # the pipeline already ran the backward from scaled losses; the loss Lightning sees stays unscaled
        return Precision.pre_backward(self, tensor, module)

    def after_closure(self, model: Any, optimizer: Any) -> None:
        if self.scaler is not None:
            agree_on_overflow(self.scaler, optimizer)


def agree_on_overflow(scaler: torch.amp.GradScaler, optimizer: Any) -> float:
    """Make the overflow flag the scaler recorded for ``optimizer`` (in ``unscale_``) the maximum over every rank;
    returns it. A rank whose stage has no gradients (no flag recorded) takes the others' verdict."""
    state = scaler._per_optimizer_states[id(optimizer)]
    found = state["found_inf_per_device"]
    local = float(sum(float(v.item()) for v in found.values())) if found else 0.0
    scale = scaler._scale
    assert scale is not None, "the loss scale starts in PipelineMixedPrecision.loss_scale"
    verdict = torch.tensor([local], dtype=torch.float32, device=scale.device)  # where the backend can reduce it
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    device = next(iter(found)) if found else scale.device
    state["found_inf_per_device"] = {device: torch.full((1,), float(verdict.item()), device=device)}
    return float(verdict.item())


def for_pipeline(plugin: Precision) -> Precision:
    """The Trainer's precision plugin, with ``16-mixed``'s scaler working across the pipeline."""
    if (
        isinstance(plugin, MixedPrecision)
        and plugin.scaler is not None
        and not isinstance(plugin, PipelineMixedPrecision)
    ):
        return PipelineMixedPrecision(plugin)
    return plugin


def loss_scale_of(plugin: Precision) -> torch.Tensor | None:
    return plugin.loss_scale if isinstance(plugin, PipelineMixedPrecision) else None
