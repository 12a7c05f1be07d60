"""A stage's layers on the 2D or 2.5D grid (``grid.py``; issue 45, part 2): which layers are converted, their
attentions, and the gradient sums after the backward.

:func:`grid_stage` takes the stage's whole (unsplit) layers and converts each one it can: its Linear and ``Conv1D``
layers to SUMMA, its LayerNorms and RMSNorms to the grid's, its dropouts to the unsplit model's masks. A run of
converted layers takes this rank's block at its first layer and gathers it whole after its last, so a stage's input
and output stay whole, alike on every rank. A layer is converted only where a trial shows it stays right: it runs on
a random input whole and converted, on every rank alike, and is put back (and :attr:`GridStage.left` says why)
where the outputs differ, the conversion raises, or a weight belongs to a module the grid cannot cut.

**Attention: the part that gathers.** An attention (one that :func:`~.head_parallel.find_attention` finds) gets its
input gathered whole from the grid, runs split by heads over all ``d q²`` ranks of the grid where its heads divide
so, else over the ``q²`` ranks of its depth layer (:class:`~.head_parallel.Heads`, so its weights are 1/(d q²) or
1/q²), and its output is cut back to the rank's block. Its q, k, v layers save only the rank's block of the gathered
input and gather it again in the backward. Every rank gets every token, so causal masks, rotary positions and
grouped keys see what the unsplit model sees, without a K/V exchange: this is the simplest design that is exact for
any attention the heads split already handles. Under 2.5D with heads split over a depth layer only, each depth layer
computes the same attention (``d`` times its arithmetic, its activations 1/q²); an attention whose heads do not
split runs whole on every rank. Its weights see every token on every rank: their gradients are complete and never
summed. A dropout inside the attention is not the unsplit model's mask.

**Gradient sums.** SUMMA reduces its weights' gradients over the grid column inside the backward; the weights that
act on the block (the norms', the SUMMA biases) saw only this rank's tokens, and under 2.5D every grid weight saw
only its depth layer's: :meth:`GridStage.sum_grads` sums them after the backward (bucketed, as
``elastic.sum_gradients`` does for sequence parallelism). Lightning-free.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_avgpipe.algorithms.elastic import sum_gradients
from lightning_avgpipe.runtime.deferred import is_conv1d
from lightning_avgpipe.runtime.sharding.grid import (
    EnterBlock,
    Grid,
    LeaveBlock,
    dropout_forward,
    norm_kind,
    split_norm,
    split_summa,
)
from lightning_avgpipe.runtime.sharding.head_parallel import (
    SPLIT,
    Heads,
    find_attention,
    linear_like,
    stand_in,
    widths,
)
from lightning_avgpipe.runtime.sharding.sequence_parallel import carry_ends, first_output, hook_runs, with_hidden

# a whole tensor gathered for an attention -> (this rank's block of it, the grid, the sequence dimension)
_WHOLE: Any = WeakIdKeyDictionary()


class GatherForAttention(torch.autograd.Function):
    """The blocks put together whole for an attention, remembered so its q, k, v layers save the block alone; the
    backward keeps this rank's block of the gradient (summed over the heads by those layers)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, grid: Grid, dim: int) -> Tensor:
        ctx.grid, ctx.dim = grid, dim
        whole = grid.assemble(x, dim)
        _WHOLE[whole] = (x.detach(), grid, dim)
        return whole

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return ctx.grid.block(g, ctx.dim), None, None


