"""Tensor parallelism inside a stage: the per-layer plan and the link that carries a stage's activations across a
stage boundary once per tensor group (docs/parallelism.md#tensor-parallelism).

A plan maps module names of the unsplit model (``fnmatch`` patterns, as ``parallelize_module`` takes) to
``torch.distributed.tensor.parallel`` styles, or :class:`~.head_parallel.Heads` for an attention. Each stage applies
the entries that name its modules, on its tensor group's one-dimensional mesh (:func:`parallelize_stage`). The
default plan (:func:`default_plan`) splits attention by heads and MLP pairs (Megatron's block: one all-reduce per
pair, the pair's output whole on every shard).

A stage's input and output are whole on every shard of its tensor group, so one copy crosses each boundary: shard 0
of a stage sends to shard 0 of the next and broadcasts what it receives to its group (:class:`TensorParallelLink`);
gradients travel back the same way. Under sequence parallelism a boundary between two layers that run on a shard of
the sequence carries each shard's part instead, from every shard to its counterpart.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lightning_avgpipe.runtime.build.materialize import Shard
from lightning_avgpipe.runtime.comms.p2p import META_LEN, Link, OutputMeta, StageOutputError
from lightning_avgpipe.runtime.deferred import is_conv1d
from lightning_avgpipe.runtime.sharding.grid import Grid
from lightning_avgpipe.runtime.sharding.grid_stage import CONVERTED, GridStage, grid_layer, grid_stage
from lightning_avgpipe.runtime.sharding.head_parallel import Column, Heads, Row, find_attention, linear_like, widths
from lightning_avgpipe.runtime.sharding.sequence_parallel import SequenceStage, sequence_stage

Plan = Mapping[str, Any]  # module name pattern in the unsplit model -> a ParallelStyle
ActivationStage = SequenceStage | GridStage  # how a stage's layers split their activations (activation_stage)


def default_plan(named_layers: Mapping[str, nn.Module]) -> dict[str, Any]:
    """Attention by heads and MLP pairs. A module with a head count (``n_head``, ``num_heads``, ...), a fused ``qkv``
    (d -> 3d) or ``q``, ``k``, ``v`` children and a projection back gets :class:`~.head_parallel.Heads` (tried on
    the shards before it is kept). Among the other ``nn.Linear``/``Conv1D`` children of one module, a widening one
    (``d -> h``, ``h > d``) and the next, which reads ``h`` back to ``d``, go column-wise then row-wise (Megatron's
    MLP: one all-reduce per pair). Everything else stays whole on every shard: gated MLPs (another sibling also makes
    ``h``), a lone Linear."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for prefix, layer in named_layers.items():
        taken: set[str] = set()
        for n, m in layer.named_modules():
            found = find_attention(m, 1)
            if isinstance(found, tuple) and not any(n.startswith(t + ".") or n == t for t in taken):
                plan[_join(prefix, n)] = Heads()
                taken |= {_join(n, c) for c in [*found[0], found[1]]}
        siblings: dict[str, list[tuple[str, nn.Module]]] = {}
        for n, m in layer.named_modules():
            if linear_like(m) and n not in taken:
                siblings.setdefault(n.rpartition(".")[0], []).append((n, m))
        for linears in siblings.values():
            conv = any(is_conv1d(m) for _, m in linears)
            _pair(prefix, linears, plan, Column if conv else ColwiseParallel, Row if conv else RowwiseParallel)
    return plan


