"""Attention split by heads, and Hugging Face's ``Conv1D`` split at all (docs/parallelism.md#tensor-parallelism).

Megatron's split, run on local shards: a column-wise layer keeps whole heads' rows of its output (a fused ``qkv``
keeps the same heads of q, k and v: ``_StridedShard(split_factor=3)``, so ``DTensor.full_tensor()`` and the
checkpoint see the unsplit weight), the output projection keeps the matching input columns, and two autograd
functions carry the all-reduces: the input of a column-wise layer is summed over the group in the backward, the
output of a row-wise one in the forward. The layers' own widths and the attention's head counts are set to the
shard's (``nf``, ``out_features``, ``n_head``, ``num_heads``, ``split_size``, ``embed_dim``, ...).

An attention is split only when it is proven to stay right: :class:`Heads` runs the module on a random input before
and after the split, on every shard alike, and puts everything back (and says why) when the outputs differ or the
split one raises. nanoGPT's attention, which reads its widths from its input (``C // self.n_head``), is left whole
that way; one that reads them from its attributes, as Hugging Face's GPT-2 does, is split. The trial feeds hidden
states alone: a module whose other inputs carry one tensor per head (T5's position bias from an earlier layer, ALiBi
slopes passed in) is not tried with them, and needs a plan of its own.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

from lightning_avgpipe.runtime.deferred import is_conv1d
from lightning_avgpipe.runtime.sharding.zero import ALL_GATHER, REDUCE_SCATTER

HEAD_COUNTS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head", "n_query_groups")
WIDTHS = ("embed_dim", "n_embd", "split_size", "all_head_size", "inner_dim", "hidden_size", "d_model")
TRIAL_SHAPE = (2, 5)  # (batch, sequence) of the random input an attention is tried on
_LAYER_WIDTHS = ("nf", "in_features", "out_features")  # a split layer's own widths, put back with it


def linear_like(m: nn.Module) -> bool:
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward) or is_conv1d(m)


def widths(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D."""
    w: Tensor = m.weight  # type: ignore[assignment]
    return (int(w.shape[0]), int(w.shape[1])) if is_conv1d(m) else (int(w.shape[1]), int(w.shape[0]))