class _BlockSavedMatmul(torch.autograd.Function):
    """A q, k or v layer split by heads whose input the grid gathered: as head parallelism computes it, saving only
    this rank's block of the input (gathered again in the backward); the input's gradient summed over the heads."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, block: Tensor, w: Tensor, b: Tensor | None, held: tuple[Any, ...]) -> Tensor:
        ctx.held, ctx.bias = held, b is not None
        ctx.save_for_backward(block, w)
        transposed = held[2]
        if not transposed:
            return F.linear(x, w, b)
        y = x.reshape(-1, x.shape[-1]) @ w
        return (y if b is None else y + b).view(*x.shape[:-1], w.shape[1])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        block, w = ctx.saved_tensors
        grid, dim, transposed, group = ctx.held
        x = grid.assemble(block, dim)
        flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        if transposed:  # Conv1D: y = x @ w, w (in, out)
            grad_x, grad_w = g @ w.t(), flat_x.t() @ flat_g
        else:  # Linear: y = x @ w.T, w (out, in)
            grad_x, grad_w = g @ w, flat_g.t() @ flat_x
        grad_x = grad_x.contiguous()
        dist.all_reduce(grad_x, group=group)
        return grad_x, None, grad_w, flat_g.sum(0) if ctx.bias else None, None


def _heads_column_forward(inner: Callable[[Tensor], Tensor], transposed: bool, self: nn.Module, x: Tensor) -> Tensor:
    held = _WHOLE.get(x)
    if held is None:  # not the gathered input itself (the attention changed it first): head parallelism's own
        return inner(x)
    block, grid, dim = held
    w: Any = self.weight  # DTensors on the depth layer's flat mesh
    b: Any = self.bias
    bias = b.to_local() if b is not None else None
    group = w.device_mesh.get_group()
    return _BlockSavedMatmul.apply(x, block, w.to_local(), bias, (grid, dim, transposed, group))  # type: ignore[no-any-return]


@dataclass
class GridLayer:
    """What :func:`grid_layer` made of one layer: the weights whose gradients are summed after the backward, and its
    attentions (name -> ``"heads"``, or why it runs whole)."""

    column_summed: list[str] = field(default_factory=list)  # over the grid column and depth: norms, SUMMA biases
    depth_summed: list[str] = field(default_factory=list)  # over depth only: SUMMA weights
    attentions: dict[str, str] = field(default_factory=dict)
    # the whole sequence's length while the layer runs, which its dropouts read (grid_stage sets it per run)
    length: list[int] = field(default_factory=lambda: [0])


CONVERTED = "avgpipe_grid_layer"  # on a layer converted on the meta device: its GridLayer, or why it runs whole


@dataclass
class _Plan:
    summa: list[str]
    norms: list[tuple[str, str]]
    attentions: list[str]
    width: int  # the hidden width the layer takes (its trial's input)


def _plan(layer: nn.Module) -> _Plan | str | None:
    """What converting ``layer`` would do, why it cannot be, or None where nothing in it is for the grid."""
    if isinstance(find_attention(layer, 1), tuple):
        return "its attention is inline (the layer itself is the attention): it runs whole"
    attentions: list[tuple[str, nn.Module]] = []
    summa: list[str] = []
    norms: list[tuple[str, str]] = []
    width = 0
    for name, m in layer.named_modules():
        if any(_inside(m, a) for _, a in attentions):
            continue
        found = find_attention(m, 1)
        if isinstance(found, tuple):
            attentions.append((name, m))
            width = width or widths(m.get_submodule(found[0][0]))[0]
        elif linear_like(m):
            summa.append(name)
            width = width or widths(m)[0]
        elif norm_kind(m) and isinstance(getattr(m, "weight", None), Tensor):
            norms.append((name, str(norm_kind(m))))
            width = width or int(m.weight.shape[-1])  # type: ignore[union-attr]
    known = {*summa, *(n for n, _ in norms)}
    for name, _ in layer.named_parameters():
        owner = name.rpartition(".")[0]
        if owner not in known and not any(_inside(layer.get_submodule(owner), a) for _, a in attentions):
            what = type(layer.get_submodule(owner)).__name__
            article = "an" if what[:1].lower() in "aeiou" else "a"
            return f"its weight {name!r} is {article} {what}'s, which the grid cannot cut"
    if not summa and not norms and not attentions:
        return None
    return _Plan(summa, norms, [n for n, _ in attentions], width)


def _inside(m: nn.Module, outer: nn.Module) -> bool:
    return any(m is d for d in outer.modules())


def _convert(layer: nn.Module, grid: Grid, plan: _Plan, dim: int, length: list[int]) -> GridLayer:
    from torch.distributed.tensor.parallel import parallelize_module

    done = GridLayer(length=length)
    for name in plan.summa:
        m = layer.get_submodule(name)
        split_summa(m, grid)
        done.depth_summed.append(_join(name, "weight"))
        if m.bias is not None:
            done.column_summed.append(_join(name, "bias"))
    for name, kind in plan.norms:
        m = layer.get_submodule(name)
        split_norm(m, grid, kind)
        done.column_summed += [_join(name, n) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    regions = [layer.get_submodule(n) for n in plan.attentions]
    for name, region in zip(plan.attentions, regions, strict=True):
        conv1d = {m for m in region.modules() if is_conv1d(m)}  # by shape: not once split
        style = Heads()
        # heads over every rank of the grid where they divide so (under 2.5D each depth layer then computes its own
        # heads, not the whole attention again), else over the q² ranks of a depth layer
        spread = isinstance(find_attention(region, grid.d * grid.q * grid.q), tuple)
        parallelize_module(region, grid.flat if spread else grid.layer, style)
        done.attentions[name] = style.left or "heads"
        for m in region.modules():
            if getattr(m, SPLIT, None) == "column":
                m.forward = types.MethodType(functools.partial(_heads_column_forward, m.forward, m in conv1d), m)  # type: ignore[method-assign]
        region.register_forward_pre_hook(
            lambda _m, a, k: with_hidden(a, k, lambda x: GatherForAttention.apply(x, grid, dim)), with_kwargs=True
        )
        region.register_forward_hook(lambda _m, _a, y: first_output(y, lambda t: EnterBlock.apply(t, grid, dim)))
    for m in layer.modules():
        if type(m) is nn.Dropout and not any(_inside(m, r) for r in regions):  # the unsplit model's masks
            m.forward = types.MethodType(functools.partial(dropout_forward, grid, length, dim), m)  # type: ignore[method-assign]
    return done


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def grid_layer(
    layer: nn.Module, grid: Grid, dim: int = 1, length: list[int] | None = None, whole: Collection[int] = ()
) -> GridLayer | str | None:
    """Convert ``layer`` (whole) to take and return this rank's block where a trial on a copy of it shows it gives
    what it gave whole; else leave it untouched and return why (a string). None: nothing in it for the grid. The trial
    calls the copy on a random input of its hidden states; a layer that takes more (a carry of hidden states, cos and
    sin) is tried by parts: each module holding its Linear layers (an MLP) alone, its attention by its own trial, its
    norms by type, and what lies between them (residual adds) taken to act on each element. A layer on the meta
    device is tried on a real copy with stand-in values and cut by shapes. Collective over the grid; every rank draws
    the same input. ``length``: a one-item list holding the whole sequence's length while the layer runs (its
    dropouts' masks need it; :func:`grid_stage` keeps it). ``whole``: the ids of weights that must stay whole (tied
    to another stage's): a layer holding one is left as it is."""
    tied = next((n for n, p in layer.named_parameters() if id(p) in whole), None)
    if tied is not None:
        return f"its weight {tied!r} is tied to another stage's, which holds it whole"
    try:
        plan = _plan(layer)
    except Exception as e:  # every rank runs the same code on the same layer: they fail alike
        plan = f"it could not be planned ({type(e).__name__}: {str(e)[:120]})"
    if not isinstance(plan, _Plan):
        return plan
    p = next(iter(layer.parameters()))
    trial = stand_in(layer, grid.mesh.device_type) if p.is_meta else copy.deepcopy(layer)
    ok, why = _tried(trial, lambda m: _convert(m, grid, plan, dim, [0]), grid, plan.width, dim)
    if not ok and why.startswith(_ALONE):
        ok, why = _tried_by_parts(trial if p.is_meta else copy.deepcopy(layer), grid, plan, dim)
    flag = torch.tensor([1.0 if ok else 0.0], device=torch.device(grid.mesh.device_type) if p.is_meta else p.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=grid.whole)
    if flag.item() < 1:
        return why if not ok else "converting it failed on another rank of the grid"
    return _convert(layer, grid, plan, dim, length or [0])


