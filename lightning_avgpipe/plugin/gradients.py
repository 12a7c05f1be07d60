"""Gradient clipping by the global norm over every stage of a pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def clip_grad_norm_across(params: Sequence[Tensor], max_norm: float, group: Any = None) -> Tensor:
    """Scale gradients so the 2-norm over all stages' parameters is at most ``max_norm``; returns that norm.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` on the unsplit model: the squared norms of every stage
    are summed (one all-reduce over the pipeline group) before the common clip coefficient is applied.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        local += g.detach().float().pow(2).sum()
    if dist.is_available() and dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    total = local.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
