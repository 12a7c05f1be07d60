"""A training step's units, the things a plan schedules: what each carries, what runs it, and its loss.

Sequential (``replica_execution="sequential"``): unit ``u`` is one replica's micro-batch, ``N x M`` units
replica-major, each run by its replica's layers. Batched (``"batched"``): unit ``m`` is micro-batch ``m`` of every
replica, stacked and run as one ``torch.func.vmap`` call over the N replicas (``algorithms/replicas.py``), ``M``
units.

A unit's loss is weighted by its share of its replica's batch (each replica's gradient is its own batch mean) and
divided by the gradient accumulation steps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.algorithms.noise_scale import GradientNorms
from lightning_avgpipe.algorithms.replicas import BatchedReplicas, select, stack
from lightning_avgpipe.errors import loss_of
from lightning_avgpipe.runtime.trace import StepTrace

# (stage output, micro-batch, its share of all the iteration's samples) -> a scalar loss, or {"loss": ...}
LossFn = Callable[[Any, Any, float], Any]


@dataclass
class Units:
    """The step's units for :meth:`~lightning_avgpipe.runtime.executor.StageExecutor.run`."""

    keys: list[Hashable]  # per unit, the transfer metadata key both neighbours compute for it
    inputs: Callable[[int], Any]  # unit -> the first layer's input (first stage)
    head: Callable[[int, Any], Tensor]  # (unit, last stage's output) -> the weighted loss to backpropagate
    stage_fn_for: Callable[[int, int], Callable[[Any], Any]]  # (stage, unit) -> the layers that run it


def sequential(
    key: str,
    micro: Sequence[Any],
    weights: Sequence[float],
    owner: Sequence[int],
    replicas: int,
    accumulate: int,
    loss_fn: LossFn,
    inputs: Callable[[Any], Any],
    replica_fns: Sequence[Mapping[int, Callable[[Any], Any]]],
) -> Units:
    """Unit ``u`` is micro-batch ``micro[u]`` of replica ``owner[u]``."""

    def head(u: int, output: Any) -> Tensor:
        loss = loss_of(loss_fn(output, micro[u], weights[u] / replicas), "training_step")
        return loss * (weights[u] / accumulate)

    return Units(
        [(key, microbatch.signature(mb)) for mb in micro],
        lambda u: inputs(micro[u]),
        head,
        lambda j, u: replica_fns[owner[u]][j],
    )


def batched(
    key: str,
    micro: Sequence[Any],
    weights: Sequence[float],
    owner: Sequence[int],
    replicas: int,
    accumulate: int,
    loss_fn: LossFn,
    inputs: Callable[[Any], Any],
    batched_replicas: BatchedReplicas,
) -> Units:
    """Unit ``m`` carries micro-batch ``m`` of every replica, stacked (one vmap)."""
    n = replicas
    per = [[u for u in range(len(micro)) if owner[u] == r] for r in range(n)]
    if len({len(units) for units in per}) != 1 or len({microbatch.signature(micro[us[0]]) for us in per}) != 1:
        raise ValueError(
            "replica_execution='batched' needs the N batches of an iteration to have the same shape; use "
            "drop_last=True in the DataLoader or replica_execution='sequential'."
        )
    units = [[per[r][m] for r in range(n)] for m in range(len(per[0]))]  # unit m -> its N micro-batches

    def head(m: int, output: Any) -> Tensor:
        terms = [
            loss_of(loss_fn(select(output, r), micro[u], weights[u] / n), "training_step") * (weights[u] / accumulate)
            for r, u in enumerate(units[m])
        ]
        return torch.stack(terms).sum()

    return Units(
        [(key, "batched", microbatch.signature(micro[us[0]])) for us in units],
        lambda m: stack([inputs(micro[u]) for u in units[m]]),
        head,
        lambda j, m: batched_replicas,
    )


def first_input(batch: Any) -> Any:
    """The default first-layer input of a micro-batch: ``batch[0]`` of a tuple or list, else the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


@dataclass
class StepResult:
    """What one training step produced on this stage.

    Attributes:
        losses: on the last stage, unit -> that unit's loss as weighted for backward (detached); empty elsewhere.
        loss: on the last stage, the mean over the N replicas of each replica's batch loss (what is logged).
        samples: samples in the iteration on this pipeline (the N batches).
        trace: this stage's timeline of the step (compute, waits, sends; activation peak when measured).
        divergence: ``(N,)`` relative distances ‖w_n − w_ref‖/‖w_ref‖ over the whole pipeline, when asked for.
        noise: the step's squared gradient norms at two batch sizes over the whole job, when asked for and the
            step has two sizes (``runtime/sync/gradient_probe.py``); the controller
            smooths them into its ``noise_scale``.
    """

    losses: dict[int, Tensor]
    loss: Tensor | None
    samples: int
    trace: StepTrace
    divergence: Tensor | None = None
    noise: GradientNorms | None = None
