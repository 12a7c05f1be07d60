"""Which stage and pipeline group a rank holds, and the process groups that join them (docs/how-it-works.md#topology).

Rank ``r`` of a job of ``D x S`` ranks holds stage ``r % S`` of pipeline group ``r // S``. Two kinds of groups:
the pipeline group (the S ranks of one group: activations, gradients, the step's results) and the stage group
(the D ranks that hold one stage: the reference update is averaged over it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist


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

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"devices x num_nodes = {self.world_size} is not a multiple of num_stages={self.num_stages}; use a "
                f"number of devices that num_stages divides (for example "
                f"{self.num_stages * max(1, self.world_size // max(1, self.num_stages))}), or change num_stages."
            )

    @property
    def stage(self) -> int:
        return self.rank % self.num_stages

    @property
    def group_index(self) -> int:
        """This rank's pipeline group (its data-parallel index)."""
        return self.rank // self.num_stages

    @property
    def num_groups(self) -> int:
        """D, the pipeline groups: world size / stages."""
        return self.world_size // self.num_stages

    @property
    def pipeline_ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, stage 0 first."""
        start = self.group_index * self.num_stages
        return list(range(start, start + self.num_stages))

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def build(cls, rank: int, world_size: int, num_stages: int, timeout: float = 1800.0) -> Topology:
        """Make the pipeline and stage groups of a job whose default process group is up (collective).

        Every rank must create every group, in the same order, so each rank calls this with the same arguments.
        """
        probe = cls(rank, world_size, num_stages)  # checks the shape before any collective
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
