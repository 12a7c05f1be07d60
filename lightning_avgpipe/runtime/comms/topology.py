"""Which stage, pipeline group and tensor shard a rank holds, and the process groups that join them
(docs/how-it-works.md#topology, docs/parallelism.md#the-mesh).

A job of ``D x S x T`` ranks is a mesh with the tensor dimension innermost: rank ``r`` holds tensor shard
``r % T`` of stage ``(r // T) % S`` of pipeline group ``r // (S T)``. Consecutive ranks (one node's devices) share
a stage, so tensor parallelism's per-layer all-reduces stay inside a node, and stages and groups cross nodes.
Three kinds of groups:

- the pipeline group: the S ranks of one group that hold the same shard (activations, gradients, the step's results);
- the stage group: the D ranks that hold the same (stage, shard); the reference update or the exact gradient
  average runs over it (the mesh's data dimension);
- the tensor group: the T ranks of one stage (a ``DeviceMesh`` of one dimension, for ``parallelize_module``).

With ``T = 1`` (no tensor parallelism) rank ``r`` holds stage ``r % S`` of group ``r // S``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def _with_timeout(names: tuple[str, ...], seconds: float) -> dict[str | int, Any] | None:
    """``init_device_mesh``'s per-dimension backend options carrying ``seconds`` as the groups' timeout (its groups
    otherwise take the backend's default, not the strategy's ``timeout``); None when the backend has no options."""
    backend = dist.get_backend()
    options: Any
    if backend == "gloo":
        options = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 - private in the stubs
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timedelta(seconds=seconds)
    return {name: (backend, options) for name in names}


@dataclass(frozen=True)
class Topology:
    """This rank's place in a ``num_groups x num_stages`` job (a single process is ``Topology(0, 1, 1)``)."""

    rank: int
    world_size: int
    num_stages: int
    # None: the default process group (a job of one pipeline), or no group at all in a single process
    pipeline_group: Any = field(default=None, compare=False)
    stage_group: Any = field(default=None, compare=False)  # None when there is one group
    # the ranks of the whole job, for decisions every rank must share (None: the default process group)
    job_group: Any = field(default=None, compare=False)
    # T: ranks that split each layer of a stage (tensor parallelism); their group and one-dimensional device mesh
    tensor_parallel_size: int = 1
    tensor_group: Any = field(default=None, compare=False)
    tensor_mesh: Any = field(default=None, compare=False)
    # under tensor parallelism, the job mesh's data dimension (the stage group's ranks), for FSDP's 2D weights
    data_mesh: Any = field(default=None, compare=False)
    # under 2D and 2.5D tensor parallelism, the tensor group as a d x q x q mesh (dimensions depth, row, col)
    grid_mesh: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        T = self.tensor_parallel_size
        if not isinstance(T, int) or isinstance(T, bool) or T < 1 or self.world_size % T:
            raise ValueError(
                f"tensor_parallel_size={T!r} must be an int >= 1 that divides devices x num_nodes = {self.world_size}; "
                "use 1 (no tensor parallelism) or a divisor of the devices per node, such as 2."
            )
        if self.num_stages < 1 or self.world_size % (self.num_stages * T):
            if T > 1:
                raise ValueError(
                    f"devices x num_nodes = {self.world_size} is not a multiple of num_stages x tensor_parallel_size "
                    f"= {self.num_stages} x {T}: the mesh is D x S x T ranks. Change num_stages or "
                    "tensor_parallel_size, or the number of devices."
                )
            raise ValueError(
                f"devices x num_nodes = {self.world_size} is not a multiple of num_stages={self.num_stages}; use a "
                f"number of devices that num_stages divides (for example "
                f"{self.num_stages * max(1, self.world_size // max(1, self.num_stages))}), or change num_stages."
            )

    @property
    def stage(self) -> int:
        return (self.rank // self.tensor_parallel_size) % self.num_stages

    @property
    def tensor_rank(self) -> int:
        """This rank's shard within its stage's tensor group (0 with no tensor parallelism)."""
        return self.rank % self.tensor_parallel_size

    @property
    def group_index(self) -> int:
        """This rank's pipeline group (its data-parallel index)."""
        return self.rank // (self.num_stages * self.tensor_parallel_size)

    @property
    def num_groups(self) -> int:
        """D, the pipeline groups: world size / (stages x tensor-parallel size)."""
        return self.world_size // (self.num_stages * self.tensor_parallel_size)

    def rank_of(self, group: int, stage: int, shard: int = 0) -> int:
        """The global rank holding ``shard`` of ``stage`` in pipeline group ``group``."""
        return (group * self.num_stages + stage) * self.tensor_parallel_size + shard

    @property
    def pipeline_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline (those holding its shard), stage 0 first."""
        return [self.rank_of(self.group_index, s, self.tensor_rank) for s in range(self.num_stages)]

    @property
    def stage_ranks(self) -> list[int]:
        """The global ranks holding this rank's stage and shard, group 0 first (the stage group)."""
        return [self.rank_of(d, self.stage, self.tensor_rank) for d in range(self.num_groups)]

    @property
    def tensor_ranks(self) -> list[int]:
        """The global ranks of this rank's stage's tensor group, shard 0 first."""
        return [self.rank_of(self.group_index, self.stage, t) for t in range(self.tensor_parallel_size)]

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def build(
        cls,
        rank: int,
        world_size: int,
        num_stages: int,
        timeout: float = 1800.0,
        tensor_parallel_size: int = 1,
        device_type: str = "cpu",
        grid: tuple[int, int] | None = None,
    ) -> Topology:
        """Make the pipeline and stage groups of a job whose default process group is up (collective).

        Every rank must create every group, in the same order, so each rank calls this with the same arguments.
        With ``tensor_parallel_size > 1`` the groups are the dimensions of a ``D x S x T`` device mesh
        (``init_device_mesh`` with the dimensions named ``data``, ``pipe`` and ``tensor``, their groups given
        ``timeout`` through the backend's options). With ``grid`` (``(d, q)``, ``d x q x q = tensor_parallel_size``:
        2D and 2.5D tensor parallelism) each tensor group is also a mesh of dimensions ``depth``, ``row`` and ``col``,
        its ranks in that order (``runtime/sharding/grid.py``).
        """
        probe = cls(rank, world_size, num_stages, tensor_parallel_size=tensor_parallel_size)  # checks the shape first
        if tensor_parallel_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            shape = (probe.num_groups, num_stages, tensor_parallel_size)
            names = ("data", "pipe", "tensor")
            override = _with_timeout(names, timeout)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)
            grid_mesh = None
            if grid is not None:
                d, q = grid
                dims = ("stage", "depth", "row", "col")  # (group, stage) outermost, as the job mesh's ranks run
                over = _with_timeout(dims, timeout)
                shape4 = (shape[0] * num_stages, d, q, q)
                whole = init_device_mesh(device_type, shape4, mesh_dim_names=dims, backend_override=over)
                grid_mesh = whole["depth", "row", "col"]
            return cls(
                rank,
                world_size,
                num_stages,
                mesh.get_group("pipe"),
                mesh.get_group("data") if probe.num_groups > 1 else None,
                tensor_parallel_size=tensor_parallel_size,
                tensor_group=mesh.get_group("tensor"),
                tensor_mesh=mesh["tensor"],
                data_mesh=mesh["data"],
                grid_mesh=grid_mesh,
            )
        pipeline_group = stage_group = None
        if world_size > 1:
            wait = timedelta(seconds=timeout)
            S, D = num_stages, world_size // num_stages
            for d in range(D):
                group = dist.new_group(list(range(d * S, (d + 1) * S)), timeout=wait)
                if d == probe.group_index:
                    pipeline_group = group
            for s in range(S):
                group = dist.new_group([d * S + s for d in range(D)], timeout=wait)
                if s == probe.stage:
                    stage_group = group
        return cls(rank, world_size, num_stages, pipeline_group, stage_group)
