"""One step's squared gradient norms at two batch sizes, for the noise scale (``algorithms/noise_scale.py``).

With N > 1 parallel pipelines a step already holds N gradients, each of its own batch (b_small = B) and, by their
mean, the gradient of all N batches (b_big = N·B): no copy is needed. With one pipeline of M >= 2 micro-batches the
gradient is accumulated over the micro-batches; the probe copies it once, after the first half of this stage's
backwards, so that the two halves (b_small = B/2) and the whole (b_big = B) are known.

Each stage measures its own slice of the parameters; one all-reduce of two numbers over the job adds the stages
(and averages the D pipeline groups), so every rank gets the same
:class:`~lightning_avgpipe.algorithms.noise_scale.GradientNorms`. A weight shared between stages (a tied embedding)
is counted once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.algorithms.noise_scale import GradientNorms
from lightning_avgpipe.shards import local, norm_weight


def _sq_norm(tensors: Sequence[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """Σ w‖t‖² in float64 (0 for no tensors): one fused norm per tensor, then the squares summed in float64
    (``weights``: a tensor-parallel shard's share, ``shards.norm_weight``; None: all 1)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    squares = torch.stack(torch._foreach_norm(list(tensors))).double().square()
    if weights is not None:
        squares = squares * torch.tensor(list(weights), dtype=torch.float64, device=squares.device)
    return squares.sum().cpu()


def _harmonic(sizes: Sequence[float]) -> float:
    return len(sizes) / sum(1.0 / s for s in sizes)


class GradientProbe:
    """Measures this stage's squared gradient norms during one training step (accumulation of 1).

    Args:
        replicas: per replica, this stage's parameters (one list when N = 1).
        unit_samples: per unit (replica-major, as the step's units), its number of samples.
        unit_owner: per unit, the replica it belongs to.
        skip: ids of parameters not to count on this stage (copies of weights counted on another stage).
    """

    def __init__(
        self,
        replicas: Sequence[Sequence[nn.Parameter]],
        unit_samples: Sequence[int],
        unit_owner: Sequence[int],
        skip: set[int] | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        skip = skip or set()
        self.replicas = [[p for p in params if id(p) not in skip] for params in replicas]
        # under tensor parallelism each rank holds shards: weights make the job-wide sum count every element once
        T = tensor_parallel_size
        self.weights = [norm_weight(p, T) for p in self.replicas[0]] if T > 1 and self.replicas else None
        self.unit_samples = list(unit_samples)
        self.unit_owner = list(unit_owner)
        self.split = len(self.replicas) == 1  # one pipeline: the halves of its micro-batches
        self._done: list[int] = []
        self._half: list[Tensor] | None = None
        self._half_units: list[int] = []

    @staticmethod
    def usable(num_replicas: int, num_units: int) -> bool:
        """Whether a step of this shape has two batch sizes: N > 1, or one pipeline of >= 2 micro-batches."""
        return num_replicas > 1 or num_units >= 2

    def after_backward(self, unit: int) -> None:
        """Called by the executor after each unit's backward on this stage."""
        if not self.split:
            return
        self._done.append(unit)
        if len(self._done) == len(self.unit_samples) // 2:
            self._half = [self._grad(p).clone() for p in self.replicas[0]]
            self._half_units = list(self._done)

    @staticmethod
    def _grad(p: nn.Parameter) -> Tensor:
        return local(p.grad) if p.grad is not None else torch.zeros_like(local(p.detach()))

    def local(self) -> tuple[Tensor, float, float]:
        """``(tensor([small_sq, big_sq]) on this stage, b_small, b_big)``."""
        if self.split:
            return self._local_halves()
        return self._local_replicas()

    def _local_replicas(self) -> tuple[Tensor, float, float]:
        sizes = [0.0] * len(self.replicas)
        for u, n in enumerate(self.unit_owner):
            sizes[n] += self.unit_samples[u]
        total = sum(sizes)
        grads = [[self._grad(p).detach() for p in params] for params in self.replicas]
        small = torch.stack([_sq_norm(g, self.weights) for g in grads]).mean()
        # the gradient of all N batches: each replica's is its own batch mean, so weight by batch size
        mean = list(torch._foreach_mul(grads[0], sizes[0] / total))
        for n in range(1, len(grads)):
            torch._foreach_add_(mean, grads[n], alpha=sizes[n] / total)
        big = _sq_norm(mean, self.weights)
        return torch.stack([small, big]), _harmonic(sizes), total

    def _local_halves(self) -> tuple[Tensor, float, float]:
        if self._half is None:
            raise RuntimeError("GradientProbe: the first half of the backwards did not run (after_backward unused)")
        first = sum(self.unit_samples[u] for u in self._half_units)
        total = sum(self.unit_samples)
        second = total - first
        whole = [self._grad(p).detach() for p in self.replicas[0]]
        # the accumulated gradient is Σ (share of unit) · (its mean gradient): a half's mean is its part / its share,
        # so |g1|² = (total/first)² |part1|² and |g2|² = (total/second)² |whole - part1|² (no scaled copies)
        part1 = _sq_norm(self._half, self.weights)
        torch._foreach_sub_(self._half, whole)  # in place: -(the second half's part)
        part2 = _sq_norm(self._half, self.weights)
        small = (part1 * (total / first) ** 2 + part2 * (total / second) ** 2) / 2
        big = _sq_norm(whole, self.weights)
        return torch.stack([small, big]), _harmonic([first, second]), float(total)

    def finish(
        self, group: Any = None, num_groups: int = 1, device: torch.device | None = None, collective: bool = True
    ) -> GradientNorms:
        """Add the stages (one all-reduce over ``group``, the whole job) and average the ``num_groups`` groups."""
        values, b_small, b_big = self.local()
        if collective and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            values = values.to(device) if device is not None else values  # NCCL reduces device tensors
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
            values = values.cpu()
        values = values / num_groups
        self._half = None
        return GradientNorms(float(values[0]), b_small, float(values[1]), b_big)
