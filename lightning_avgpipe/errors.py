"""The errors the pipeline raises about what a user gave it (kept free of Lightning, like the runtime)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


class PipelineContractError(TypeError):
    """The model or its step does not meet the pipeline contract (see docs/contract.md)."""


def loss_of(out: Any, where: str = "training_step") -> Tensor:
    """The scalar loss in a step's return value (a tensor, or a mapping with ``"loss"``): the one check of it."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else ""
        raise PipelineContractError(
            f"{where} must return a scalar loss tensor (or a dict with 'loss') under strategy='avgpipe', got "
            f"{type(out).__name__}{shape}."
        )
    return loss
