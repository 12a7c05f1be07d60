"""Tensor parallelism in the strategy (docs/parallelism.md): the plan from the user or the default, applied to this
rank's stage after the split (a stage built without memory: on the meta device, before its shards are made real),
and the checks that name a mesh or plan that cannot work."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_avgpipe.runtime.build.materialize import Shard
from lightning_avgpipe.runtime.comms import collectives
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.sharding import fsdp
from lightning_avgpipe.runtime.sharding.grid import release_grids
from lightning_avgpipe.runtime.sharding.tensor_parallel import (
    check_plan,
    default_plan,
    hugging_face_plan,
    parallelize_stage,
    split_on_meta,
)
from lightning_avgpipe.shards import is_dtensor, release_meshes

__all__ = [
    "apply",
    "check_model",
    "check_plan",
    "check_tensor_parallel_args",
    "release",
]

STYLE_NAMES = ("colwise", "rowwise", "heads")


def check_tensor_parallel_args(
    size: int, plan: Any, devices_per_node: int | None, mode: str = "1d"
) -> dict[str, Any] | None:
    """``tensor_parallel_plan`` as a dict of ``ParallelStyle``s (names ``"colwise"``/``"rowwise"`` become them), and
    ``tensor_parallel_size`` checked against the devices of a node (tensor parallelism stays inside one); a plan is
    1D's (``mode``: ``tensor_parallel_mode``)."""
    if size > 1 and not tensor_parallel_available():
        import torch

        raise ValueError(
            f"tensor_parallel_size={size} needs torch >= 2.7 (public DTensor, distribute_tensor(src_data_rank=None)); "
            f"this is torch {torch.__version__}. Upgrade torch, or use tensor_parallel_size=1."
        )
    if devices_per_node is not None and size > 1 and devices_per_node % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the {devices_per_node} devices of a node: a tensor group "
            f"must sit inside one node (its all-reduces run every layer). Use a divisor of {devices_per_node}, or "
            "change Trainer(devices=...)."
        )
    if plan is None:
        return None
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) for k in plan):
        raise ValueError(
            f"tensor_parallel_plan={plan!r} must map module names of the model (patterns allowed, such as "
            "'blocks.*.mlp.fc1') to ColwiseParallel()/RowwiseParallel() or 'colwise'/'rowwise' (an attention "
            "module: 'heads')."
        )
    if size == 1:
        raise ValueError(
            "tensor_parallel_plan is given but tensor_parallel_size=1; set tensor_parallel_size=2 (or more)."
        )
    if mode != "1d":
        raise ValueError(
            f"tensor_parallel_plan is given with tensor_parallel_mode={mode!r}: a plan says how 1D splits each layer, "
            "and the grid converts layers by their type (Linear, Conv1D, norms, attention by heads). Drop the plan, "
            "or set tensor_parallel_mode='1d'."
        )
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    from lightning_avgpipe.runtime.sharding.head_parallel import Heads

    named = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "heads": Heads}
    out: dict[str, Any] = {}
    for name, style in plan.items():
        if isinstance(style, str) and style in STYLE_NAMES:
            style = named[style]()
        if not isinstance(style, ParallelStyle):
            raise ValueError(
                f"tensor_parallel_plan[{name!r}]={style!r} is not a ParallelStyle; use ColwiseParallel(), "
                f"RowwiseParallel() (torch.distributed.tensor.parallel) or one of {list(STYLE_NAMES)}."
            )
        out[name] = style
    return out


def tensor_parallel_available() -> bool:
    """Whether this torch has what tensor parallelism here uses (torch >= 2.7)."""
    import torch

    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 7)


def check_model(plan: Mapping[str, Any] | None, module: nn.Module) -> None:
    """Before the split, on the whole model: the plan names its modules. (Weights shared between stages are summed
    per tensor shard, ``runtime/sync/ties.py``; one that the plan splits is refused when the pipeline is made.)"""
    if plan is not None:
        check_plan(plan, [n for n, _ in module.named_modules()])


