"""The step's gradients, set apart between Lightning's ``training_step`` and ``backward``, and their clipping.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (at the start of an accumulation
window), then ``backward``. Under the pipeline every backward already ran inside ``training_step``, so its gradients
are kept apart from the ones already accumulated, and added in ``backward``, where Lightning expects them
(docs/how-it-works.md#gradients-and-lightnings-zero_grad).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.runtime.sync.clipping import clip_grad_norm_across


class GradStash:
    """This step's gradients of a stage's parameters, between the step and ``backward``."""

    def __init__(self) -> None:
        self._grads: list[Tensor | None] | None = None

    @contextlib.contextmanager
    def apart(self, params: Sequence[nn.Parameter]) -> Iterator[None]:
        """Run a step with no gradients on ``params``; afterwards keep what it produced and put the old ones back."""
        saved = [p.grad for p in params]
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
