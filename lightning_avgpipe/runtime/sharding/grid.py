"""2D (SUMMA) and 2.5D tensor parallelism: the grid, its collectives and its layers (issue 45, part 2).

On ``d x q x q`` ranks (``d = 1``: 2D) rank ``(k, i, j)`` holds the block of a layer's activations ``[batch,
sequence, hidden]`` whose sequence part is ``k * q + i`` of ``d * q`` equal parts (depth outer, then the grid row)
and whose hidden part is ``j`` of ``q``: 1/(d q²) of every activation. A weight ``A`` of ``Y = X A`` is cut into
``q x q`` blocks, rank ``(k, i, j)`` holding ``A_ij`` (the same on every depth layer ``k``): 1/q² of the weights.

- :class:`Summa` (a Linear or Hugging Face ``Conv1D``): for ``t = 0..q-1`` block ``X_it`` is broadcast along the
  grid row ``i`` and ``A_tj`` along the grid column ``j``, and ``Y_ij += X_it A_tj``. The backward is the same
  pattern transposed: ``dX_it = sum_j dY_ij A_tj^T`` reduced along the row to ``(i, t)``, ``dA_tj = sum_i X_it^T
  dY_ij`` reduced along the column to ``(t, j)``. Only the rank's own ``X_ij`` is saved for the backward. The
  weight is a ``DTensor`` on the grid (the input features cut over the grid rows, the output ones over the grid
  columns, replicated over depth), so ``full_tensor()`` and the checkpoint see the unsplit weight; the layer's
  widths (``in_features``/``out_features``/``nf``) become the block's. Its bias is block ``j`` of the outputs.
- a LayerNorm or RMSNorm reduces its statistics over the hidden dimension along the grid row (:class:`RowSum`, an
  all-reduce whose backward all-reduces); its weight and bias are block ``j``.
- a dropout draws the unsplit model's whole mask (``bernoulli_`` on the same generator, as ``F.dropout`` does)
  and keeps the rank's block: the masks are the unsplit model's.
- elementwise ops (GELU, the residual adds) run on the blocks as they are.

A weight that acts on the block (a norm's, a SUMMA bias) gets its gradient from the rank's tokens only: it is
summed over the grid column (and over depth); a SUMMA weight's is reduced over the grid column inside the backward
and summed over depth after it. Those sums after the backward are ``grid_stage.GridStage.sum_grads``'s. Where a
layer is converted, and its attention, is ``grid_stage.py``'s. Lightning-free.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_avgpipe.runtime.deferred import is_conv1d
from lightning_avgpipe.runtime.sharding.head_parallel import summed, widths
from lightning_avgpipe.runtime.sharding.zero import ALL_GATHER

DIMS = ("depth", "row", "col")  # the grid mesh's dimensions: depth k, grid row i, grid column j
BROADCAST = dist.broadcast  # SUMMA's collectives (a test replaces them to show the comparison is real)
REDUCE = dist.reduce
GRID = "avgpipe_grid"  # on a converted module: "summa" or "norm"
# id(mesh) -> (mesh, the grid's flat mesh, one depth layer's flat mesh, this rank's Grid of it)
_FLAT: dict[int, tuple[Any, Any, Any, Grid]] = {}


def grid_mesh(tensor_mesh: Any, q: int, depth: int = 1) -> Any:
    """The ``(depth, q, q)`` grid (dimensions named ``depth``, ``row``, ``col``) over the ranks of ``tensor_mesh``, a
    named 1D ``DeviceMesh`` of ``depth * q * q`` ranks (the tensor dimension of the job's mesh); collective: every
    rank of the job calls it, each with its own tensor mesh. ``depth=1`` is 2D."""
    if q < 1 or depth < 1 or tensor_mesh.ndim != 1 or tensor_mesh.size() != depth * q * q:
        raise ValueError(
            f"grid_mesh(q={q}, depth={depth}) needs a 1D tensor mesh of depth * q * q = {depth * q * q} ranks, but it "
            f"has shape {tuple(tensor_mesh.shape)}: make tensor_parallel_size = depth * q * q, or pick q and depth so."
        )
    if not tensor_mesh.mesh_dim_names:
        raise ValueError(
            "grid_mesh's tensor_mesh has no dimension name: make it with init_device_mesh(..., mesh_dim_names=...), "
            "as the job's mesh names its tensor dimension."
        )
    return tensor_mesh._unflatten(0, (depth, q, q), DIMS)


def release_grids() -> list[Any]:
    """The grid meshes :meth:`Grid.of` has seen and the flat meshes it made of them, forgotten here: at exit their
    process groups are dropped with the others' (``shards.release_meshes``), so no gloo thread outlives them."""
    meshes = [m for entry in _FLAT.values() for m in entry[:3]]
    for *_, grid in _FLAT.values():  # a converted layer alive at exit holds its grid, and the grid its groups
        grid.row = grid.column = grid.depth = grid.whole = grid.layer = grid.flat = None
    _FLAT.clear()
    return meshes


@dataclass(eq=False)
class Grid:
    """A rank's place on a grid mesh and its groups: ``row`` (the ranks ``(k, i, *)``), ``column`` (``(k, *, j)``),
    ``depth`` (``(*, i, j)``), ``whole`` (every rank of the grid, in ``(k, i, j)`` order), ``flat`` (a 1D mesh over
    them: an attention's heads are split over it where they divide by ``d q²``) and ``layer`` (a 1D mesh over this
    depth layer's ``q²`` ranks, in ``(i, j)`` order: the heads are split over it where they divide only by ``q²``)."""

    mesh: Any
    q: int
    d: int
    k: int
    i: int
    j: int
    row: Any
    column: Any
    depth: Any
    whole: Any
    layer: Any
    flat: Any

    @classmethod
    def of(cls, mesh: Any) -> Grid:
        """Collective over the grid the first time (it makes the flat groups)."""
        if tuple(mesh.mesh_dim_names or ()) != DIMS:
            raise ValueError(
                f"mesh has dimensions {mesh.mesh_dim_names}, not {DIMS}: make it with grid_mesh(tensor_mesh, q, depth)"
            )
        if id(mesh) not in _FLAT or _FLAT[id(mesh)][0] is not mesh:
            whole, layer = mesh._flatten("avgpipe_grid"), mesh["row", "col"]._flatten("avgpipe_grid_layer")
            d, q, _ = mesh.shape
            k, i, j = mesh.get_coordinate()
            groups = [mesh.get_group(n) for n in DIMS]
            grid = cls(mesh, q, d, k, i, j, groups[2], groups[1], groups[0], whole.get_group(), layer, whole)
            _FLAT[id(mesh)] = (mesh, whole, layer, grid)
        return _FLAT[id(mesh)][3]

    def __deepcopy__(self, memo: dict[int, Any]) -> Grid:
        return self  # its groups are the job's: a copy of a converted layer (a replica) shares them

    @property
    def parts(self) -> int:
        """How many parts the sequence is cut into (``d * q``)."""
        return self.d * self.q

    def block(self, x: Tensor, dim: int) -> Tensor:
        """This rank's block of ``x`` (whole, alike on every rank): sequence part ``k * q + i`` along ``dim``, hidden
        part ``j`` along the last dimension."""
        if x.dim() < 3:
            raise ValueError(
                f"tensor_parallel_mode='{'2.5d' if self.d > 1 else '2d'}' cuts a layer's activations (batch, "
                f"sequence, hidden) into blocks over the sequence and the hidden dimension, but this one has shape "
                f"{tuple(x.shape)}: use tensor_parallel_mode='1d' for a model without a sequence."
            )
        if x.shape[dim] % self.parts or x.shape[-1] % self.q or dim % x.dim() == x.dim() - 1:
            raise ValueError(
                f"the grid (depth={self.d}, q={self.q}) cuts dimension {dim} of the activations (the sequence) into "
                f"{self.parts} parts and the last (the hidden one) into {self.q}, but they have shape "
                f"{tuple(x.shape)}: make the sequence length a multiple of depth * q and the width one of q."
            )
        part = x.chunk(self.parts, dim)[self.k * self.q + self.i]
        return part.chunk(self.q, -1)[self.j].contiguous()

    def assemble(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's block of ``x`` put together whole (an all-gather over the grid)."""
        x = x.contiguous()
        out = x.new_empty((self.parts * self.q * x.shape[0], *x.shape[1:]))
        ALL_GATHER(out, x, group=self.whole)
        out = out.view(self.parts * self.q, *x.shape)
        rows = [torch.cat(list(out[p * self.q : (p + 1) * self.q]), -1) for p in range(self.parts)]
        return torch.cat(rows, dim)


class EnterBlock(torch.autograd.Function):
    """Whole (alike on every rank) to this rank's block; the backward puts the gradient's blocks together."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, grid: Grid, dim: int) -> Tensor:
        ctx.grid, ctx.dim = grid, dim
        return grid.block(x, dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return ctx.grid.assemble(g, ctx.dim), None, None


class LeaveBlock(torch.autograd.Function):
    """The blocks put together whole (what follows computes alike on every rank); the backward keeps this rank's
    block of the gradient (whole and alike on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, grid: Grid, dim: int) -> Tensor:
        ctx.grid, ctx.dim = grid, dim
        return grid.assemble(x, dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return ctx.grid.block(g, ctx.dim), None, None


class RowSum(torch.autograd.Function):
    """A partial statistic summed along the grid row (over the hidden blocks); the backward sums the gradients so,
    each rank having used the sum for its own block."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return summed(x, group)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return summed(g, ctx.group), None


def _bcast(x: Tensor, mine: bool, group: Any, src: int) -> Tensor:
    """``x`` from the rank ``src`` of ``group`` (its own where ``mine``, an empty one of its shape elsewhere)."""
    buf = x.contiguous() if mine else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BROADCAST(buf, group=group, group_src=src)
    return buf


def _reduce(x: Tensor, group: Any, dst: int) -> Tensor:
    x = x.contiguous()
    REDUCE(x, group=group, group_dst=dst)
    return x


class Summa(torch.autograd.Function):
    """``Y_ij = sum_t X_it A_tj`` on the grid (the module docstring): ``x`` this rank's block of the input
    ``[..., in/q]``, ``a`` its block ``A_ij`` ``[in/q, out/q]``; returns ``Y_ij`` ``[..., out/q]``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, grid: Grid) -> Tensor:
        ctx.grid = grid
        ctx.save_for_backward(x, a)
        flat = x.reshape(-1, x.shape[-1])
        y = flat.new_zeros(flat.shape[0], a.shape[1])
        for t in range(grid.q):
            xt = _bcast(flat, grid.j == t, grid.row, t)  # X_it along the grid row
            at = _bcast(a, grid.i == t, grid.column, t)  # A_tj along the grid column
            y += xt @ at
        return y.view(*x.shape[:-1], a.shape[1])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, a = ctx.saved_tensors
        grid: Grid = ctx.grid
        flat, gy = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        grad_x = grad_a = None
        for t in range(grid.q):
            at = _bcast(a, grid.i == t, grid.column, t)
            part = _reduce(gy @ at.t(), grid.row, t)  # dX_it: summed over j at (i, t)
            if grid.j == t:
                grad_x = part
            xt = _bcast(flat, grid.j == t, grid.row, t)
            part = _reduce(xt.t() @ gy, grid.column, t)  # dA_tj: summed over i at (t, j)
            if grid.i == t:
                grad_a = part
        assert grad_x is not None and grad_a is not None
        return grad_x.view(x.shape), grad_a, None


def summa_forward(grid: Grid, transposed: bool, self: nn.Module, x: Tensor) -> Tensor:
    """A Linear's or (``transposed``) a Conv1D's forward on the grid (``self.weight``, ``self.bias``: their blocks
    as DTensors)."""
    weight: Any = self.weight  # DTensors
    bias: Any = self.bias
    w = weight.to_local()
    a = w if transposed else w.t()
    if x.shape[-1] != a.shape[0]:
        raise ValueError(
            f"a layer on the grid takes its block of {a.shape[0]} input features, but got shape {tuple(x.shape)}: its "
            "input must be the rank's block (grid_stage enters it), not the whole activation."
        )
    y = Summa.apply(x, a, grid)
    return y if bias is None else y + bias.to_local()


def split_summa(m: nn.Module, grid: Grid) -> None:
    """``m`` (a Linear or a Conv1D) cut into ``q x q`` blocks on the grid (replicated over depth), its bias into the
    grid column's block of the outputs; its widths set to the block's."""
    from torch.distributed.tensor import Replicate, Shard

    inputs, outputs = widths(m)
    if inputs % grid.q or outputs % grid.q:
        raise ValueError(f"its {inputs} x {outputs} weight does not cut into {grid.q} x {grid.q} blocks")
    transposed = is_conv1d(m)  # Conv1D's weight is (in, out), a Linear's (out, in)
    _distribute(m, "weight", grid, (Replicate(), Shard(0 if transposed else 1), Shard(1 if transposed else 0)))
    if getattr(m, "bias", None) is not None:
        _distribute(m, "bias", grid, (Replicate(), Replicate(), Shard(0)))
    if transposed:
        m.nf = outputs // grid.q  # type: ignore[assignment]
    else:
        m.in_features, m.out_features = inputs // grid.q, outputs // grid.q  # type: ignore[assignment]
    m.forward = types.MethodType(functools.partial(summa_forward, grid, transposed), m)  # type: ignore[method-assign]
    setattr(m, GRID, "summa")


def _distribute(m: nn.Module, name: str, grid: Grid, placements: tuple[Any, ...]) -> None:
    from torch.distributed.tensor import distribute_tensor

    p = getattr(m, name)
    d = distribute_tensor(p.detach(), grid.mesh, list(placements), src_data_rank=None)
    m.register_parameter(name, nn.Parameter(d, requires_grad=p.requires_grad))


def norm_kind(m: nn.Module) -> str | None:
    """``"layer"`` or ``"rms"`` where ``m`` is a norm over the last dimension that the grid can split
    (``nn.LayerNorm``, ``nn.RMSNorm``, or a class named ``*LayerNorm``/``*RMSNorm`` with a ``weight`` and an
    ``eps`` or ``variance_epsilon``, as Hugging Face's LlamaRMSNorm), else None."""
    name = type(m).__name__
    if isinstance(m, nn.LayerNorm) or (name.endswith("LayerNorm") and _has_eps(m)):
        kind = "layer"
    elif isinstance(m, nn.RMSNorm) or (name.endswith("RMSNorm") and _has_eps(m)):
        kind = "rms"
    else:
        return None
    shape = getattr(m, "normalized_shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        return None  # over more than the hidden dimension
    return kind


def _has_eps(m: nn.Module) -> bool:
    return isinstance(getattr(m, "weight", None), Tensor) and (hasattr(m, "eps") or hasattr(m, "variance_epsilon"))


def norm_forward(grid: Grid, kind: str, self: nn.Module, x: Tensor) -> Tensor:
    """A LayerNorm's or RMSNorm's forward on the rank's block: the statistics summed along the grid row."""
    w, b = getattr(self, "weight", None), getattr(self, "bias", None)
    eps = getattr(self, "eps", getattr(self, "variance_epsilon", None))
    width = x.shape[-1] * grid.q
    if kind == "layer":
        mean = RowSum.apply(x.sum(-1, keepdim=True), grid.row) / width
        centred = x - mean
        var = RowSum.apply((centred * centred).sum(-1, keepdim=True), grid.row) / width
        y = centred * torch.rsqrt(var + (1e-5 if eps is None else eps))
    else:  # Hugging Face's arithmetic: in float32, back to the input's dtype before the weight
        h = x.float()
        ms = RowSum.apply((h * h).sum(-1, keepdim=True), grid.row) / width
        y = (h * torch.rsqrt(ms + (torch.finfo(x.dtype).eps if eps is None else eps))).to(x.dtype)
    if w is not None:
        y = y * w.to_local()
    return y if b is None else y + b.to_local()


def split_norm(m: nn.Module, grid: Grid, kind: str) -> None:
    """``m``'s weight and bias cut into the grid column's block (replicated over the grid rows and depth)."""
    from torch.distributed.tensor import Replicate, Shard

    for name in ("weight", "bias"):
        p = getattr(m, name, None)
        if p is not None:
            if p.shape[-1] % grid.q:
                raise ValueError(f"its {name} of width {p.shape[-1]} does not cut into {grid.q} blocks")
            _distribute(m, name, grid, (Replicate(), Replicate(), Shard(0)))
    m.forward = types.MethodType(functools.partial(norm_forward, grid, kind), m)  # type: ignore[method-assign]
    setattr(m, GRID, "norm")


def dropout_forward(grid: Grid, length: list[int], dim: int, self: nn.Dropout, x: Tensor) -> Tensor:
    """``nn.Dropout`` in a converted layer: on a block (its sequence 1/(d q) of the whole one, ``length[0]``), the
    whole mask drawn as the unsplit model draws it and the rank's block kept; elsewhere ``F.dropout`` itself."""
    if not self.training or self.p == 0 or x.dim() <= dim or x.shape[dim] * grid.parts != length[0]:
        return F.dropout(x, self.p, self.training, self.inplace)
    shape = list(x.shape)
    shape[dim] *= grid.parts
    shape[-1] *= grid.q
    mask = x.new_empty(shape).bernoulli_(1 - self.p)
    return x * (grid.block(mask, dim) * (1 / (1 - self.p)))