_ALONE = "it cannot be called on its hidden states alone"


def _tried(
    module: nn.Module, convert: Callable[[nn.Module], Any], grid: Grid, width: int, dim: int
) -> tuple[bool, str]:
    """Whether ``module`` (a copy: the trial changes it) gives on a random input whole what it gives converted by
    ``convert`` on the rank's block, and why not."""
    p = next(iter(module.parameters()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2 * grid.parts, width, generator=g).to(p.device, p.dtype)
    module.eval()  # no dropout in the trial
    try:
        with torch.no_grad():
            want = first_output(module(x), lambda t: t)
    except Exception as e:
        return False, f"{_ALONE} ({type(e).__name__}: {str(e)[:120]})"
    try:
        with torch.no_grad():
            convert(module)
            got = first_output(module(EnterBlock.apply(x, grid, dim)), lambda t: LeaveBlock.apply(t, grid, dim))
        want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, _scale(want))))
        return ok, "converting it changed its output"
    except Exception as e:
        return False, f"its conversion failed ({type(e).__name__}: {str(e)[:160]})"


def _tried_by_parts(layer: nn.Module, grid: Grid, plan: _Plan, dim: int) -> tuple[bool, str]:
    """The trial of a layer that takes more than its hidden states (``layer``: a copy), by the modules holding its
    Linear layers, each alone (:func:`grid_layer`)."""
    owners = sorted({name.rpartition(".")[0] for name in plan.summa})
    if "" in owners:
        return False, f"{_ALONE}, and its Linear layers are its own children (no part to try alone)"
    for owner in owners:
        part = layer.get_submodule(owner)
        summa = [name for name, m in part.named_modules() if linear_like(m)]

        def convert(m: nn.Module, summa: list[str] = summa) -> None:
            for name in summa:
                split_summa(m.get_submodule(name), grid)

        ok, why = _tried(part, convert, grid, widths(part.get_submodule(summa[0]))[0], dim)
        if not ok:
            return False, f"its part {owner!r}: {why}"
    return True, ""