def summed(x: Tensor, group: Any) -> Tensor:
    """A copy of ``x`` summed over ``group`` (an all-reduce)."""
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over the tensor group (the input of a column-wise layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return summed(g, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """The partial outputs of a row-wise layer summed over the tensor group; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        return summed(x, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


def _along(x: Tensor, dim: int, group: Any, gather: bool) -> Tensor:
    """``x``'s shards along ``dim`` put together over the group (``gather``), or ``x`` summed over the group and
    this rank's shard of the sum along ``dim`` kept: the collectives of sequence parallelism, on ``dim`` moved to 0."""
    T = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()
    if gather:
        out = front.new_empty((front.shape[0] * T, *front.shape[1:]))
        ALL_GATHER(out, front, group=group)
    else:
        if front.shape[0] % T:
            raise ValueError(_uneven(x, dim, T))
        out = front.new_empty((front.shape[0] // T, *front.shape[1:]))
        REDUCE_SCATTER(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _uneven(x: Tensor, dim: int, T: int) -> str:
    return (
        f"sequence_parallel=True cuts dimension {dim} of the activations (the sequence) over the {T} shards of the "
        f"tensor group, but it is {x.shape[dim]} long (shape {tuple(x.shape)}): make the sequence length a multiple "
        f"of tensor_parallel_size={T}, or set sequence_parallel=False."
    )


def shard_of(x: Tensor, dim: int, group: Any) -> Tensor:
    """This rank's part of ``x`` (whole on every rank) along ``dim``: equal parts, in rank order."""
    T = dist.get_world_size(group)
    if x.shape[dim] % T:
        raise ValueError(_uneven(x, dim, T))
    return x.chunk(T, dim=dim)[dist.get_rank(group)].contiguous()


class EnterSequence(torch.autograd.Function):
    """Whole (alike on every shard) to this shard's part of the sequence; the backward gathers the parts."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        if x.dim() < 3:
            raise ValueError(
                f"sequence_parallel=True cuts dimension {dim} of a layer's activations (batch, sequence, hidden) over "
                f"the tensor group, but this one has shape {tuple(x.shape)}: set sequence_parallel=False for a "
                "model without a sequence."
            )
        return shard_of(x, dim, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return _along(g, ctx.dim, ctx.group, gather=True), None, None


class LeaveSequence(torch.autograd.Function):
    """The sequence's parts gathered whole (what follows computes alike on every shard); the backward keeps this
    shard's part of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        whole = _along(x, dim, group, gather=True)
        _GATHERED[whole] = (x.detach(), group, dim)  # a column-wise layer reading it saves the part instead
        return whole

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return shard_of(g, ctx.dim, ctx.group), None, None


# a tensor LeaveSequence gathered -> (this shard's part of it, the group, the dimension), while the whole one lives
_GATHERED: Any = WeakIdKeyDictionary()


class _PartSavedMatmul(torch.autograd.Function):
    """A column-wise layer under 1D whose input was gathered from the shards of the sequence (an attention under
    sequence parallelism): as 1D computes it, but saving this shard's part of the input, gathered again in the
    backward for the weight's gradient; the input's gradient summed over the group, as 1D does."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, part: Tensor, w: Tensor, b: Tensor | None, group: Any, dim: int, transposed: bool
    ) -> Tensor:
        ctx.group, ctx.dim, ctx.transposed, ctx.bias = group, dim, transposed, b is not None
        ctx.save_for_backward(part, w)
        return _matmul(x, w, b, transposed)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        part, w = ctx.saved_tensors
        grad_x, grad_w, grad_b = _matmul_grads(_along(part, ctx.dim, ctx.group, gather=True), w, g, ctx)
        grad_x = grad_x.contiguous()
        dist.all_reduce(grad_x, group=ctx.group)
        return grad_x, None, grad_w, grad_b, None, None, None


def _matmul_grads(x: Tensor, w: Tensor, g: Tensor, ctx: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of ``_matmul(x, w, b, ctx.transposed)`` given the output's ``g``: input, weight, bias."""
    flat_x, flat_g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    if ctx.transposed:  # Conv1D: y = x @ w, w (in, out)
        grad_x, grad_w = g @ w.t(), flat_x.t() @ flat_g
    else:  # Linear: y = x @ w.T, w (out, in)
        grad_x, grad_w = g @ w, flat_g.t() @ flat_x
    return grad_x, grad_w, flat_g.sum(0) if ctx.bias else None


class ScatterSequence(torch.autograd.Function):
    """A row-wise layer's partial outputs summed over the group, this shard's part of the sequence kept (a
    reduce-scatter, where 1D all-reduces); the backward gathers the gradient's parts."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _along(x, dim, group, gather=False)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return _along(g, ctx.dim, ctx.group, gather=True), None, None


SPLIT = "avgpipe_split"  # on a layer split here: "column" or "row"; on an attention split by heads: "heads"
IN_FEATURES = "avgpipe_in_features"  # on a column-wise layer: the width of its input (whole on every shard)
SEQUENCE = "avgpipe_sequence_dim"  # on a split layer: the sequence dimension its input or output is cut along


def _matmul(x: Tensor, w: Tensor, b: Tensor | None, transposed: bool) -> Tensor:
    if not transposed:
        return F.linear(x, w, b)
    flat = x.reshape(-1, x.shape[-1])  # Conv1D's own arithmetic
    y = flat @ w if b is None else torch.addmm(b, flat, w)
    return y.view(*x.shape[:-1], w.shape[1])


class _GatheredMatmul(torch.autograd.Function):
    """A column-wise layer under sequence parallelism: the sequence gathered from the shards, multiplied, and only
    this shard's part of the input saved; the backward gathers it again for the weight's gradient and reduce-scatters
    the input's (Megatron's: what the layer keeps for its backward is 1/T of the sequence, not all of it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, group: Any, dim: int, transposed: bool) -> Tensor:
        ctx.group, ctx.dim, ctx.transposed, ctx.bias = group, dim, transposed, b is not None
        ctx.save_for_backward(x, w)
        return _matmul(_along(x, dim, group, gather=True), w, b, transposed)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        grad_x, grad_w, grad_b = _matmul_grads(_along(x, ctx.dim, ctx.group, gather=True), w, g, ctx)
        return _along(grad_x, ctx.dim, ctx.group, gather=False), grad_w, grad_b, None, None, None


def _column_forward(transposed: bool, self: nn.Module, x: Tensor) -> Tensor:
    w, b = self.weight, self.bias  # DTensors
    bias = b.to_local() if b is not None else None  # type: ignore[union-attr,operator]
    group = w.device_mesh.get_group()  # type: ignore[union-attr,operator]
    dim = getattr(self, SEQUENCE, None)
    if dim is not None:  # sequence parallelism: this shard's part of the sequence in, the whole one used
        return _GatheredMatmul.apply(x, w.to_local(), bias, group, dim, transposed)  # type: ignore[union-attr,operator,no-any-return]
    gathered = _GATHERED.get(x)
    if gathered is not None:  # gathered from the sequence's shards for this region: save the part
        part, group, dim = gathered
        return _PartSavedMatmul.apply(x, part, w.to_local(), bias, group, dim, transposed)  # type: ignore[union-attr,operator,no-any-return]
    return _matmul(_CopyToGroup.apply(x, group), w.to_local(), bias, transposed)  # type: ignore[union-attr,operator]


def _row_forward(transposed: bool, self: nn.Module, x: Tensor) -> Tensor:
    w, b = self.weight, self.bias  # DTensors
    group = w.device_mesh.get_group()  # type: ignore[union-attr,operator]
    y = _matmul(x, w.to_local(), None, transposed)  # type: ignore[union-attr,operator]
    dim = getattr(self, SEQUENCE, None)
    if dim is None:
        y = _ReduceFromGroup.apply(y, group)
        return y if b is None else y + b.to_local()  # type: ignore[union-attr,operator]
    y = ScatterSequence.apply(y, group, dim)  # this shard's part of the sequence: the bias's gradient is a part
    return y if b is None else y + _CopyToGroup.apply(b.to_local(), group)  # type: ignore[union-attr,operator]


def split_column(m: nn.Module, mesh: Any, chunks: int = 1) -> None:
    """``m``'s output features over ``mesh``: each shard keeps its part of each of ``chunks`` equal blocks (q, k, v
    of a fused projection), its bias alike; ``out_features``/``nf`` become the shard's."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    transposed = is_conv1d(m)
    setattr(m, IN_FEATURES, widths(m)[0])
    out_dim = 1 if transposed else 0
    place = (lambda d: _StridedShard(d, split_factor=chunks)) if chunks > 1 else Shard
    _distribute(m, "weight", distribute_tensor, mesh, place(out_dim))
    if m.bias is not None:
        _distribute(m, "bias", distribute_tensor, mesh, place(0))
    T = mesh.size()
    if transposed:
        m.nf //= T
    else:
        m.out_features //= T
    m.forward = types.MethodType(functools.partial(_column_forward, transposed), m)  # type: ignore[method-assign]
    setattr(m, SPLIT, "column")


def split_row(m: nn.Module, mesh: Any) -> None:
    """``m``'s input features over ``mesh`` (its input is the shard's part), the outputs summed; the bias whole."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    transposed = is_conv1d(m)
    _distribute(m, "weight", distribute_tensor, mesh, Shard(0 if transposed else 1))
    if m.bias is not None:
        _distribute(m, "bias", distribute_tensor, mesh, Replicate())
    if not transposed:
        m.in_features //= mesh.size()
    m.forward = types.MethodType(functools.partial(_row_forward, transposed), m)  # type: ignore[method-assign]
    setattr(m, SPLIT, "row")


def _distribute(m: nn.Module, name: str, distribute_tensor: Any, mesh: Any, placement: Any) -> None:
    p = getattr(m, name)
    d = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)
    m.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))


