"""Where a rank's stages are when it runs several (``interleaved``, ``zbv``; ``schedules/chunks.py``): their layer
slices, their functions, their links to the ranks of the neighbouring stages, and which rank holds the loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.runtime.comms.p2p import Link
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.executor import StageExecutor
from lightning_avgpipe.schedules.chunks import Layout, stages_of
from lightning_avgpipe.schedules.generate import schedule_layout


@dataclass(frozen=True)
class ChunkLayout:
    """This rank's stages (``stages``, in stage order) and how many of its layers each holds (``sizes``)."""

    layout: Layout
    rank: int
    stages: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(
        cls, config: PipelineConfig, topology: Topology, num_layers: int, sizes: Sequence[int] | None
    ) -> ChunkLayout:
        layout = schedule_layout(config.schedule, topology.num_stages, config.stages_per_rank)
        v = layout.v
        stages = tuple(stages_of(topology.stage, topology.num_stages, v, layout.placement))
        if v == 1:
            return cls(layout, topology.stage, stages, (num_layers,))
        if sizes is None or len(sizes) != v or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(
                f"chunks={list(sizes) if sizes is not None else None}: with {v} stages per rank give the layer count "
                f"of each of this rank's stages {list(stages)}, at least 1 each, adding up to its {num_layers} layers."
            )
        return cls(layout, topology.stage, stages, tuple(sizes))

    @property
    def v(self) -> int:
        return self.layout.v

    @property
    def loss_rank(self) -> int:
        """The rank (in its pipeline) of the last stage, where the loss is: the last rank, or rank 0 under ZB-V."""
        return self.layout.rank_of(self.layout.num_chunks - 1)

    def functions(
        self, layers: Sequence[nn.Module], make: Callable[[int, int, Sequence[nn.Module]], Any]
    ) -> dict[int, Any]:
        """Stage -> ``make(stage, start, its slice of layers)`` (``layers``: the rank's, its stages' in stage order;
        ``start``: where the slice begins in them)."""
        out, start = {}, 0
        for stage, size in zip(self.stages, self.sizes):
            out[stage] = make(stage, start, list(layers)[start : start + size])
            start += size
        return out

    def links(self, topology: Topology, device: torch.device) -> dict[int, Link | None]:
        """Stage -> its link to the ranks of stages j - 1 and j + 1 where they are on other ranks (``None`` where both
        are on this rank); every stage's messages carry tags of their own."""
        layout, g, last = self.layout, topology.group_index, self.layout.num_chunks - 1
        out: dict[int, Link | None] = {}
        for j in self.stages:
            prev = topology.rank_of(g, layout.rank_of(j - 1)) if j > 0 and layout.crosses(j - 1, j) else None
            nxt = topology.rank_of(g, layout.rank_of(j + 1)) if j < last and layout.crosses(j, j + 1) else None
            name = f"stage {j} (rank {topology.rank})"
            out[j] = None if prev is None and nxt is None else Link(prev, nxt, device, name=name, stage=j, tagged=True)
        return out

    def executor(
        self, topology: Topology, device: torch.device, stage_fns: dict[int, Any], coalesce: bool = False
    ) -> StageExecutor:
        """The executor of this rank's stages, each with its function and link (``coalesce``: NCCL's batches)."""
        links = self.links(topology, device)
        parts = {j: (fn, links[j]) for j, fn in stage_fns.items()}
        first = stage_fns[self.stages[0]]
        return StageExecutor(
            topology.stage, topology.num_stages, first, None, coalesce, layout=self.layout, chunks=parts
        )
