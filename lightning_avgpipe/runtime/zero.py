"""Optimizer state sharded over the D pipeline groups (ZeRO stage 1; docs/parallelism.md#sharded-optimizer-state).

With ``averaging="exact"`` the D groups train one model: after the gradient average every group holds the same
gradients, and every group would run the same optimizer step on the same weights, each keeping the whole optimizer
state (Adam: two tensors the size of the weights). Sharded, each of the D ranks that hold a stage (its stage group)
owns a part of the stage's parameters, whole tensors balanced by size; it keeps the optimizer state of its part
only and steps only it (the others' gradients are set to ``None``, which ``torch.optim`` skips), then every owner
broadcasts its updated part to the group. The weights after a step are those of the unsharded run; the optimizer
state per rank is about 1/D of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_avgpipe.optim import WrappedOptimizer
from lightning_avgpipe.shards import local


def assign(params: Sequence[nn.Parameter], parts: int) -> list[int]:
    """Owner (0..parts-1) of each parameter: the largest first, each to the least loaded part (by elements). Sizes
    are the whole tensors' (``DTensor.numel()`` is global), so every shard of a tensor group picks the same owners."""
    load = [0] * parts
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        d = min(range(parts), key=lambda d: (load[d], d))
        owner[i] = d
        load[d] += params[i].numel()
    return owner


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer, stepping only this rank's part of the parameters; the parts are then broadcast.

    Args:
        user: the optimizer built over the stage's parameters (its ``param_groups`` and lr schedulers stay its own).
        params: the stage's parameters, in the same order on every rank of ``group``.
        group: the stage group (the D ranks holding this stage).
        ranks: the global ranks of ``group``, group 0 first.
        index: this rank's position in ``ranks``.
    """

    def __init__(
        self, user: Optimizer, params: Sequence[nn.Parameter], group: Any, ranks: Sequence[int], index: int
    ) -> None:
        super().__init__(user)  # the state is the user's optimizer's
        self.params = list(params)
        self.group = group
        self.ranks = list(ranks)
        self.index = index
        self.owner = assign(self.params, len(self.ranks))

    def mine(self) -> list[nn.Parameter]:
        return [p for p, d in zip(self.params, self.owner) if d == self.index]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.user.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:  # the training step, its backwards and clipping (all gradients present)
            with torch.enable_grad():
                loss = closure()
        for p, d in zip(self.params, self.owner):
            if d != self.index:
                p.grad = None  # another rank's part: torch.optim skips it and keeps no state for it
        self.user.step()
        self.broadcast()
        return loss

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every owner's updated part to the whole group (one flat broadcast per owner)."""
        for d, src in enumerate(self.ranks):
            part = [local(p.detach()) for p, o in zip(self.params, self.owner) if o == d]
            if not part:
                continue
            flat = torch.cat([t.reshape(-1) for t in part])
            dist.broadcast(flat, src=src, group=self.group)
            if d != self.index:
                offset = 0
                for t in part:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def drop_foreign_state(self) -> None:
        """Forget the state of parameters another rank owns (after loading a whole state dict)."""
        for p, d in zip(self.params, self.owner):
            if d != self.index:
                self.user.state.pop(p, None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "shard_optimizer_state=True does not take parameter groups added during training (a fine-tuning "
            "callback unfreezing layers); build the optimizer over every parameter, or turn sharding off."
        )

    def state_dict(self) -> dict[str, Any]:
        return self.user.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.user.load_state_dict(state_dict)
        self.drop_foreign_state()

    def __repr__(self) -> str:
        return f"ShardedOptimizer({type(self.user).__name__}, part {self.index} of {len(self.ranks)})"