def _scale(t: Tensor) -> float:
    return float(t.abs().max()) if t.numel() and t.is_floating_point() else 1.0


@dataclass
class GridStage:
    """The layers of one rank's stages converted to the grid (:func:`grid_stage`), by their index among its layers;
    ``left``: the others that had something for the grid, and why they run whole."""

    layers: dict[int, GridLayer]
    count: int  # the rank's layers
    grid: Grid
    left: dict[int, str] = field(default_factory=dict)
    # per stage of the rank: whether its first and last layers are converted (what its boundaries may carry)
    ends: list[tuple[bool, bool]] = field(default_factory=list)
    # per stage of the rank: whether its input and output cross their boundaries as this rank's block (:meth:`carry`)
    carried: list[list[bool]] = field(default_factory=list)

    def carry(self, topology: Any, device: torch.device) -> tuple[bool, bool]:
        """Whether this rank's stage takes its input and sends its output as this rank's block: where the layers on
        both sides of a boundary are converted, each rank sends its block to its counterpart in the next stage (the
        same place on the next stage's grid), with no gather and no broadcast (``sequence_parallel.carry_ends``)."""
        return carry_ends(self.ends, self.carried, topology, device)

    def sum_grads(self, copies: Sequence[nn.Module]) -> None:
        """After the backward: sum the gradients of the weights that saw only this rank's tokens, over the grid
        column (the norms', the SUMMA biases), and under 2.5D of every grid weight over depth, in every copy of the
        stage's layers (``copies``: the layers, then each replica's, each in the same order)."""

        def params(names: str) -> list[nn.Parameter]:
            return [
                copies[r * self.count + i].get_parameter(name)
                for r in range(len(copies) // self.count)
                for i, done in self.layers.items()
                for name in getattr(done, names)
            ]

        column = params("column_summed")
        sum_gradients(column, self.grid.column)
        if self.grid.d > 1:
            sum_gradients(column + params("depth_summed"), self.grid.depth)


def grid_stage(
    chunks: Sequence[Sequence[nn.Module]], mesh: Any, dim: int = 1, whole: Collection[int] = ()
) -> GridStage:
    """Convert each layer of this rank's stages (``chunks``: each stage's whole, unsplit layers, in the rank's order)
    to the grid ``mesh`` (:func:`~.grid.grid_mesh`) where :func:`grid_layer` can, and enter this rank's block before
    the first layer of each run of converted layers within a stage and gather it whole after its last: a stage takes
    and returns whole tensors, alike on every rank of the grid. ``dim``: the activations' sequence dimension. A layer
    converted on the meta device already (``CONVERTED``, ``tensor_parallel.grid_on_meta``) is taken as it is.
    ``whole``: as :func:`grid_layer`'s. Collective over the grid. After each backward, :meth:`GridStage.sum_grads`
    must run."""
    grid = Grid.of(mesh)
    out = GridStage({}, sum(len(c) for c in chunks), grid)

    def entering(x: Tensor, cells: list[list[int]], carried: bool) -> Tensor:
        """A run's input cut to the block; a stage's input that crossed its boundary as the block, kept."""
        for cell in cells:  # the whole sequence's length, for the run's dropouts
            cell[0] = (int(x.shape[dim]) * (grid.parts if carried else 1)) if x.dim() > dim else 0
        return x if carried else EnterBlock.apply(x, grid, dim)  # type: ignore[no-any-return]

    def leaving(y: Any, carried: bool) -> Any:
        return y if carried else first_output(y, lambda t: LeaveBlock.apply(t, grid, dim))

    start = 0
    for layers in chunks:
        carried = [False, False]  # set by carry() once the neighbouring stages are known
        out.carried.append(carried)
        flags = []
        for i, layer in enumerate(layers):
            done = vars(layer).pop(CONVERTED, None) or grid_layer(layer, grid, dim, whole=whole)
            if isinstance(done, GridLayer):
                out.layers[start + i] = done
            elif done is not None:
                out.left[start + i] = done
            flags.append(isinstance(done, GridLayer))
        runs = {  # each run's first layer -> the length cells of the run's layers (their dropouts read them)
            f: [out.layers[start + e].length for e in range(f, len(layers)) if all(flags[f : e + 1])]
            for f in range(len(layers))
            if flags[f] and (f == 0 or not flags[f - 1])
        }

        def enter_run(x: Tensor, f: int, c: bool, cells: dict[int, list[list[int]]] = runs) -> Tensor:
            return entering(x, cells[f], c)

        out.ends.append(hook_runs(layers, flags, carried, enter_run, leaving))
        start += len(layers)
    return out