def hugging_face_plan(root: nn.Module, named_layers: Mapping[str, nn.Module]) -> tuple[dict[str, Any], list[str]]:
    """The plan a Hugging Face model inside ``root`` declares (``config.base_model_tp_plan``: patterns relative to
    its base model, ``"colwise"`` or ``"rowwise"``), keyed by the names of the same modules under ``named_layers``;
    and the entries left whole, each with its style (one this strategy does not apply). Empty where ``root`` holds
    no such model, or where this stage holds none of its planned modules."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    wanted: dict[int, str] = {}  # id(module) -> its style
    left: list[str] = []
    for m in root.modules():
        declared = getattr(getattr(m, "config", None), "base_model_tp_plan", None)
        base = getattr(m, "base_model", None)
        if not isinstance(declared, Mapping) or not declared or not isinstance(base, nn.Module):
            continue
        names = list(base.named_modules())
        for pattern, style in declared.items():
            if style not in styles:
                left.append(f"{pattern} ({style})")
                continue
            for name, sub in names:
                if fnmatch.fnmatchcase(name, pattern):
                    wanted.setdefault(id(sub), style)
    plan: dict[str, Any] = {}
    for prefix, layer in named_layers.items():
        for name, sub in layer.named_modules():
            if id(sub) in wanted:
                plan[_join(prefix, name)] = styles[wanted[id(sub)]]()
    return plan, left


def _pair(prefix: str, linears: list[tuple[str, nn.Module]], plan: dict[str, Any], col: Any, row: Any) -> None:
    """Pair a widening Linear (d -> h) with the next one, which reads h back to d: the MLP of a block, also where the
    block keeps its attention's Linear layers beside it (``qkv``, ``proj``, ``fc1``, ``fc2``). Not where another
    sibling also makes h (a gate: three Linear layers whose outputs meet), which a column split would break."""
    for (a, first), (b, second) in zip(linears, linears[1:]):
        (d, h), (h2, d2) = widths(first), widths(second)
        widening = h > d and h2 == h and d2 == d
        gated = any(widths(m)[1] == h for n, m in linears if n not in (a, b))
        if widening and (len(linears) == 2 or not gated):
            plan[_join(prefix, a)] = col()
            plan[_join(prefix, b)] = row()
            return


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def check_plan(plan: Plan, module_names: Sequence[str]) -> None:
    """Every entry of ``plan`` must name at least one module of the model (names in the unsplit model)."""
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in module_names):
            near = [n for n in module_names if n and n.split(".")[-1] == pattern.split(".")[-1]][:3]
            raise ValueError(
                f"tensor_parallel_plan names {pattern!r}, which is no module of the model (names are those of "
                f"named_modules() on the unsplit model{', such as ' + ', '.join(near) if near else ''}). Fix the name, "
                "or drop the entry."
            )


def parallelize_stage(
    named_layers: Mapping[str, nn.Module],
    plan: Plan,
    mesh: Any,
    left: list[str] | None = None,
    local: bool = False,
    sequence: bool = False,
) -> list[str]:
    """Apply the entries of ``plan`` that name modules of this stage's layers (keyed by their names in the unsplit
    model) on ``mesh``; returns the names of the modules split, and adds to ``left`` each attention left whole, with
    why. torch's ``ColwiseParallel``/``RowwiseParallel`` on a Hugging Face ``Conv1D`` split it as its own layout
    needs. With ``local`` (a stage still on the meta device, split by shapes alone, :func:`place_shard`), every shard
    cuts its own copy (``src_data_rank=None``: no transfer); else shard 0's values are scattered. With ``sequence``
    (sequence parallelism, ``runtime/sharding/sequence_parallel.py``) torch's column- and row-wise styles become
    :class:`~.head_parallel.Column` and :class:`~.head_parallel.Row`, the same cut on local tensors, which that
    module can make gather and scatter the sequence."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    done = []
    for prefix, layer in named_layers.items():
        for name, module in list(layer.named_modules()):
            full = _join(prefix, name)
            style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(full, pattern)), None)
            if style is None:
                continue
            if isinstance(style, Heads):
                style = Heads()  # one per module: it says why it left this one whole
            elif (sequence or is_conv1d(module)) and type(style) in (ColwiseParallel, RowwiseParallel):
                style = Column() if type(style) is ColwiseParallel else Row()
            if local and getattr(style, "src_data_rank", None) is not None:
                style = copy.copy(style)
                style.src_data_rank = None
            parallelize_module(module, mesh, style)
            if isinstance(style, Heads) and style.left:
                if left is not None:
                    left.append(f"{full} ({style.left})")
            else:
                done.append(full)
    return done


