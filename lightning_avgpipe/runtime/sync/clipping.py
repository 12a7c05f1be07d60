"""Gradient clipping by the global norm over every stage of a pipeline, one norm per replica."""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.shards import local, norm_weight


def clip_grad_norm_across(
    param_sets: Sequence[Sequence[Tensor]],
    max_norm: float,
    group: Any = None,
    device: torch.device | None = None,
    uncounted: Set[int] = frozenset(),
    tensor_group: Any = None,
    tensor_parallel_size: int = 1,
    shard_group: Any = None,
) -> Tensor:
    """Clip each set's gradients to a 2-norm of at most ``max_norm`` over all stages; returns the norms.

    Each set is one replica's parameters on this stage. The arithmetic is ``torch.nn.utils.clip_grad_norm_`` on
    the unsplit model: the squared norms of every stage are summed (one all-reduce over the pipeline group for
    all sets at once) before each set's clip coefficient is applied. Parameters whose ``id`` is in ``uncounted``
    (a weight shared with another stage, counted there) are scaled but left out of the norm. Under tensor
    parallelism (``tensor_parallel_size`` > 1) each rank sums its shards' squares, a whole tensor's weighted 1/T,
    over ``tensor_group`` first (``shards.py``). Under FSDP (``shard_group``: the stage group, whose ranks hold
    disjoint shards of every gradient) the squares are summed over it too, a weight it keeps whole weighted 1/D.
    """
    shards = dist.get_world_size(shard_group) if shard_group is not None else 1
    grads = [[local(p.grad) for p in params if p.grad is not None] for params in param_sets]
    device = next((g[0].device for g in grads if g), device or torch.device("cpu"))
    sums = torch.zeros(len(grads), dtype=torch.float32, device=device)
    for i, params in enumerate(param_sets):
        for p in params:
            if p.grad is not None and id(p) not in uncounted:
                weight = norm_weight(p, tensor_parallel_size, shards)
                sums[i] += local(p.grad).detach().float().pow(2).sum() * weight
    if tensor_parallel_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tensor_group)
    if shard_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard_group)
    if dist.is_available() and dist.is_initialized() and (group is None or dist.get_world_size(group) > 1):
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    total = sums.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for i, gs in enumerate(grads):
        for g in gs:
            g.detach().mul_(coef[i].to(g.dtype))
    return total
