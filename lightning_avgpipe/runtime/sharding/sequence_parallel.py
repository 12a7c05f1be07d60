"""Sequence parallelism under 1D tensor parallelism (Megatron's, Korthikanti et al. 2022; issue 45, part 1).

Under 1D tensor parallelism every activation outside the split matmuls is whole on each of the T shards: the norms,
the dropouts, the residual stream. With sequence parallelism a layer holds only its shard's 1/T of the sequence
there. A split region gathers the sequence where it starts and scatters it where it ends:

- the input of a column-wise layer, or of an attention split by heads, is all-gathered along the sequence
  (:class:`~.head_parallel.GatherSequence`; its backward reduce-scatters, where 1D all-reduces);
- the output of a row-wise layer is reduce-scattered (:class:`~.head_parallel.ScatterSequence`; its backward
  all-gathers), where 1D all-reduces;
- an attention left whole (it mixes the tokens, so it needs them all) gathers its input whole and keeps its shard of
  the output;
- a weight that acts on the shard (a norm's, a row-wise layer's bias) gets a gradient from the shard's tokens only,
  so its gradient is summed over the group as it is made.

A layer made so (:func:`sequence_layer`) takes and returns its shard of the sequence; :class:`~.head_parallel.
EnterSequence` and :class:`~.head_parallel.LeaveSequence` cut a whole tensor into the shard and put it back where a
run of such layers starts and ends. Lightning-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_avgpipe.runtime.sharding.head_parallel import (
    GATHERED,
    SEQUENCE,
    SPLIT,
    EnterSequence,
    GatherSequence,
    LeaveSequence,
    find_attention,
)
from lightning_avgpipe.shards import local


@dataclass
class SequenceLayer:
    """What :func:`sequence_layer` changed on one layer, so :meth:`undo` can put it back."""

    handles: list[Any] = field(default_factory=list)
    marked: list[tuple[nn.Module, str]] = field(default_factory=list)
    summed: list[str] = field(default_factory=list)  # the names of the weights whose gradients are summed
    whole: list[str] = field(default_factory=list)  # the attentions left whole, gathered around

    def undo(self) -> None:
        for h in self.handles:
            h.remove()
        for m, name in self.marked:
            if hasattr(m, name):
                delattr(m, name)
        self.handles.clear()
        self.marked.clear()


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> Any:
    """``(args, kwargs)`` with the hidden states (the first positional input, or ``hidden_states``) through ``fn``."""
    if args and isinstance(args[0], Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return args, kwargs


def _first_output(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return (fn(output[0]), *output[1:])
    return output


def _sum_over(group: Any) -> Callable[[Tensor], Tensor]:
    def summed(g: Tensor) -> Tensor:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=group)
        return g

    return summed


def sequence_layer(layer: nn.Module, group: Any, dim: int = 1) -> SequenceLayer:
    """Make ``layer``, already split by the tensor-parallel plan over ``group``, take and return this shard's part
    of the sequence (dimension ``dim`` of its activations), as the module docstring says."""
    done = SequenceLayer()

    def mark(m: nn.Module, name: str, value: Any) -> None:
        setattr(m, name, value)
        done.marked.append((m, name))

    attentions: list[nn.Module] = []
    for name, m in layer.named_modules():
        if any(m is a or _inside(m, a) for a in attentions):
            continue
        found = find_attention(m, 1)
        if not isinstance(found, tuple):
            continue
        attentions.append(m)
        columns, proj, _ = found
        if all(getattr(getattr(m, c), SPLIT, None) == "column" for c in columns):  # split by heads
            done.handles.append(
                m.register_forward_pre_hook(
                    lambda _m, a, k: _hidden(a, k, lambda x: GatherSequence.apply(x, group, dim)), with_kwargs=True
                )
            )
            for c in columns:
                mark(getattr(m, c), GATHERED, True)
            mark(getattr(m, proj), SEQUENCE, dim)
        else:  # left whole: it needs every token
            done.whole.append(name)
            done.handles.append(
                m.register_forward_pre_hook(
                    lambda _m, a, k: _hidden(a, k, lambda x: LeaveSequence.apply(x, group, dim)), with_kwargs=True
                )
            )
            done.handles.append(
                m.register_forward_hook(
                    lambda _m, _a, out: _first_output(out, lambda y: EnterSequence.apply(y, group, dim))
                )
            )
    for m in layer.modules():
        if getattr(m, SPLIT, None) in ("column", "row") and not any(_inside(m, a) for a in attentions):
            mark(m, SEQUENCE, dim)
    for name, p in layer.named_parameters():
        owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
        if is_traceable_wrapper_subclass(p) or any(owner is a or _inside(owner, a) for a in attentions):
            continue  # a shard (its own group sums it), or a weight used on the whole sequence alike on every shard
        if p.requires_grad:
            done.handles.append(p.register_hook(_sum_over(group)))
            done.summed.append(name)
    return done


def _inside(m: nn.Module, outer: nn.Module) -> bool:
    return m is not outer and any(m is d for d in outer.modules())


def enter(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """A whole tensor (alike on every shard) cut to this shard's part of the sequence."""
    return EnterSequence.apply(x, group, dim)  # type: ignore[no-any-return]


def leave(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """This shard's part of the sequence gathered whole."""
    return LeaveSequence.apply(x, group, dim)  # type: ignore[no-any-return]


def activation_bytes_saved(fn: Callable[[], Tensor]) -> int:
    """Bytes autograd saves for the backward while ``fn`` runs (each storage once): a layer's activation memory."""
    seen: set[int] = set()
    total = 0

    def pack(saved: Tensor) -> Tensor:
        nonlocal total
        t = local(saved)  # a DTensor's local shard is what memory holds
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total
