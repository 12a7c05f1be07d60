"""Manipulation of micro-batches: split a batch along its first dimension, merge outputs back, and sign shapes.

Also the nested-structure helpers the rest of the package and its benchmarks share: :func:`map_tensors`,
:func:`to_cpu`, :func:`detached` and :func:`tensors`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def batch_size(batch: Any) -> int:
    """Size of the first dimension of the first tensor found in ``batch``."""
    for leaf in tensors(batch):
        if leaf.dim() == 0:
            raise ValueError("Cannot split a batch that holds a 0-dim tensor; batch tensors need a batch dimension.")
        return int(leaf.shape[0])
    raise TypeError(f"The batch holds no tensor (got {type(batch).__name__}); cannot split it into micro-batches.")


def split(batch: Any, chunks: int) -> list[Any]:
    """Split every tensor of ``batch`` into ``chunks`` micro-batches along dim 0; other leaves are shared.

    Sizes differ by at most one when the batch does not divide evenly (``torch.tensor_split``).
    """
    size = batch_size(batch)
    if chunks < 1 or chunks > size:
        raise ValueError(
            f"Cannot split a batch of {size} samples into num_microbatches={chunks}; "
            f"use between 1 and {size} micro-batches, or a larger batch_size in your DataLoader."
        )
    return [_select(batch, i, chunks, size) for i in range(chunks)]


def _select(obj: Any, index: int, chunks: int, size: int) -> Any:
    def chunk(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != size:
            raise ValueError(
                f"Batch tensors disagree on the batch dimension ({tuple(t.shape)} vs {size} samples); every "
                "tensor in a pipelined batch needs the samples on dim 0."
            )
        return torch.tensor_split(t, chunks)[index]

    return map_tensors(obj, chunk)


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``obj`` with every tensor in it replaced by ``fn(tensor)``.

    Mappings (of their own type where it can be rebuilt, see :func:`_like`), namedtuples, lists and tuples are
    rebuilt around the results; any other leaf is kept as it is.
    """
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _like(obj, {k: map_tensors(v, fn) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU: what may leave the step, the device or the process."""
    return map_tensors(obj, lambda t: t.detach().cpu())


def detached(obj: Any, requires_grad: bool = False) -> Any:
    """``obj`` with every tensor detached from its graph (sharing its storage).

    With ``requires_grad``, the floating-point ones become leaves that record gradients: the input of a layer
    whose backward is run on its own.
    """
    return map_tensors(obj, lambda t: t.detach().requires_grad_(requires_grad and t.is_floating_point()))


def merge(outputs: Sequence[Any]) -> Any:
    """Inverse of :func:`split` for step outputs: concatenate tensors with a batch dim, keep structure.

    Scalars (0-dim tensors) cannot be concatenated and are averaged; anything else comes back as a list.
    """
    first = outputs[0]
    if first is None:
        return None
    if isinstance(first, Tensor):
        if first.dim() == 0:
            return torch.stack(list(outputs)).float().mean()
        return torch.cat(list(outputs))
    if isinstance(first, Mapping):
        return _like(first, {k: merge([o[k] for o in outputs]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge([o[i] for o in outputs]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(merge([o[i] for o in outputs]) for i in range(len(first)))
    return list(outputs)


def _like(mapping: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``mapping``'s type holding ``items`` (dict subclasses keep extras like a default factory)."""
    if isinstance(mapping, dict):
        out = mapping.copy()
        out.clear()
        out.update(items)
        return out
    try:
        return type(mapping)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def signature(obj: Any) -> tuple[Any, ...]:
    """A hashable description of the shapes and dtypes of every tensor in ``obj`` (the metadata cache key)."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors(obj))


def tensors(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj`` (mappings, lists and tuples searched depth first), in order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [leaf for v in obj.values() for leaf in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [leaf for v in obj for leaf in tensors(v)]
    return []


def split_step(batch: Any, m: int, full_batch: int | None) -> tuple[list[Any], list[float]]:
    """Split a step's ``batch`` into ``m`` micro-batches and their shares of it, by the rules a user can rely on.

    ``full_batch``: in training, the largest batch seen (``None``: evaluation, where any size splits). A training
    batch must split into ``m`` equal parts, except an epoch's shorter last batch, which may split unevenly (losses
    are weighted by size) or, below ``m`` samples, into parts of one sample.
    """
    size = batch_size(batch)
    if size == 0:
        raise ValueError("The batch is empty (0 samples on dim 0); a pipeline step needs at least one sample.")
    full = full_batch is not None and size == full_batch
    if size < m:
        if full:
            raise ValueError(
                f"The batch has {size} samples but num_microbatches={m}; use a DataLoader batch_size of at least "
                f"{m} or fewer micro-batches."
            )
        m = size  # a short last batch of an epoch: one sample per micro-batch
    elif full and size % m:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"A batch of {size} samples does not split into num_microbatches={m} equal micro-batches; use a "
            f"DataLoader batch_size divisible by {m} (e.g. {size + m - size % m}) or num_microbatches in "
            f"{divisors}. (A shorter last batch of an epoch may split unevenly: losses are weighted by size.)"
        )
    micro = split(batch, m)
    return micro, [batch_size(mb) / size for mb in micro]
