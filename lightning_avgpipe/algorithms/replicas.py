"""Batched replica execution: a stage's N replicas run as one vmapped call over stacked weights (torch.func).

Sequential execution sends N·M units through the schedule, each a micro-batch of one replica. Batched execution
sends M units, each carrying micro-batch m of all N replicas stacked on a new leading dimension, through
``vmap(functional_call(layers, weights_n, x_n))``: one larger operation per layer instead of N small ones, at
the cost of a bubble sized by M rather than N·M. It pays when micro-batches are too small to keep a device busy.

Per iteration the replicas' weights are stacked once into leaf tensors; after the backward passes, the stacked
gradients are handed back to each replica's parameters, so optimizers and the elastic update see ordinary
per-replica gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap


class BatchedReplicas:
    """Callable stage function over stacked inputs ``(N, ...)`` that runs every replica at once."""

    def __init__(self, replicas: Sequence[Sequence[nn.Module]]) -> None:
        buffers = [name for layers in replicas[:1] for m in layers for name, _ in m.named_buffers()]
        if buffers:
            raise ValueError(
                f"replica_execution='batched' needs layers without buffers (found {buffers[:3]}, e.g. BatchNorm "
                "statistics that every replica updates in place); use replica_execution='sequential'."
            )
        self.template = nn.Sequential(*replicas[0])
        self.names = [name for name, _ in self.template.named_parameters()]
        self.params = [
            [dict(nn.Sequential(*layers).named_parameters())[name] for name in self.names] for layers in replicas
        ]
        self.stacked: dict[str, Tensor] = {}

    def begin(self) -> None:
        """Stack the replicas' current weights into fresh leaves (once per iteration)."""
        self.stacked = {
            name: torch.stack([ps[i].detach() for ps in self.params]).requires_grad_(self.params[0][i].requires_grad)
            for i, name in enumerate(self.names)
        }

    def __call__(self, x: Any) -> Any:
        def one(weights: dict[str, Tensor], xi: Any) -> Any:
            return functional_call(self.template, weights, (xi,))

        return vmap(one, in_dims=(0, 0), randomness="different")(self.stacked, x)

    def finish(self) -> None:
        """Add each replica's slice of the stacked gradients to its own parameters; drop the stacked copies."""
        for i, name in enumerate(self.names):
            grad = self.stacked[name].grad
            if grad is None:
                continue
            for n, ps in enumerate(self.params):
                p = ps[i]
                p.grad = grad[n].clone() if p.grad is None else p.grad + grad[n]
        self.stacked = {}


def stack(parts: Sequence[Any]) -> Any:
    """Stack N same-structured inputs (tensors or tuples of tensors) on a new leading dimension."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.stack(list(parts))
    if isinstance(first, (tuple, list)):
        return type(first)(stack([p[i] for p in parts]) for i in range(len(first)))
    raise TypeError(f"replica_execution='batched' can stack tensors or tuples of tensors, not {type(first).__name__}.")


def select(stacked: Any, n: int) -> Any:
    """Replica ``n``'s slice of a stacked output."""
    if isinstance(stacked, Tensor):
        return stacked[n]
    if isinstance(stacked, (tuple, list)):
        return type(stacked)(select(s, n) for s in stacked)
    raise TypeError(f"cannot take replica {n} of a {type(stacked).__name__}")