def activation_stage(
    chunks: Sequence[Sequence[nn.Module]], config: Any, tensor_group: Any, grid_mesh: Any, ties: Sequence[Any] = ()
) -> ActivationStage | None:
    """How this rank's stages (``chunks``: each stage's layers) split their activations, set up before the replicas
    copy the layers: a shard of the sequence under ``config.sequence_parallel`` (the layers split by the plan
    already, ``sequence_parallel.py``); blocks of the d x q x q grid under ``config.grid`` (2D, 2.5D: the layers
    whole, converted here, ``grid_stage.py``, but a layer holding a weight tied to another stage's: ``ties``, each
    with its ``params``); None under 1D. Collective over the tensor group."""
    if config.sequence_parallel:
        return sequence_stage(chunks, tensor_group)
    if config.grid is not None:
        return grid_stage(chunks, grid_mesh, whole={id(p) for tie in ties for p in tie.params})
    return None


def split_on_meta(
    named_layers: Mapping[str, nn.Module],
    plan: Plan,
    mesh: Any,
    left: list[str] | None = None,
    sequence: bool = False,
) -> tuple[list[str], list[Shard]]:
    """:func:`parallelize_stage` on layers still on the meta device (built without memory), by shapes. Returns the
    modules split and, for each parameter split, its name, its meta tensor of the build and the function that puts
    this rank's shard of its whole value in place (:func:`place_shard`): ``runtime/build/materialize.py`` hands it the
    value and frees the whole, so no rank makes a whole stage real."""
    before = _parameters(named_layers)
    done = parallelize_stage(named_layers, plan, mesh, left, local=True, sequence=sequence)
    return done, _cut_since(named_layers, before)


def grid_on_meta(named_layers: Mapping[str, nn.Module], mesh: Any, ties: Sequence[Any] = ()) -> list[Shard]:
    """The grid's conversion (``grid_stage.grid_layer``, 2D and 2.5D) of this stage's layers while they are still on
    the meta device, each tried on a real copy with stand-in values and cut by shapes; what it made of each layer is
    left on it for ``grid_stage`` (``CONVERTED``). Returns, for each parameter cut, what ``materialize`` needs to make
    only this rank's block of it real (:func:`place_shard`), as :func:`split_on_meta` does for 1D; a layer holding a
    weight of ``ties`` stays whole. Collective over the grid."""
    grid = Grid.of(mesh)
    before = _parameters(named_layers)
    for layer in named_layers.values():
        setattr(layer, CONVERTED, grid_layer(layer, grid, whole={id(p) for tie in ties for p in tie.params}))
    return _cut_since(named_layers, before)


def _parameters(named_layers: Mapping[str, nn.Module]) -> dict[tuple[int, str], tuple[str, Tensor]]:
    """(id(module), parameter name) -> (its name in the model, the parameter), for every parameter of the layers."""
    return {
        (id(m), n): (".".join(filter(None, (name, mn, n))), p)
        for name, layer in named_layers.items()
        for mn, m in layer.named_modules()
        for n, p in m.named_parameters(recurse=False)
    }


def _cut_since(named_layers: Mapping[str, nn.Module], before: dict[tuple[int, str], tuple[str, Tensor]]) -> list[Shard]:
    """For each parameter of the layers that became a DTensor since ``before`` (:func:`_parameters`): its name, its
    meta tensor of the build and the function that puts this rank's shard of its whole value in place."""
    shards: list[Shard] = []
    for layer in named_layers.values():
        for m in layer.modules():
            for n, p in list(m.named_parameters(recurse=False)):
                name, original = before.get((id(m), n), ("", p))
                if p is not original and is_traceable_wrapper_subclass(p):
                    shards.append((name, original, place_shard(m, n, p)))
    return shards


