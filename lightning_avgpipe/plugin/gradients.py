"""The step's gradients, set apart between Lightning's ``training_step`` and ``backward``.

Lightning's automatic optimization runs ``training_step``, then ``zero_grad`` (at the start of an accumulation
window), then ``backward``. Under the pipeline every backward already ran inside ``training_step``, so its gradients
are kept apart from the ones already accumulated, and added in ``backward``, where Lightning expects them
(docs/how-it-works.md#gradients-and-lightnings-zero_grad).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import Tensor, nn


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
