"""Weight gradients deferred to a later action: the W of zero-bubble schedules (Qi et al., ICLR 2024).

A zero-bubble stage splits its backward in two: I, the input gradient the previous stage waits for, and W, the weight
gradients nothing downstream needs, run later in an idle slot. Walking the autograd graph twice costs more than one
whole backward, so the split is made where the weights are: :class:`WeightGradQueue` routes the forward of every
``nn.Linear``, plain ``nn.Embedding`` and Hugging Face ``Conv1D`` through an autograd Function. While the queue is
:meth:`~WeightGradQueue.deferring` under a key, that Function's backward computes the input and bias gradients at once
and queues (input, output gradient, weight) under the key; :meth:`~WeightGradQueue.run` later runs the queued matmuls
and adds them into ``weight.grad`` as autograd would. Outside ``deferring`` it is the whole backward. A layer the
Function cannot serve takes the whole backward, even in I: a DTensor weight, a weight that is not a leaf or has hooks,
functorch transforms (vmap, grad), ``torch.compile``, double backward.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_avgpipe.shards import is_dtensor

_OFF: Hashable = object()  # the key while nothing is deferred


@dataclass
class _Pending:
    """One deferred weight gradient: ``grad_of(*tensors)``, to be added into ``param.grad``."""

    param: Tensor
    tensors: tuple[Tensor, ...]
    grad_of: Callable[..., Tensor]


def _linear_weight_grad(x: Tensor, g: Tensor, transposed: bool) -> Tensor:
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return x2.t() @ g2 if transposed else g2.t() @ x2  # Conv1D's weight is (in, out), Linear's (out, in)


def _embedding_weight_grad(indices: Tensor, g: Tensor, rows: int, padding_idx: int, scale: bool) -> Tensor:
    return torch.ops.aten.embedding_dense_backward(g, indices, rows, padding_idx, scale)


def _as_autocast(device_type: str, *tensors: Tensor | None) -> list[Tensor | None]:
    """The tensors as autocast hands them to a lower-precision op (float64 and non-float tensors stay)."""
    if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device_type)
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors]


def _weight_grad(ctx: Any, needed: bool, tensors: tuple[Tensor, ...], grad_of: Callable[..., Tensor]) -> Tensor | None:
    """The weight's gradient now (whole backward), or ``None`` with the work queued when the queue defers it."""
    param, queue = ctx.param, ctx.queue
    if not needed:
        return None
    if queue.defers(param):
        queue.push(_Pending(param, tensors, grad_of))
        return None
    return grad_of(*tensors).to(param.dtype)