def place_shard(module: nn.Module, name: str, split: Any) -> Callable[[Tensor], Tensor]:
    """For a parameter that :func:`parallelize_stage` split on the meta device (``split``, a DTensor under
    ``module.<name>``): the function that, given the parameter's whole value, sets ``module.<name>`` to a real
    DTensor of this rank's shard of it (cut as the plan cut the meta one) and returns that shard, the whole left to
    be freed."""
    from torch.distributed.tensor import DTensor

    mesh, placements = split.device_mesh, tuple(split.placements)

    def place(whole: Tensor) -> Tensor:
        local = local_shard(whole, split)
        if local.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
            local = local.clone()  # a view of the whole (a row shard): its own storage, so the whole can be freed
        value = DTensor.from_local(local, mesh, placements, run_check=False, shape=split.shape, stride=split.stride())
        module.register_parameter(name, nn.Parameter(value, requires_grad=split.requires_grad))
        return local

    return place


def local_shard(whole: Tensor, split: Any) -> Tensor:
    """This rank's tensor-parallel shard of ``whole``, cut as ``split`` (a DTensor of its shape, on the meta device
    or not) is placed on its mesh: what :func:`place_shard` keeps and what FSDP, on top, shards further
    (``runtime/sharding/fsdp.py`` ``shard_on_meta``). Each rank cuts its own copy (``src_data_rank=None``: no
    transfer); the result may be a view of ``whole``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.detach(), split.device_mesh, tuple(split.placements), src_data_rank=None).to_local()


def whole_outputs(stage_fn: Callable[[Any], Any], group: Any, where: str) -> Callable[[Any], Any]:
    """``stage_fn``, checking once per output signature that every shard of the tensor group computed the same
    output: a plan that leaves a stage's output split (a column-wise layer without its row-wise partner at the end of
    a stage) would otherwise send shard 0's part alone, and train wrongly without a word."""
    checked: set[Any] = set()

    def run(x: Any) -> Any:
        y = stage_fn(x)
        tensors = [t for t in _leaves(y) if t.is_floating_point() or t.is_complex()]
        key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if tensors and key not in checked:
            checked.add(key)
            with torch.no_grad():
                mine = torch.stack([v for t in tensors for v in (t.float().sum(), t.float().abs().sum())])
                seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
                dist.all_gather(seen, mine.contiguous(), group=group)
            finite = all(bool(torch.isfinite(o).all()) for o in seen)  # inf/NaN: the loss and gradient checks name it
            if finite and not all(torch.allclose(other, seen[0], rtol=1e-4, atol=1e-5) for other in seen):
                raise StageOutputError(
                    f"{where}: the shards of its tensor group computed different outputs {[o.tolist() for o in seen]}: "
                    "the tensor-parallel plan leaves the stage's output split (end each stage's split layers with a "
                    "row-wise one, ColwiseParallel then RowwiseParallel, or choose a partition that does not cut "
                    "between them), or random layers (dropout) outside the split ones draw differently on each shard "
                    "(seed every rank alike)."
                )
        return y

    return run