def find_attention(m: nn.Module, T: int) -> tuple[list[str], str, int] | str | None:
    """``m``'s attention layers: (the column-wise names, the output projection's name, how many blocks the column
    ones fuse), a reason it cannot be split over ``T`` shards, or None where ``m`` is no attention (it needs a head
    count attribute, a fused ``qkv`` (d -> 3d) or ``q``, ``k``, ``v`` children, and a projection back to d)."""
    config = getattr(m, "config", None)  # a Hugging Face attention may keep its head count in its config alone
    heads = next(
        (getattr(o, a) for o in (m, config) for a in HEAD_COUNTS if isinstance(getattr(o, a, None), int)), None
    )
    if not heads:
        return None
    layers = [(n, c) for n, c in m.named_children() if linear_like(c)]
    for i, (name, c) in enumerate(layers):
        d, out = widths(c)
        if out == 3 * d:  # fused q, k, v
            proj = next((n for n, p in layers[i + 1 :] if widths(p) == (d, d)), None)
            if proj is not None:
                return _divides(heads, heads, T, m) or ([name], proj, 3)
        group = layers[i : i + 3]
        if len(group) == 3 and all(widths(p)[0] == d for _, p in group):
            q_out, k_out, v_out = (widths(p)[1] for _, p in group)
            head_dim = q_out // heads
            proj = next((n for n, p in layers[i + 3 :] if widths(p) == (q_out, d)), None)
            if proj is not None and q_out % heads == 0 and k_out == v_out and k_out % head_dim == 0:
                return _divides(heads, k_out // head_dim, T, m) or ([n for n, _ in group], proj, 1)
    return None


def _divides(heads: int, kv_heads: int, T: int, m: nn.Module) -> str | None:
    if heads % T or kv_heads % T:
        return f"its {heads} heads ({kv_heads} for keys and values) do not divide over {T} shards"
    return None


class Column(ParallelStyle):
    """Column-wise for a Linear or a Hugging Face ``Conv1D`` (torch's ``ColwiseParallel`` takes no Conv1D)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        split_column(module, device_mesh)
        return module


class Row(ParallelStyle):
    """Row-wise for a Linear or a Hugging Face ``Conv1D``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        split_row(module, device_mesh)
        return module


class Heads(ParallelStyle):
    """A ``ParallelStyle`` for an attention module (found by :func:`find_attention`): q, k, v column-wise by whole
    heads, the output projection row-wise, the module's head counts and widths set to the shard's; tried first, and
    left whole where that changes its output (``self.left`` then says why)."""

    def __init__(self) -> None:
        self.left: str | None = None

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        mesh = device_mesh
        found = find_attention(module, mesh.size())
        if not isinstance(found, tuple):
            self.left = found or "no attention found (a head count attribute, q/k/v or a fused qkv, a projection)"
            return module
        p = next(iter(module.parameters()))
        # built without memory: tried on a real copy of this one module with stand-in values, then split by shapes
        ok, why = _trial(stand_in(module, mesh.device_type) if p.is_meta else module, mesh, *found)
        if ok and p.is_meta:
            _split(module, mesh, *found)
        if not ok:
            self.left = why
        return module


def _agreed(ok: bool, device: torch.device, mesh: Any) -> bool:
    """Whether the trial passed on every shard of ``mesh`` (they run the same code on the same input)."""
    agreed = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return bool(agreed.item() >= 1)


def _split(module: nn.Module, mesh: Any, columns: list[str], proj: str, chunks: int) -> None:
    """q, k, v column-wise by whole heads, the projection row-wise, the head counts and widths set to a shard's."""
    T = mesh.size()
    sizes = {widths(getattr(module, n))[1] for n in columns} | {widths(getattr(module, columns[0]))[1] // chunks}
    attrs = {
        a: getattr(module, a) for a in (*HEAD_COUNTS, *KV_HEAD_COUNTS, *WIDTHS) if type(getattr(module, a, None)) is int
    }
    for n in columns:
        split_column(getattr(module, n), mesh, chunks)
    split_row(getattr(module, proj), mesh)
    setattr(module, SPLIT, "heads")
    for a, v in attrs.items():
        if a in HEAD_COUNTS or a in KV_HEAD_COUNTS or v in sizes:
            setattr(module, a, v // T)


def _trial(module: nn.Module, mesh: Any, columns: list[str], proj: str, chunks: int) -> tuple[bool, str]:
    """Split ``module`` (:func:`_split`) if its output on a random input stays the same on every shard of ``mesh``;
    else leave it as it was. Returns whether it was split, and why not."""
    p = next(iter(module.parameters()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*TRIAL_SHAPE, widths(getattr(module, columns[0]))[0], generator=g).to(p.device, p.dtype)
    modes = {m: m.training for m in module.modules()}  # each submodule's own mode, put back after the trial
    module.eval()
    layers = [getattr(module, n) for n in [*columns, proj]]
    saved = [
        (layer, dict(layer._parameters), {a: vars(layer)[a] for a in _LAYER_WIDTHS if a in vars(layer)})
        for layer in layers
    ]
    attrs = {
        a: getattr(module, a) for a in (*HEAD_COUNTS, *KV_HEAD_COUNTS, *WIDTHS) if type(getattr(module, a, None)) is int
    }
    split = False
    try:
        with torch.no_grad(), _exact_matmuls():
            want = _first(module(x))
            split = True
            _split(module, mesh, columns, proj, chunks)
            got = _first(module(x))
        tol = max(1e-4, 8 * torch.finfo(got.dtype).eps) if got.is_floating_point() else 0.0
        scale = float(want.abs().max()) if want.numel() and want.is_floating_point() else 1.0
        ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=tol, atol=tol * max(scale, 1e-3)))
        why = "splitting its heads changed its output"
    except Exception as e:  # every shard runs the same code on the same input: they fail alike
        which = "split" if split else "on hidden states alone"
        ok, why = False, f"its forward failed {which} ({type(e).__name__}: {str(e)[:120]})"
    for m, mode in modes.items():
        m.training = mode
    agreed = _agreed(ok, x.device, mesh)
    if not agreed:
        for layer, params, kept in saved:
            layer._parameters.update(params)
            vars(layer).pop("forward", None)
            vars(layer).pop(SPLIT, None)
            vars(layer).update(kept)  # nf, in_features, out_features as they were
        for a, v in attrs.items():
            setattr(module, a, v)
        vars(module).pop(SPLIT, None)
    return agreed, why


def stand_in(module: nn.Module, device: str) -> nn.Module:
    """A real copy of a meta ``module`` for the trial: floating tensors drawn from a generator of its own (the
    model's generator untouched), others ones (a causal mask that masks nothing: the outputs stay finite)."""
    real = copy.deepcopy(module).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for t in [*real.parameters(), *real.buffers()]:
            if t.is_floating_point():
                t.normal_(0, 0.02, generator=g)
            else:
                t.fill_(1)
    return real


@contextmanager
def _exact_matmuls() -> Iterator[None]:
    """No TF32 in the trial's matmuls (CUDA), so a tolerance of the dtype's own rounding holds."""
    cuda = torch.backends.cuda.matmul
    before = cuda.allow_tf32
    cuda.allow_tf32 = False
    try:
        yield
    finally:
        cuda.allow_tf32 = before


def _first(y: Any) -> Tensor:
    """The first tensor of a module's output (an attention may return (output, weights))."""
    while isinstance(y, (tuple, list)):
        y = y[0]
    if not isinstance(y, Tensor):
        raise TypeError(f"the output is a {type(y).__name__}, not a tensor")
    return y