class _LinearFn(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` (``x @ weight + bias`` for a transposed, Conv1D, weight)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, queue: WeightGradQueue, transposed: bool
    ) -> Tensor:
        xc, wc, bc = _as_autocast(x.device.type, x, weight, bias)  # what F.linear would use under autocast
        assert xc is not None and wc is not None
        ctx.queue, ctx.param, ctx.transposed, ctx.x_dtype = queue, weight, transposed, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(xc if weight.requires_grad else None, wc)
        return F.linear(xc, wc.t() if transposed else wc, bc)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors  # under activation checkpointing, this recomputes the forward
        gx = (g @ (w.t() if ctx.transposed else w)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        grad_of = functools.partial(_linear_weight_grad, transposed=ctx.transposed)
        gw = _weight_grad(ctx, ctx.needs_input_grad[1], (x, g), grad_of)
        return gx, gw, gb, None, None


class _EmbeddingFn(torch.autograd.Function):
    """``F.embedding(indices, weight, padding_idx, scale_grad_by_freq=scale)`` (no max_norm, dense)."""

    @staticmethod
    def forward(
        ctx: Any, indices: Tensor, weight: Tensor, queue: WeightGradQueue, padding_idx: int | None, scale: bool
    ) -> Tensor:
        ctx.queue, ctx.param = queue, weight
        padding = -1 if padding_idx is None else padding_idx
        ctx.grad_of = functools.partial(_embedding_weight_grad, rows=weight.shape[0], padding_idx=padding, scale=scale)
        ctx.save_for_backward(indices)
        return F.embedding(indices, weight, padding_idx, None, 2.0, scale, False)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        return None, _weight_grad(ctx, ctx.needs_input_grad[1], (indices, g), ctx.grad_of), None, None, None


def _servable(*tensors: Any) -> bool:
    """Whether the Functions may run: plain tensors, no functorch transform, no compilation."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or (isinstance(t, Tensor) and not is_dtensor(t)) for t in tensors)


def is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` by its shape: ``weight`` (in, ``nf``), ``bias``, forward ``x @ weight + bias``."""
    w = getattr(m, "weight", None)
    return (
        type(m).__name__ == "Conv1D"
        and isinstance(w, Tensor)
        and w.dim() == 2
        and getattr(m, "nf", None) == w.shape[1]
        and isinstance(getattr(m, "bias", None), Tensor)
    )


def _patched_forward(m: nn.Module, queue: WeightGradQueue) -> Callable[[Tensor], Tensor] | None:
    """The forward that goes through the Functions, bound to ``m`` (so a deep copy of ``m`` runs its own weights
    through the same queue), or ``None`` for a module they do not serve."""
    if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward or is_conv1d(m):
        transposed = not isinstance(m, nn.Linear)

        def linear(self: nn.Module, x: Tensor) -> Tensor:
            w, b = self.weight, self.bias
            if not (_servable(x, w, b) and x.is_floating_point()):
                return type(self).forward(self, x)
            return _LinearFn.apply(x, w, b, queue, transposed)

        return types.MethodType(linear, m)
    if isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward and m.max_norm is None and not m.sparse:

        def embedding(self: nn.Embedding, indices: Tensor) -> Tensor:
            if not _servable(indices, self.weight):
                return type(self).forward(self, indices)
            return _EmbeddingFn.apply(indices, self.weight, queue, self.padding_idx, self.scale_grad_by_freq)

        return types.MethodType(embedding, m)
    return None


class WeightGradQueue:
    """Defers the weight gradients of the Linear, Embedding and Conv1D layers among ``modules`` (and their submodules)
    from a backward run inside :meth:`deferring` to :meth:`run`. A module whose ``forward`` is already replaced on the
    instance, or a subclass with its own ``forward``, is left alone (it takes the whole backward)."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._key: Hashable = _OFF
        self._pending: dict[Hashable, list[_Pending]] = {}
        self.patched: list[nn.Module] = []
        self.install(modules)

    def install(self, modules: Iterable[nn.Module]) -> None:
        """Serve the layers among ``modules`` too (new replicas, say); one already served is left as it is."""
        for root in modules:
            for m in root.modules():
                forward = None if "forward" in vars(m) else _patched_forward(m, self)
                if forward is not None:
                    m.forward = forward  # type: ignore[method-assign]
                    self.patched.append(m)

    def remove(self) -> None:
        """Give every patched module its own forward back (what is still queued stays, for :meth:`run`)."""
        for m in self.patched:
            del m.forward
        self.patched = []

    @contextmanager
    def deferring(self, key: Hashable) -> Iterator[None]:
        """Within it, a backward queues its weight gradients under ``key`` (the I action)."""
        previous, self._key = self._key, key
        try:
            yield
        finally:
            self._key = previous

    def defers(self, param: Tensor) -> bool:
        """Whether ``param``'s gradient, met in a backward now, is queued: deferring, a leaf without hooks, no
        double backward (autograd must see the gradient of a weight that is not a leaf, or has hooks)."""
        hooked = param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None)
        return self._key is not _OFF and param.is_leaf and not hooked and not torch.is_grad_enabled()

    def push(self, pending: _Pending) -> None:
        self._pending.setdefault(self._key, []).append(pending)  # the key is never _OFF: see defers

    def pending(self, key: Hashable) -> int:
        """How many weight gradients are queued under ``key``."""
        return len(self._pending.get(key, []))

    def pending_bytes(self) -> int:
        """The bytes of the storages the queued tensors hold (each storage once), under every key."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for records in self._pending.values()
            for p in records
            for t in p.tensors
        }
        return sum(storages.values())

    def run(self, key: Hashable) -> None:
        """Compute the weight gradients queued under ``key`` and add them into ``weight.grad`` (the W action)."""
        with torch.no_grad():
            for p in self._pending.pop(key, []):
                grad = p.grad_of(*p.tensors).to(p.param.dtype)
                if p.param.grad is None:
                    p.param.grad = grad
                else:
                    p.param.grad.add_(grad)
