"""A stage sharded over its stage group with FSDP2: ZeRO-2 and ZeRO-3 (docs/parallelism.md#sharded-stages).

With ``averaging="exact"`` the D pipeline groups train one model, so the D ranks that hold a stage (and tensor
shard) need not each keep all of it. Each of the stage's layers goes through ``torch.distributed.fsdp.fully_shard``
over those D ranks (a one-dimensional mesh; with tensor parallelism the ``data`` dimension of the job's mesh, so a
weight is a two-dimensional ``DTensor``), and each of the rank's stages (a chunk under ``interleaved`` and ``zbv``)
gets a root module of its own, with no weights, through which its stage function runs. Between steps every weight,
gradient and optimizer state is a 1/D shard.

What the three knobs FSDP2 gives do through one step, by ``sharding_strategy`` and ``reduce_gradients``:

==================  ===========================  ==============================  =================================
level               weights in the step          each micro-batch's gradients    peak within the step
==================  ===========================  ==============================  =================================
SHARD_GRAD_OP       gathered once, kept          reduce-scattered into a shard   W + W/D grads + 2W/D state + 1 grad
FULL_SHARD          gathered for each use, freed reduce-scattered into a shard   W/D + one layer + grads as above
either, per_step    gathered once, kept          accumulated whole, reduced once like ZeRO-1 (W + W + 2W/D)
==================  ===========================  ==============================  =================================

At the end of every step :meth:`StageSharding.finish` runs FSDP's post-backward for every layer with the gradients'
reduction on: under ``per_step`` (and under a schedule that defers the weight gradients, ``zbh1``, ``zbv``, whose W
comes after the micro-batch's backward) that is the one reduce-scatter; otherwise it only frees the gathered weights.
torch's own pipeline schedules do the same (``PipelineStage.perform_reduce_grad``).

A model built in ``configure_model`` (on the meta device) is sharded there, at the cut, before any of it is real
(:func:`shard_on_meta`): the replay of its build (``runtime/build/materialize.py``) hands each weight's whole value to
a function that keeps this rank's shard, so setup holds the rank's shard and one whole tensor, not its whole stage.
Under tensor parallelism (T > 1) that shard is the rank's dim-0 chunk of its tensor shard (what FSDP2 shards of a
DTensor), 1/(D x T) of a split weight. A model built whole (in ``__init__``) is sharded by :class:`StageSharding`.

A weight two layers of one rank use (a tied embedding and head on the same rank) stays out of FSDP, whole on every
rank of the group; its gradient is averaged over the group after the step, as ``averaging="exact"`` averages every
gradient without sharding. Pure PyTorch: no Lightning import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.algorithms.elastic import average_gradients
from lightning_avgpipe.runtime.build.materialize import Shard
from lightning_avgpipe.shards import is_dtensor


def data_mesh(topology: Any, device: torch.device) -> Any:
    """The one-dimensional mesh of this rank's stage group: the job mesh's ``data`` dimension under tensor
    parallelism (FSDP needs both dimensions of a two-dimensional weight from one mesh), else one over the group."""
    if topology.data_mesh is not None:
        return topology.data_mesh
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(topology.stage_group, device.type, mesh=list(topology.stage_ranks))


class _ChunkRoot(nn.Module):
    """The FSDP root of one of a rank's stages: holds its layers and runs its stage function, so that FSDP's root
    (which never frees its weights after the forward) owns no weight and every layer is freed as its level says."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.fn: Callable[..., Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        assert self.fn is not None
        return self.fn(*args, **kwargs)


def _strided_tensor_shard(p: Tensor) -> bool:
    """Whether ``p`` is a tensor-parallel shard (a DTensor on a one-dimensional mesh, not yet FSDP's: FSDP's own
    placement over data may be strided too) with a strided placement."""
    placements: Sequence[Any] = getattr(p, "placements", ())
    return len(placements) == 1 and type(placements[0]).__name__ == "_StridedShard"