def _leaves(value: Any) -> list[Tensor]:
    """The tensors in a (nested) stage output: a tensor, tuples and lists, dicts; anything else is skipped."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _leaves(v)]
    return []


class TensorParallelLink(Link):
    """One stage shard's transfers. A direction that carries whole tensors: shard 0 talks to the neighbouring
    stage's shard 0 through ``inner`` and broadcasts what arrives to the tensor group; the other shards send nothing
    and receive the broadcast. A direction that carries this shard's part of the sequence (``carry``: the input's,
    the output's; sequence parallelism, ``sequence_parallel.SequenceStage.carry``): every shard talks to its
    counterpart through its own ``inner``, with no broadcast.

    Every shard of a stage runs the same plan, so the broadcasts happen in the same order on all of them.
    """

    def __init__(
        self,
        inner: Link | None,
        group: Any,
        src: int,
        device: torch.device,
        name: str,
        stage: int,
        carry: tuple[bool, bool] = (False, False),
    ) -> None:
        self.inner = inner  # shard 0's, and every shard's where a direction carries the shard's part
        super().__init__(
            inner.prev_rank if inner else None, inner.next_rank if inner else None, device, name=name, stage=stage
        )
        self.tensor_group = group
        self.src = src
        self.leads = dist.get_rank() == src  # shard 0: whole tensors cross through it
        self.split_in, self.split_out = carry
        self._keys: dict[int, Hashable] = {}
        self._grad_like: dict[int, list[Tensor]] = {}
        self._meta: dict[Hashable, OutputMeta] = {}

    # the inner link's settings follow this one's
    @property  # type: ignore[override]
    def always_batch(self) -> bool:
        return self.inner.always_batch if self.inner is not None else False

    @always_batch.setter
    def always_batch(self, value: bool) -> None:
        if getattr(self, "inner", None) is not None:
            self.inner.always_batch = value  # type: ignore[union-attr]

    @property  # type: ignore[override]
    def timeout(self) -> float | None:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._timeout = value
        if getattr(self, "inner", None) is not None:
            self.inner.timeout = value  # type: ignore[union-attr]

    def _broadcast(self, tensor: Tensor, what: str) -> None:
        work = dist.broadcast(tensor, src=self.src, group=self.tensor_group, async_op=True)
        self._wait(work, what, self.src, 0)

    def _talks(self, split: bool) -> Link | None:
        """The link this shard sends and receives through in a direction (``split``: it carries the shard's part)."""
        return self.inner if split or self.leads else None

    # -- forward direction ---------------------------------------------------------------------------------------
    def send_activations(self, key: Hashable, value: Any) -> None:
        if (inner := self._talks(self.split_out)) is not None:
            inner.send_activations(key, value)

    def post_activations(self, unit: int, key: Hashable) -> None:
        self._keys[unit] = key
        if (inner := self._talks(self.split_in)) is not None:
            inner.post_activations(unit, key)

    def wait_activations(self, unit: int, training: bool) -> Any:
        key = self._keys.pop(unit)
        if self.split_in:  # this shard's part, from its counterpart
            return self.inner.wait_activations(unit, training)  # type: ignore[union-attr]
        inner = self._talks(False)
        got = inner.wait_activations(unit, training=False) if inner is not None else None
        meta = self._meta.get(key)
        if meta is None:  # the first unit of a signature: shard 0 tells the others what arrives
            buf = (  # the header shard 0 received (the sender's requires-grad flags)
                inner.received_meta(key).encode(self.device)
                if inner is not None
                else torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            )
            self._broadcast(buf, f"the activation header of unit {unit}")
            meta = self._meta[key] = OutputMeta.decode(buf)
        if got is None:
            tensors = [torch.empty(tm.shape, dtype=tm.dtype, device=self.device) for tm in meta.tensors]
        else:
            tensors = list(got) if meta.is_tuple else [got]
        for t in tensors:
            self._broadcast(t, f"the activations of unit {unit}")
        for t, tm in zip(tensors, meta.tensors):
            if training and tm.requires_grad:
                t.requires_grad_(True)
        return tuple(tensors) if meta.is_tuple else tensors[0]

    # -- backward direction --------------------------------------------------------------------------------------
    def post_grads(self, unit: int, like: Sequence[Tensor]) -> None:
        self._grad_like[unit] = list(like)
        if (inner := self._talks(self.split_out)) is not None:
            inner.post_grads(unit, like)

    def wait_grads(self, unit: int) -> list[Tensor]:
        like = self._grad_like.pop(unit)
        inner = self._talks(self.split_out)
        if inner is not None:
            grads = inner.wait_grads(unit)
            if self.split_out:  # this shard's part, from its counterpart
                return grads
        else:
            grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        for g in grads:
            self._broadcast(g, f"the gradients of unit {unit}")
        return grads

    def send_grads(self, grads: Sequence[Tensor]) -> None:
        if (inner := self._talks(self.split_in)) is not None:
            inner.send_grads(grads)

    # -- the rest is the inner link's, where this shard has one -----------------------------------------------------
    def begin_batch(self) -> None:
        if self.inner is not None:
            self.inner.begin_batch()

    def flush_batch(self) -> None:
        if self.inner is not None:
            self.inner.flush_batch()

    def reap_sends(self) -> None:
        if self.inner is not None:
            self.inner.reap_sends()

    def wait_sends(self) -> None:
        if self.inner is not None:
            self.inner.wait_sends()

    def reset(self) -> None:
        self._meta.clear()
        if self.inner is not None:
            self.inner.reset()
