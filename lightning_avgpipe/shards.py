"""Tensor-parallel shards seen as plain tensors (docs/parallelism.md#tensor-parallelism).

Under tensor parallelism a stage's parameters are ``DTensor``s: each rank of the tensor-parallel group holds a shard
(``Shard`` placement) or a whole copy (``Replicate``). The averaging, the gradient all-reduce over the data dimension,
clipping and the checkpoint's optimizer state all work on each rank's local tensor: the D ranks that hold the same
(stage, shard) average the same slice. A norm over a stage sums every shard once and every whole copy once, so a
replicated tensor's square is weighted 1/T before the sum over the T ranks (:func:`norm_weight`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

try:  # torch >= 2.4 (the supported versions); DTensor is absent only from builds without torch.distributed
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a ``DTensor`` (sharing its storage), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def locals_(tensors: Iterable[Tensor]) -> list[Tensor]:
    return [local(t) for t in tensors]


def set_local(param: Tensor, data: Tensor) -> None:
    """Make ``data`` this rank's part of ``param`` (the same parameter object: optimizers and modules keep it)."""
    if is_dtensor(param):
        param._local_tensor.data = data  # type: ignore[attr-defined]  # the shard the DTensor wraps
    else:
        param.data = data


FSDP_DIMS = ("data", None)  # the mesh dimensions FSDP shards over (the job mesh's, or an unnamed stage group's)


def _sharded_dims(t: Tensor) -> tuple[int, bool]:
    """Into how many parts ``t`` is split within the tensor-parallel group (the product of the sizes of the mesh
    dimensions it is a ``Shard`` on, FSDP's aside: ``"tensor"`` under 1D; the grid's ``row`` and ``col``, or a flat
    mesh of the grid's ranks, under 2D and 2.5D), and whether FSDP splits it over the stage group."""
    if not is_dtensor(t):
        return 1, False
    mesh: Any = t.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    parts, by_fsdp = 1, False
    for i, (name, p) in enumerate(zip(names, t.placements)):  # type: ignore[attr-defined]
        if not (p.is_replicate() or p.is_partial()):  # a Shard, or a _StridedShard (a fused qkv split by heads)
            if name in FSDP_DIMS:
                by_fsdp = True
            else:
                parts *= mesh.size(i)
    return parts, by_fsdp


def norm_weight(t: Tensor, tensor_parallel_size: int, shards: int = 1) -> float:
    """The weight of ``t``'s local squared norm in a sum over the tensor-parallel group (and, ``shards`` > 1, over
    the stage group of an FSDP-sharded stage): one over how many of the group's ranks hold the same part of it (1 for
    a tensor split over the whole group, 1/T for one every rank holds whole, 1/d for a grid's block copied over d
    depth layers)."""
    parts, by_fsdp = _sharded_dims(t)
    weight = parts / tensor_parallel_size if tensor_parallel_size > 1 else 1.0
    return weight if by_fsdp or shards == 1 else weight / shards


def same_data(t: Any) -> tuple[Any, ...] | None:
    """What two tensors over the same bytes share (a weight reachable under two names): their storage, offset,
    shape, strides and dtype; ``None`` for a tensor shard (a ``DTensor``), a meta tensor or anything else."""
    if not isinstance(t, Tensor) or is_dtensor(t) or t.is_meta:
        return None
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def full(t: Tensor) -> Tensor:
    """The whole tensor (collective over the tensor-parallel group for a ``DTensor``); ``t`` itself otherwise."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def to_local_tree(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with every ``DTensor`` replaced by this rank's local part (what a
    rank's own checkpoint entry keeps; :func:`like` puts it back)."""
    if is_dtensor(obj):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local_tree(v) for v in obj)
    return obj


def like(value: Any, param: Tensor, *, whole: bool = False) -> Any:
    """``value`` shaped as ``param``'s tensor-parallel layout: for a ``DTensor`` parameter, a plain tensor becomes a
    ``DTensor`` on its mesh and placements, from this rank's local part (``whole=False``) or from the whole tensor
    (``whole=True``: sliced locally, every rank holds the whole). Anything else is returned as it is."""
    if not is_dtensor(param) or not isinstance(value, Tensor) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
    if whole:
        if tuple(value.shape) != tuple(param.shape):
            return value  # a scalar state (Adam's step) or another shape: not a tensor laid out as the weight
        return distribute_tensor(value.to(param.device), mesh, placements, src_data_rank=None)
    if tuple(value.shape) != tuple(param.to_local().shape):  # type: ignore[attr-defined]
        return value
    return DTensor.from_local(
        value.to(param.device), mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def empty_like_split(param: Tensor, dtype: torch.dtype) -> Tensor:
    """An uninitialized ``DTensor`` of ``param``'s mesh, placements and shape, of ``dtype``: only the local shard is
    allocated (a target a checkpoint reader fills with this rank's part)."""
    local = param.to_local()  # type: ignore[attr-defined]
    return DTensor.from_local(
        torch.empty(local.shape, dtype=dtype, device=local.device),
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def release_meshes(meshes: Iterable[Any]) -> None:
    """Drop the process groups that ``meshes`` (and their root meshes) keep in their registries.

    torch's DTensor caches keep meshes alive, and a mesh keeps its groups: without this they outlive
    ``destroy_process_group`` at exit and their threads run into the interpreter's finalization. The replicas'
    copies (``copy.deepcopy``) have meshes of their own, so every parameter's mesh is passed.
    """
    for mesh in meshes:
        for m in (mesh, getattr(mesh, "_root_mesh", None)):
            registry = getattr(m, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
