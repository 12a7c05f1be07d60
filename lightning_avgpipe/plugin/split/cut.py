"""The cut at setup: which of the model's layers are this rank's stages, decided once for every rank, made real
(a model built on the meta device) and put behind placeholders in the user's module (``plugin/split/stages.py``).

Every rank runs the same checks in the same order before the one collective (rank 0's partition, broadcast), so a
model that cannot be cut fails on every rank alike and none waits for a failed rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.plugin.contract import pipeline_layers
from lightning_avgpipe.plugin.split import tensor
from lightning_avgpipe.plugin.split.hints import holding_warning
from lightning_avgpipe.plugin.split.placeholders import Guard
from lightning_avgpipe.plugin.split.stages import (
    SplitModule,
    announce_shared,
    check_forward_of,
    check_layer_count,
    choose_partition,
    forward_sample,
    materialize_own,
    own_layers,
    shared_across_stages,
    split_module,
)
from lightning_avgpipe.runtime.build.init_record import InitRecord
from lightning_avgpipe.runtime.build.materialize import Shard, is_meta_module
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.failures.report import guarded
from lightning_avgpipe.runtime.recompute import check_matches
from lightning_avgpipe.runtime.sharding import fsdp
from lightning_avgpipe.runtime.sharding.tensor_parallel import grid_on_meta
from lightning_avgpipe.runtime.sync.ties import TiedWeights, tie_groups
from lightning_avgpipe.schedules.chunks import stages_of
from lightning_avgpipe.schedules.generate import placed_by, schedule_layout


@dataclass(frozen=True)
class CutInputs:
    """What the cut needs from the strategy besides its settings."""

    records: list[InitRecord]  # the meta-device build, replayed for this rank's stages
    device: torch.device
    guard: Guard  # the placeholders' switch
    check_forward: bool  # run the whole model once to check forward is the layers in order
    broadcast: Callable[..., Any]  # the strategy's broadcast(obj, src=0)


@dataclass(frozen=True)
class Cut:
    split: SplitModule
    ties: list[TiedWeights]  # weights this stage shares with others (tied embedding and head)
    whole_after_run: bool  # rank 0 gets the whole trained model back after a run (plugin/split/whole.py)


def cut_module(
    module: pl.LightningModule,
    config: PipelineConfig,
    topology: Topology,
    plan: dict[str, Any] | None,
    inputs: CutInputs,
) -> Cut:
    """Cut ``module`` into the schedule's ``S x v`` stages and keep this rank's (``docs/how-it-works.md``)."""
    layout = schedule_layout(config.schedule, topology.num_stages, config.stages_per_rank)
    layers, stages, v = pipeline_layers(module), layout.num_chunks, layout.v  # the model's stages: S x v
    check_layer_count(len(layers), stages, v)  # on every rank: none may wait in the broadcast for a failed rank 0
    check_matches(layers, config.activation_checkpointing)
    deferred = is_meta_module(module)  # built without memory: checked on the meta device, by shapes
    forward_note = None
    if inputs.check_forward:  # every rank checks its own whole copy, so every rank fails alike
        sample = forward_sample(module)
        if sample is not None:
            forward_note = check_forward_of(module, layers, sample, deferred)
    # decided on rank 0: "balanced" times the layers, and the ranks' timings would differ
    first = topology.rank == 0
    sizes = choose_partition(module, layers, config.partition, stages, v, deferred) if first else None
    sizes = inputs.broadcast(sizes, src=0)
    assert sizes is not None
    sizes = list(sizes)
    shared = shared_across_stages(module, layers, sizes)
    tensor.check_model(plan, module)
    with guarded("making the tied weights' groups (setup)"):
        ties = tie_groups(shared, topology, config.timeout, layout.rank_of)
    announce_shared(shared, layout.rank_of)
    mine = stages_of(topology.stage, topology.num_stages, v, layout.placement)
    if first:  # a rank holding far more than it runs (the model built whole): said once, for every rank
        S = topology.num_stages  # each place's rank in the first pipeline group (shard 0) stands for the others
        ranks = {topology.rank_of(0, s): stages_of(s, S, v, layout.placement) for s in range(S)}
        held = holding_warning(module, layers, sizes, ranks)
        if held is not None:
            rank_zero_warn(held)
    shards: list[Shard] = []
    if deferred:  # this rank's stages (and what lies outside every layer) made real, with one process's values
        owned = own_layers(module, layers, sizes, mine)  # split over the tensor group first: shards only
        if config.grid is None:
            shards = tensor.apply(owned, plan, topology, module, on_meta=True, sequence=config.sequence_parallel)
        else:  # the grid (2D, 2.5D): each layer converted by shapes, only this rank's blocks made real
            shards = grid_on_meta(owned, topology.grid_mesh, ties)
        if config.fsdp and topology.num_groups > 1:
            # ZeRO-2/3: sharded on the meta device, only this rank's shard made real (T > 1: over the mesh's data
            # dimension, on top of the tensor shards: each rank keeps its (data, tensor) piece of each weight)
            shards, ties = fsdp.shard_on_meta(owned, topology, config, inputs.device, ties, shards)
        materialize_own(module, layers, sizes, mine, inputs.records, inputs.device, forward_note, shards)
    # a model built whole comes back whole into rank 0's module after a run (plugin/split/whole.py)
    whole_after_run = not deferred and config.tensor_parallel_size == 1 and topology.num_stages > 1
    split = split_module(module, layers, sizes, mine, inputs.guard, whole_after_run and first)
    split.tensor_split = deferred and config.tensor_parallel_size > 1
    placed = f" ({v} per rank, {layout.placement} placement)" if v > 1 else ""
    rank_zero_info(
        f"AvgPipe: {stages} stages{placed}, layers per stage {sizes}, schedule={config.schedule}, "
        f"num_microbatches={config.microbatches_for(topology.num_stages)}"
        + (f", {placed_by(config.schedule_costs)}." if config.schedule_costs is not None else ".")
    )
    return Cut(split, ties, whole_after_run)
