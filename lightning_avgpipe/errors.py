"""The errors the pipeline raises about what a user gave it (kept free of Lightning, like the runtime)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.shards import local


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


def check_finite(
    where: str,
    losses: Mapping[int, Tensor],
    params: Sequence[nn.Parameter],
    reference: Sequence[nn.Parameter],
    param_names: Mapping[int, str],
) -> None:
    """Fail, naming ``where``, the replica and the parameter, on a non-finite loss (``losses``: unit -> loss) or
    gradient of ``params`` (every replica's parameters, replica-major, each replica's in ``reference``'s order;
    ``param_names``: ``id(reference parameter)`` -> its name)."""
    fix = "lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)) or check the data"
    if losses:
        stacked = torch.stack([r.detach().float() for r in losses.values()])
        if not bool(torch.isfinite(stacked).all()):
            units = [u for u, r in losses.items() if not bool(torch.isfinite(r))]
            raise FloatingPointError(f"{where}: the loss of unit(s) {units} is not finite; {fix}.")
    grads = [local(p.grad) if p.grad is not None else None for p in params]
    present = [g for g in grads if g is not None]
    if not present or bool(torch.isfinite(torch.stack(torch._foreach_norm(present))).all()):
        return
    per_replica = max(1, len(reference))
    for i, g in enumerate(grads):
        if g is not None and not bool(torch.isfinite(g).all()):
            replica, j = divmod(i, per_replica)
            name = param_names.get(id(reference[j]), f"parameter {j}") if j < len(reference) else f"parameter {j}"
            raise FloatingPointError(
                f"{where}: a non-finite gradient in replica {replica}, layer parameter '{name}'; {fix}."
            )