def apply(
    owned: Mapping[str, nn.Module],
    plan: Mapping[str, Any] | None,
    topology: Topology,
    root: nn.Module | None = None,
    on_meta: bool = False,
    sequence: bool = False,
) -> list[Shard]:
    """With T > 1, split this stage's layers (``owned``: name in the model -> layer) across its tensor group by
    ``plan`` (checked beforehand, :func:`check_model`); without one, by the plan of a Hugging Face model that
    ``root`` (the LightningModule) holds, else by the default plan; and say what was split. ``on_meta``: the layers
    are still on the meta device (built without memory), split by shapes; returns what ``materialize`` needs to make
    only this rank's shards real (``split_on_meta``). ``sequence``: for sequence parallelism, torch's column- and
    row-wise styles as this package's (``parallelize_stage``)."""
    shards: list[Shard] = []
    if topology.tensor_parallel_size == 1:
        return shards
    if plan is None:
        plan = choose_plan(owned, root)
    left: list[str] = []
    if on_meta:
        split, shards = split_on_meta(owned, plan, topology.tensor_mesh, left, sequence)
    else:
        split = parallelize_stage(owned, plan, topology.tensor_mesh, left, sequence=sequence)
    found = Counter(type(m).__name__ for layer in owned.values() for m in layer.modules() if not list(m.children()))
    every = collectives.gather(topology, (split, dict(found), left))  # every stage's, on the pipeline's first rank
    if every is None:
        return shards
    T = topology.tensor_parallel_size
    lines = [f"stage {s}: {', '.join(names) or 'nothing'}" for s, (names, _, _) in enumerate(every)]
    rank_zero_info(f"AvgPipe: tensor parallelism over {T} ranks splits, per stage, " + "; ".join(lines) + ".")
    for s, (_, _, whole) in enumerate(every):
        if whole:
            rank_zero_warn(
                f"AvgPipe: tensor parallelism left attention whole on stage {s}: {'; '.join(whole)}. Its {T} ranks "
                "compute it whole. Split by heads needs a forward that takes its widths from the module's attributes "
                "(n_head, head_dim), not from its input's shape; or give tensor_parallel_plan for it."
            )
    for s, (names, kinds, _) in enumerate(every):
        if not names:
            held = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "no layers with weights"
            rank_zero_warn(
                f"AvgPipe: tensor_parallel_size={T} splits nothing on stage {s}, which holds {held}: its {T} ranks "
                "all compute the whole stage. The default plan splits attention by heads and MLP pairs (a widening "
                "Linear or Conv1D and the one reading it back); give tensor_parallel_plan={...} for the rest."
            )
    return shards


def choose_plan(owned: Mapping[str, nn.Module], root: nn.Module | None) -> dict[str, Any]:
    """A Hugging Face model's own plan where ``root`` holds one (``config.base_model_tp_plan``), said in the log;
    else the default plan."""
    if root is not None:
        plan, left = hugging_face_plan(root, owned)
        if plan or left:
            rank_zero_info(
                "AvgPipe: tensor parallelism follows the Hugging Face model's config.base_model_tp_plan"
                + (f"; left whole (styles this strategy does not apply): {', '.join(left)}" if left else "")
                + "."
            )
            return plan
    return default_plan(owned)


def release(topology: Topology | None, pipeline: StagePipeline | None) -> None:
    """At exit: the process groups that the tensor-parallel (and FSDP) device meshes hold (the topology's, and every
    replica's copy of it), so they are freed with the others (``shards.release_meshes``)."""
    meshes = [topology.tensor_mesh, topology.grid_mesh] if topology is not None else []
    meshes += release_grids()  # the 2D and 2.5D grids' meshes and their flat ones
    if pipeline is not None:
        meshes += [p.device_mesh for p in [*pipeline.replicas.params, *pipeline.reference_params] if is_dtensor(p)]  # type: ignore[attr-defined]
        if pipeline.sharding is not None:  # FSDP's mesh over the stage group, and the groups its states keep
            meshes.append(pipeline.sharding.mesh)
            fsdp.release(pipeline.sharding)
    release_meshes(meshes)