def shared_within(chunks: Sequence[Sequence[nn.Module]]) -> list[nn.Parameter]:
    """Parameters FSDP leaves whole over the stage group, in first-seen order: those more than one of the rank's
    layers reach (a tie held by one rank), and tensor shards that are strided (a fused qkv split by heads keeps the
    same heads of q, k and v: ``_StridedShard``), which FSDP2 would shard into a nested strided placement whose
    ``full_tensor()`` torch 2.13 puts together wrong (so would every checkpoint)."""
    seen: dict[int, int] = {}
    out: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(m for chunk in chunks for m in chunk):
        for p in layer.parameters():
            strided = _strided_tensor_shard(p)
            if seen.setdefault(id(p), i) != i or strided:
                out[id(p)] = p
    return list(out.values())


def frees_after_forward(level: str, reduce: str) -> bool:
    """FULL_SHARD per micro-batch frees a layer's weights after its forward and gathers them again for its backward."""
    return level == "FULL_SHARD" and reduce != "per_step"


class StageSharding:
    """This rank's stages (``chunks``: each one's layers) sharded over its stage group (collective at build).

    Args:
        chunks: the layers of each of this rank's stages, in order (one list with one stage per rank).
        topology: this rank's place (``stage_group``, ``stage_ranks``; ``data_mesh`` under tensor parallelism).
        level: ``"SHARD_GRAD_OP"`` or ``"FULL_SHARD"``.
        reduce: ``"per_microbatch"`` or ``"per_step"``.
        splits_backward: the schedule defers weight gradients (the reduction then waits for the step's end; a
            reconfigured schedule passes it again to :meth:`begin`).
        device: where the stage runs.
    """

    def __init__(
        self,
        chunks: Sequence[Sequence[nn.Module]],
        topology: Any,
        level: str,
        reduce: str,
        splits_backward: bool,
        device: torch.device,
    ) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.level, self.reduce, self.topology = level, reduce, topology
        self.per_step = reduce == "per_step"
        self.splits_backward = splits_backward
        self.mesh = data_mesh(topology, device)
        self.replicated = shared_within(chunks)  # whole on every rank of the group, averaged after the step
        ignored = set(self.replicated)
        free = frees_after_forward(level, reduce)
        self.layers: list[nn.Module] = []
        self.roots: dict[tuple[int, ...], Any] = {}  # FSDP roots (_ChunkRoot), by the ids of the chunk's layers
        for chunk in chunks:
            for layer in chunk:
                if isinstance(layer, FSDPModule):  # sharded on the meta device at the cut (shard_on_meta)
                    self.layers.append(layer)
                elif any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=self.mesh, reshard_after_forward=free, ignored_params=ignored)
                    self.layers.append(layer)
            root = _ChunkRoot(chunk)
            fully_shard(root, mesh=self.mesh, reshard_after_forward=False, ignored_params=ignored)
            self.roots[tuple(id(m) for m in chunk)] = root

    # -- the step ----------------------------------------------------------------------------------------------------
    def wrap(self, layers: Sequence[nn.Module], fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (the function of the stage made of ``layers``) run through that stage's FSDP root."""
        root = self.roots[tuple(id(m) for m in layers)]
        root.fn = fn
        return root

    @property
    def sync_each_microbatch(self) -> bool:
        """Whether every micro-batch's backward reduce-scatters its gradients (not under ``per_step``, nor where the
        schedule defers the weight gradients past the micro-batch's backward)."""
        return not (self.per_step or self.splits_backward)

    def begin(self, splits_backward: bool) -> None:
        """Before a training step: each backward reduces (or accumulates whole) and frees (or keeps) as set."""
        self.splits_backward = splits_backward
        sync = self.sync_each_microbatch
        free_after_backward = self.level == "FULL_SHARD" and not self.per_step
        for root in self.roots.values():
            root.set_is_last_backward(False)
            root.set_requires_gradient_sync(sync, recurse=True)
            root.set_reshard_after_backward(free_after_backward, recurse=True)

    def finish(self) -> None:
        """After the step's last backward: every layer's post-backward with the reduction on (the step's one
        reduce-scatter under ``per_step``; elsewhere nothing left to reduce), its weights freed; then the ignored
        (replicated) weights' gradients averaged over the group."""
        from torch.distributed.fsdp import fully_shard

        for root in self.roots.values():
            root.set_is_last_backward(True)
            root.set_requires_gradient_sync(True, recurse=True)
            root.set_reshard_after_backward(True, recurse=True)
            state = fully_shard.state(root)  # type: ignore[attr-defined]
            for each in state._state_ctx.all_states:
                for group in each._fsdp_param_groups:
                    group.post_backward()
            state._root_post_backward_final_callback()
        if self.replicated:  # whole on every rank of the group: averaged as exact averaging averages any gradient
            average_gradients(self.replicated, self.mesh.get_group(), self.mesh.size())

    def reshard(self) -> None:
        """Free every gathered weight (after an evaluation's forwards, which gather without a backward to free)."""
        for m in [*self.layers, *self.roots.values()]:
            m.reshard()  # type: ignore[operator]


def owners(layers: Sequence[nn.Module]) -> dict[int, tuple[nn.Module, str]]:
    """Each parameter of ``layers`` by id: a module that holds it and its name there (FSDP replaces the parameter
    objects: :func:`renamed` finds the new ones)."""
    out: dict[int, tuple[nn.Module, str]] = {}
    for layer in layers:
        for m in layer.modules():
            for name, p in m.named_parameters(recurse=False):
                out.setdefault(id(p), (m, name))
    return out


def renamed(params: Sequence[nn.Parameter], where: dict[int, tuple[nn.Module, str]]) -> tuple[nn.Parameter, ...]:
    """``params`` as the modules in ``where`` hold them now (after ``fully_shard``; a parameter not in it stays)."""
    return tuple(getattr(*where[id(p)]) if id(p) in where else p for p in params)


def shard_stage(
    chunks: Sequence[Sequence[nn.Module]], topology: Any, config: Any, splits: bool, device: torch.device, ties: Any
) -> tuple[StageSharding | None, tuple[Any, ...]]:
    """This rank's stages sharded as ``config.sharding_strategy`` says (None where it is not FSDP, or D = 1), and
    ``ties`` (``TiedWeights``) over the new parameter objects."""
    if not config.fsdp or topology.num_groups < 2:
        return None, tuple(ties)
    where = owners([m for chunk in chunks for m in chunk])
    sharding = StageSharding(chunks, topology, config.sharding_strategy, config.reduce_gradients, splits, device)
    return sharding, tuple(replace(t, params=renamed(t.params, where)) for t in ties)


def shard_on_meta(
    named_layers: Mapping[str, nn.Module],
    topology: Any,
    config: Any,
    device: torch.device,
    ties: Any,
    split: Sequence[Shard] = (),
) -> tuple[list[Shard], list[Any]]:
    """On this rank's layers (by their names in the model) still on the meta device (a model built without memory),
    the ``fully_shard`` that :class:`StageSharding` would apply (same mesh, ``reshard_after_forward`` and ignored
    weights; it then only adds the roots), before anything is made real. Returns, for each parameter sharded, its
    name, its meta tensor of the build and the function that, given its whole value, puts this rank's shard into the
    FSDP parameter (``runtime/build/materialize.py`` frees the whole after: no rank makes its whole stage real); and
    ``ties`` (``TiedWeights``, collected before) over the FSDP parameters.

    Under tensor parallelism (T > 1) the layers come split over the tensor group on the meta device (their split
    weights meta DTensors; ``split``: the shards that would make them real, ``split_on_meta``). FSDP2 shards a
    DTensor's local tensor, on the ``data`` dimension of the job's mesh, so a weight's function keeps its (data,
    tensor) piece: the tensor shard cut as ``split`` cuts it, then that shard's dim-0 chunk (:func:`_place_chunk`),
    1/(D x T) of the weight; ``split``'s own entries are returned only for the weights FSDP leaves out (ignored)."""
    from torch.distributed.fsdp import fully_shard

    layers = list(named_layers.values())
    mesh = data_mesh(topology, device)
    ignored = set(shared_within([layers]))
    free = frees_after_forward(config.sharding_strategy, config.reduce_gradients)
    where = owners(layers)
    before: dict[tuple[int, str], tuple[str, nn.Parameter]] = {}  # (module, name) -> (name in the model, the build's)
    for prefix, layer in named_layers.items():
        for mn, m in layer.named_modules():
            for n, p in m.named_parameters(recurse=False):
                before.setdefault((id(m), n), (".".join(filter(None, (prefix, mn, n))), p))
    by_name = {shard[0]: shard for shard in split}  # a tensor-split weight's name -> its build's tensor, by shapes
    shards: list[Shard] = []
    for layer in layers:
        if not any(True for _ in layer.parameters()):
            continue
        fully_shard(layer, mesh=mesh, reshard_after_forward=free, ignored_params=ignored)
        state = fully_shard.state(layer)  # type: ignore[attr-defined]
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                info = param._module_info
                name, held = before[(id(info.module), info.param_name)]
                if not is_dtensor(held):  # whole on its tensor group (or T = 1): the build's own
                    shards.append((name, held, _place_chunk(param, mesh)))
                    continue
                if name not in by_name:
                    raise ValueError(
                        f"AvgPipe: {name} is a DTensor on the meta device that tensor parallelism did not split "
                        "(no shard of it to make real); FULL_SHARD/SHARD_GRAD_OP of a model built in "
                        "configure_model needs its weights plain tensors until the strategy splits them."
                    )
                original = by_name.pop(name)[1]
                shards.append((name, original, _place_chunk(param, mesh, _tensor_shard_of(held))))
    shards += by_name.values()  # split weights FSDP left out (ignored): their tensor shard alone, as before
    return shards, [replace(t, params=renamed(t.params, where)) for t in ties]


def _tensor_shard_of(split: Tensor) -> Callable[[Tensor], Tensor]:
    """The function giving this rank's tensor-parallel shard of a whole value, as ``split`` (a meta DTensor) cuts it."""
    from lightning_avgpipe.runtime.sharding.tensor_parallel import local_shard

    return lambda whole: local_shard(whole, split)


def _place_chunk(
    fsdp_param: Any, mesh: Any, tensor_shard: Callable[[Tensor], Tensor] | None = None
) -> Callable[[Tensor], Tensor]:
    """For one FSDP parameter sharded on the meta device: the function that, given the parameter's whole value,
    makes the parameter (the same object) a real DTensor of this rank's dim-0 chunk of it, as ``fully_shard`` cuts
    it (padded by FSDP as it pads its own), and returns the local storage it keeps. With ``tensor_shard`` (the
    weight is a tensor-parallel DTensor), the chunk is of this rank's tensor shard of the whole, which is what
    FSDP2 chunks of a DTensor (``_init_sharding_spec_tp``: its local tensor; the placement on ``data`` is a
    ``_StridedShard`` where the tensor split is on dim 0 too, which only describes where the chunk sits in the
    whole)."""
    from torch.distributed.tensor import DTensor

    def place(whole: Tensor) -> Tensor:
        param = fsdp_param.sharded_param
        rank, size = mesh.get_local_rank(), mesh.size()
        source = whole.detach() if tensor_shard is None else tensor_shard(whole)
        chunks = torch.chunk(source, size, dim=0)
        local = (
            chunks[rank].clone(memory_format=torch.contiguous_format)
            if rank < len(chunks)
            else source.new_empty((0, *source.shape[1:]))
        )
        del chunks, source  # a tensor shard cut as a copy (split on dim 1: a row-wise weight) freed now
        value = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
        fsdp_param.reset_sharded_param()  # FSDP's padded storage, as after ``to_empty``
        return fsdp_param._sharded_param_data

    return place


def release(sharding: StageSharding) -> None:
    """At exit: drop the process groups FSDP's state keeps on the layers (its mesh infos hold the group itself, not
    only the mesh), and the step the roots' functions hold, so the groups are freed while the interpreter is alive
    (``runtime/failures/shutdown.py``)."""
    from torch.distributed.fsdp import fully_shard

    for root in sharding.roots.values():  # the layers' FSDP states reach their root: its function holds the step
        root.fn = None
    for m in [*sharding.layers, *sharding.roots.values()]:
        state = fully_shard.state(m)  # type: ignore[attr-defined]
        for group in state._fsdp_param_groups:
            infos = [group.mesh_info, group.post_forward_mesh_info]
            infos += [i for p in group.fsdp_params for i in (p.mesh_info, p.post_forward_mesh_info)]
            for info in infos:
                for name, value in list(vars(info).items()) if info is not None else []:
                    if isinstance(value, dist.ProcessGroup):
                        setattr(info, name, None)
