"""The step's gradients, set apart between Lightning's ``training_step`` and ``backward``, and their clipping.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (at the start of an accumulation
window), then ``backward``. Under the pipeline every backward already ran inside ``training_step``, so its gradients
are kept apart from the ones already accumulated, and added in ``backward``, where Lightning expects them
(docs/how-it-works.md#gradients-and-lightnings-zero_grad). Earlier gradients that ``zero_grad`` will set to ``None``
with nothing reading them first are freed before the step instead (:func:`discarded_by_zero_grad`): kept, they would
be a second copy of the stage's gradients at the step's peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.optim import ElasticOptimizer
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer
from lightning_avgpipe.runtime.sync.clipping import clip_grad_norm_across


class GradStash:
    """This step's gradients of a stage's parameters, between the step and ``backward``."""

    def __init__(self) -> None:
        self._grads: list[Tensor | None] | None = None

    @contextlib.contextmanager
    def apart(self, params: Sequence[nn.Parameter], discarded: Collection[int] = ()) -> Iterator[None]:
        """Run a step with no gradients on ``params``; afterwards keep what it produced and put the old ones back,
        except those of the parameters in ``discarded`` (ids), which are freed now (``zero_grad`` would drop them)."""
        saved = [None if id(p) in discarded else p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            self._grads = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g

    def land(self, params: Sequence[nn.Parameter]) -> None:
        """Add the kept gradients to ``params``' (the same parameters, in the same order)."""
        grads, self._grads = self._grads, None
        if grads is None:
            return
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def discarded_by_zero_grad(trainer: pl.Trainer, batch_idx: int | None) -> set[int]:
    """The ids of the parameters whose gradients Lightning sets to ``None`` between this ``training_step`` and
    ``backward``, read by no hook first: its default ``optimizer_zero_grad`` at the start of an accumulation window
    (``batch_idx``; ``None``: unknown), ``on_before_zero_grad`` overridden nowhere, and optimizers whose
    ``zero_grad`` is torch's. Empty where any of that does not hold: those gradients are then kept."""
    module = trainer.lightning_module
    accumulate = trainer.accumulate_grad_batches
    first = accumulate == 1 or (batch_idx is not None and batch_idx % accumulate == 0)
    if not first or not compat.zeroes_gradients(trainer):
        return set()
    hooks = [module, *trainer.callbacks]  # type: ignore[attr-defined]
    if is_overridden("optimizer_zero_grad", module) or any(is_overridden("on_before_zero_grad", h) for h in hooks):
        return set()
    found: set[int] = set()
    for optimizer in trainer.strategy.optimizers:
        params = _set_to_none(compat.unwrap_optimizer(optimizer))
        if params is None:
            return set()
        found |= params
    return found


def free_after_slicing(trainer: pl.Trainer, batch_idx: int | None) -> None:
    """Tell each ZeRO-1 optimizer (:class:`ShardedOptimizer`) the gradients it may free as soon as its step has
    taken its slice of them: those the ``zero_grad`` after this step (that of batch ``batch_idx + 1``) drops unread.
    Kept, the stage's whole gradients would sit beside the optimizer's temporaries at the step's peak."""
    after = discarded_by_zero_grad(trainer, None if batch_idx is None else batch_idx + 1)
    for optimizer in trainer.strategy.optimizers:
        inner = compat.unwrap_optimizer(optimizer)
        if isinstance(inner, ShardedOptimizer):
            inner.unread_after_step = after


def _set_to_none(optimizer: Optimizer) -> set[int] | None:
    """The ids of the parameters ``optimizer.zero_grad()`` sets to ``None``; ``None`` if it is not known."""
    if isinstance(optimizer, ElasticOptimizer):  # every replica's clone
        inner = [_set_to_none(opt) for opt in optimizer.replicas]
        return None if any(i is None for i in inner) else set().union(*inner)  # type: ignore[arg-type]
    if isinstance(optimizer, ShardedOptimizer):
        return _set_to_none(optimizer.user)
    if type(optimizer).zero_grad is not Optimizer.zero_grad:  # the user's own: who knows
        return None
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def install_clipping(precision: Any, pipeline: Callable[[], Any], device: torch.device) -> None:
    """Make Lightning's gradient clipping act on the replicas, which hold the gradients: by the norm over the
    whole pipeline (every stage and replica, shared weights counted once), or by value.

    ``pipeline`` is read when clipping runs, so no process group is kept in these closures (``close()`` at exit).
    """

    def clip_grad_by_norm(optimizer: Any, clip_val: int | float) -> None:
        pipe = pipeline()
        elastic, top = pipe.replicas.elastic, pipe.topology
        sets = [elastic.replica_params(n) for n in range(elastic.num_replicas)]
        clip_grad_norm_across(
            sets,
            float(clip_val),
            top.pipeline_group,
            device=device,
            uncounted=pipe.replicas.uncounted,
            tensor_group=top.tensor_group,
            tensor_parallel_size=top.tensor_parallel_size,
            shard_group=top.stage_group if pipe.sharding is not None else None,
        )

    def clip_grad_by_value(optimizer: Any, clip_val: int | float) -> None:
        params = [p for p in pipeline().replicas.params if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_value_(params, float(clip_val))

    precision.clip_grad_by_norm = clip_grad_by_norm
    precision.clip_grad_by_value = clip_grad_by_value
