"""Sequence parallelism under 1D tensor parallelism (Megatron's, Korthikanti et al. 2022; issue 45, part 1).

Under 1D tensor parallelism every activation outside the split matmuls is whole on each of the T shards: the norms,
the dropouts, the residual stream. With sequence parallelism a layer holds only its shard's 1/T of the sequence
there. A split region gathers the sequence where it starts and scatters it where it ends:

- the input of a column-wise layer is all-gathered along the sequence, only the shard's part saved for the backward
  (``head_parallel._GatheredMatmul``; its backward gathers it again and reduce-scatters the input's gradient, where
  1D all-reduces), and the output of a row-wise layer reduce-scattered
  (:class:`~.head_parallel.ScatterSequence`; its backward all-gathers), where 1D all-reduces;
- an attention (split by heads or left whole) gets the whole sequence and runs as under 1D, its output cut back to
  the shard: whatever it computes around its projections (a block with its attention inline adds the residual
  inside) sees every token. Megatron's reduce-scatter at the output projection would save one all-reduce's half;
- a weight that acts on the shard (a norm's, a row-wise layer's bias) gets a gradient from the shard's tokens only,
  so its gradient is summed over the group after the backward (:meth:`SequenceStage.sum_grads`).

A layer made so (:func:`sequence_layer`) takes and returns its shard of the sequence; :class:`~.head_parallel.
EnterSequence` and :class:`~.head_parallel.LeaveSequence` cut a whole tensor into the shard and put it back where a
run of such layers starts and ends. Lightning-free.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_avgpipe.algorithms.elastic import sum_gradients
from lightning_avgpipe.runtime.sharding.head_parallel import (
    IN_FEATURES,
    SEQUENCE,
    SPLIT,
    EnterSequence,
    LeaveSequence,
    find_attention,
    shard_of,
)
from lightning_avgpipe.shards import local


@dataclass
class SequenceLayer:
    """What :func:`sequence_layer` made of one layer: the weights whose gradients come from the shard's tokens only,
    and the regions that get the whole sequence."""

    summed: list[str] = field(default_factory=list)  # the names of the weights whose gradients are summed
    gathered: list[str] = field(default_factory=list)  # the attentions, run on the whole sequence


def with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Tensor], Tensor]) -> Any:
    """``(args, kwargs)`` with the hidden states through ``fn``: the first positional input, or the first item of
    it where it is a tuple (a carry such as (hidden states, cos, sin)), or ``hidden_states``."""
    if args and isinstance(args[0], Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if args and isinstance(args[0], tuple) and args[0] and isinstance(args[0][0], Tensor):
        return ((fn(args[0][0]), *args[0][1:]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return args, kwargs


def first_output(output: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(output, Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return (fn(output[0]), *output[1:])
    return output


def _regions(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``layer`` that a split region lies in: an attention (split by heads, or found and
    left whole), or a module with a split layer among its children (an MLP, an attention split by a plan)."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in layer.named_modules():
        if any(m is r or _inside(m, r) for _, r in out):
            continue
        if _attention(m) or any(getattr(c, SPLIT, None) in ("column", "row") for c in m.children()):
            while isinstance(m, (nn.ModuleDict, nn.ModuleList)):  # never called itself: its caller is the region
                name = name.rpartition(".")[0]
                m = layer.get_submodule(name)
            out = [(n, r) for n, r in out if not _inside(r, m)]
            out.append((name, m))
    return out


def _split_children(region: nn.Module) -> list[nn.Module]:
    return [m for m in region.modules() if getattr(m, SPLIT, None) in ("column", "row")]


def _agree(ok: bool, group: Any) -> bool:
    flag = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() >= 1)


@torch.no_grad()
def _scatters_right(region: nn.Module, group: Any, dim: int) -> bool:
    """Whether ``region``, its column-wise layers gathering the sequence and its row-wise ones scattering it (marked
    so), gives the same as under 1D on a random input: not where it reads the sequence length from its input (an
    attention reshaping by it), adds its input inside, or needs more inputs than one tensor. Collective over
    ``group``; every shard draws the same input."""
    splits = _split_children(region)
    first = next((m for m in region.modules() if getattr(m, SPLIT, None) == "column"), None)
    if first is None or any(getattr(m, SPLIT, None) == "heads" for m in region.modules()):
        return False
    weight = local(first.weight)  # type: ignore[arg-type]
    width = int(getattr(first, IN_FEATURES))
    T = dist.get_world_size(group)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2 * T, width, generator=g).to(weight.device, weight.dtype)
    modes = {m: m.training for m in region.modules()}
    region.eval()  # no dropout in the trial
    try:
        for m in splits:
            setattr(m, SEQUENCE, None)
        want = region(x)
        for m in splits:
            setattr(m, SEQUENCE, dim)
        got = LeaveSequence.apply(region(shard_of(x, dim, group)), group, dim)
        ok = isinstance(want, Tensor) and got.shape == want.shape and bool(torch.allclose(got, want, 1e-4, 1e-5))
    except Exception:  # every shard runs the same code on the same input: they fail alike
        ok = False
    finally:
        for m, mode in modes.items():
            m.train(mode)
    return _agree(ok, group)


def sequence_layer(layer: nn.Module, group: Any, dim: int = 1) -> SequenceLayer | None:
    """Make ``layer``, already split by the tensor-parallel plan over ``group``, take and return this shard's part
    of the sequence (dimension ``dim`` of its activations), as the module docstring says; ``None`` (nothing changed)
    where no split region lies in it (an embedding, a final norm or head: left as under 1D). Each region (an
    attention, an MLP) gathers the sequence at its split layers and scatters it after, where a trial on a random input
    shows that gives what 1D does (:func:`_scatters_right`); any other gets the whole sequence, runs as under 1D and
    is cut back to the shard after. The weights whose gradients come from the shard's tokens only are named in
    ``summed`` (:meth:`SequenceStage.sum_grads` sums them)."""
    regions = _regions(layer)
    if not regions or any(r is layer for _, r in regions):
        return None  # nothing split, or the layer is one region (its attention inline): it runs as under 1D
    done = SequenceLayer()
    for name, region in regions:
        if _scatters_right(region, group, dim):  # its split layers keep their marks
            continue
        for m in _split_children(region):
            vars(m).pop(SEQUENCE, None)
        done.gathered.append(name)
        region.register_forward_pre_hook(
            lambda _m, a, k: with_hidden(a, k, lambda x: LeaveSequence.apply(x, group, dim)), with_kwargs=True
        )
        region.register_forward_hook(
            lambda _m, _a, out: first_output(out, lambda y: EnterSequence.apply(y, group, dim))
        )
    inner = [r for _, r in regions]
    for name, p in layer.named_parameters():
        owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
        if getattr(owner, SPLIT, None) or any(owner is r or _inside(owner, r) for r in inner):
            continue  # a split layer's (a row-wise bias sums itself), or used on the whole sequence alike everywhere
        if p.requires_grad:  # a plain weight, or FSDP's shard of one over the data dimension
            done.summed.append(name)
    return done


@dataclass
class SequenceStage:
    """The layers of one rank's stages that run on a shard of the sequence (:func:`sequence_stage`), by their index
    among its layers."""

    layers: dict[int, SequenceLayer]
    count: int  # the rank's layers
    group: Any
    # per stage of the rank: whether its first and its last layer run on a shard (what its boundaries may carry)
    ends: list[tuple[bool, bool]] = field(default_factory=list)
    # per stage of the rank: whether its input and its output cross their boundaries as this shard's part of the
    # sequence (:meth:`carry`), read by the hooks as each stage runs
    carried: list[list[bool]] = field(default_factory=list)

    def carry(self, topology: Any, device: torch.device) -> tuple[bool, bool]:
        """Whether this rank's stage takes its input and sends its output as this shard's part of the sequence:
        where the layers on both sides of a boundary run on a shard, each shard sends its part to its counterpart in
        the next stage (``tensor_parallel.TensorParallelLink``), with no gather and no broadcast; the stage then
        neither enters the shard at its first layer nor leaves it after its last. Collective over the pipeline's
        stages (``topology``'s ``pipeline_group``); never with one stage, or several stages per rank (each boundary
        whole there)."""
        return carry_ends(self.ends, self.carried, topology, device)

    def sum_grads(self, copies: Sequence[nn.Module]) -> None:
        """Sum the shard-run weights' gradients over the tensor group, in every copy of the stage's layers
        (``copies``: the layers, then each replica's, each in the same order)."""
        params = [
            copies[k * self.count + i].get_parameter(name)
            for k in range(len(copies) // self.count)
            for i, done in self.layers.items()
            for name in done.summed
        ]
        sum_gradients(params, self.group)


def carry_ends(
    ends: Sequence[tuple[bool, bool]], carried: list[list[bool]], topology: Any, device: torch.device
) -> tuple[bool, bool]:
    """Whether the boundaries before and after this rank's one stage carry a part of the activations (``ends``: per
    stage of the rank, whether its first and last layers run on a part), set in ``carried[0]``: where the layers on
    both sides of a boundary do. Collective over the pipeline's stages (``topology``'s ``pipeline_group``); never
    with one stage, or several stages per rank."""
    stage, stages, group = topology.stage, topology.num_stages, topology.pipeline_group
    if stages == 1 or len(ends) != 1:
        return False, False
    mine = torch.tensor([int(ends[0][0]), int(ends[0][1])], device=device)
    seen = [torch.empty_like(mine) for _ in range(stages)]
    dist.all_gather(seen, mine, group=group)
    into = stage > 0 and bool(seen[stage - 1][1]) and bool(seen[stage][0])
    out = stage < stages - 1 and bool(seen[stage][1]) and bool(seen[stage + 1][0])
    carried[0][:] = [into, out]
    return into, out


def sequence_stage(chunks: Sequence[Sequence[nn.Module]], group: Any, dim: int = 1) -> SequenceStage:
    """Each layer of this rank's stages (``chunks``: each stage's layers, in the rank's order) made to run on a shard
    of the sequence where :func:`sequence_layer` can, and each run of consecutive such layers within a stage entered
    before its first layer and left after its last: a stage takes and returns whole tensors, as under 1D."""
    out = SequenceStage({}, sum(len(c) for c in chunks), group)
    length: list[int] = [0]  # the whole sequence's length, as the run being entered has it
    T = dist.get_world_size(group)

    def entering(x: Tensor, carried: bool) -> Tensor:
        """A run's input cut to the shard; a stage's input that crossed its boundary as the shard, kept."""
        length[0] = (int(x.shape[dim]) * (T if carried else 1)) if x.dim() > dim else 0
        return x if carried else enter(x, group, dim)

    def leaving(y: Any, carried: bool) -> Any:
        return y if carried else first_output(y, lambda t: leave(t, group, dim))

    start = 0
    for layers in chunks:
        carried = [False, False]  # set by carry() once the neighbouring stages are known
        out.carried.append(carried)
        flags = []
        for i, layer in enumerate(layers):
            done = sequence_layer(layer, group, dim)
            if done is not None:
                out.layers[start + i] = done
                for m in layer.modules():
                    if type(m) is nn.Dropout:  # its masks: the unsplit model's, each shard drawing the whole one
                        m.forward = types.MethodType(functools.partial(_dropout, length, group, dim), m)  # type: ignore[method-assign]
            flags.append(done is not None)
        out.ends.append(hook_runs(layers, flags, carried, lambda x, _first, c: entering(x, c), leaving))
        start += len(layers)
    return out


def hook_runs(
    layers: Sequence[nn.Module],
    flags: Sequence[bool],
    carried: list[bool],
    entering: Callable[[Tensor, int, bool], Tensor],
    leaving: Callable[[Any, bool], Any],
) -> tuple[bool, bool]:
    """Hook each run of consecutive ``layers`` whose ``flags`` are set, in one stage: ``entering(x, i, c)`` on the
    hidden states before the run's first layer ``i``, ``leaving(y, c)`` on the first output after its last; ``c``
    is ``carried[0]`` (``carried[1]``) read as the stage runs where that layer is the stage's first (last), else
    False. Returns whether the stage's first and last layers are flagged (what its boundaries may carry)."""
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        if flags[i] and (i == 0 or not flags[i - 1]):
            layer.register_forward_pre_hook(
                lambda _m, a, k, i=i: with_hidden(a, k, lambda x: entering(x, i, i == 0 and carried[0])),
                with_kwargs=True,
            )
        if flags[i] and (i == last or not flags[i + 1]):
            layer.register_forward_hook(lambda _m, _a, y, e=i == last: leaving(y, e and carried[1]))
    return bool(flags) and flags[0], bool(flags) and flags[-1]


def _dropout(length: list[int], group: Any, dim: int, self: nn.Dropout, x: Tensor) -> Tensor:
    """``nn.Dropout`` on a layer that may hold a shard of the sequence: where ``x`` is the shard (its length 1/T of
    the whole), the whole mask is drawn, as the unsplit model draws it (``bernoulli_`` on the same generator, as
    ``F.dropout`` does), and this shard's part of it kept; elsewhere (the whole sequence) ``F.dropout`` itself."""
    T = dist.get_world_size(group)
    if not self.training or self.p == 0 or x.dim() <= dim or x.shape[dim] * T != length[0]:
        return F.dropout(x, self.p, self.training, self.inplace)
    shape = list(x.shape)
    shape[dim] *= T
    mask = x.new_empty(shape).bernoulli_(1 - self.p)
    return x * (shard_of(mask, dim, group) * (1 / (1 - self.p)))


def _attention(m: nn.Module) -> bool:
    """Whether ``m`` is an attention: split by heads, or one that :func:`find_attention` finds (left whole)."""
    return getattr(m, SPLIT, None) == "heads" or isinstance(find_attention(m, 1), tuple)


def _inside(m: nn.Module, outer: nn.Module) -> bool:
    return m is not outer and any(m is d for d in outer.modules())


def enter(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """A whole tensor (alike on every shard) cut to this shard's part of the sequence."""
    return EnterSequence.apply(x, group, dim)  # type: ignore[no-any-return]


def leave(x: Tensor, group: Any, dim: int = 1) -> Tensor:
    """This shard's part of the sequence gathered whole."""
    return LeaveSequence.apply(x, group, dim)  # type: ignore[no-any-return]
