"""StageReplicas: a stage's N copies tied to its reference by elastic averaging, apart from the step that runs them
(Lightning-free).

It owns what the copies are and how they are kept: the averaging (``algorithms/elastic.py``, or
``runtime/sharding/sharded_reference.py`` over D groups), the optimizer each step steps (``algorithms/optim.py``),
their batched execution (``algorithms/replicas.py``), the shared weights' gradients (``runtime/sync/ties.py``) and
their divergence from the reference. The step (``runtime/pipeline.py``) runs a plan over them: replica n's stage
function is ``fns[n]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.elastic import ElasticAveraging
from lightning_avgpipe.algorithms.optim import ElasticOptimizer, clone_optimizer
from lightning_avgpipe.algorithms.replicas import BatchedReplicas
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.runtime.comms import collectives
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.sharding.sharded_reference import ShardedReference
from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer
from lightning_avgpipe.runtime.sync.ties import TiedGradients, TiedWeights

# a copy of the stage's layers -> its stage functions, by the stages this rank holds (runtime/rank_stages.py)
Functions = Callable[[Sequence[nn.Module]], dict[int, Callable[[Any], Any]]]


@dataclass
class StageReplicas:
    """The stage's N replicas of its layers (one model, the reference itself, under exact averaging or N·D = 1):
    made by :meth:`build`."""

    layers: list[nn.Module]
    topology: Topology
    config: PipelineConfig
    elastic: ElasticAveraging
    params: list[nn.Parameter]  # every replica's (the reference's when N·D = 1): what a step's gradients reach
    tied: TiedGradients
    fns: list[dict[int, Callable[[Any], Any]]]  # replica n's stage functions, by stage
    batched: BatchedReplicas | None  # every replica in one vmapped call (replica_execution="batched")

    @classmethod
    def build(
        cls,
        layers: Sequence[nn.Module],
        topology: Topology,
        config: PipelineConfig,
        device: torch.device,
        ties: Sequence[TiedWeights],
        functions: Functions,
    ) -> StageReplicas:
        """``layers``' replicas under ``config`` on ``device``, sharing ``ties`` with other stages; ``functions``
        makes a copy's stage functions."""
        exact, top = config.exact, topology
        sharded = config.shard_optimizer_state and not exact and top.num_groups > 1
        elastic = (ShardedReference if sharded else ElasticAveraging)(  # exact: one model, the reference itself
            list(layers),
            1 if exact else config.num_pipelines,
            1 if exact else top.num_groups,
            alpha=config.elastic_alpha,
            group=top.stage_group,
            synchronous=config.synchronous_reference,
            device=device,
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            period=config.averaging_period,
            tensor_parallel_size=top.tensor_parallel_size,
        )
        batched = config.replica_execution == "batched" and not elastic.trivial
        return cls(
            layers=list(layers),
            topology=topology,
            config=config,
            elastic=elastic,
            params=elastic.all_replica_params(),
            tied=TiedGradients(tuple(ties), elastic, topology.stage),
            fns=[functions(copy) for copy in elastic.replicas],
            batched=BatchedReplicas(elastic.replicas) if batched else None,
        )

    def first_alone(self) -> StageReplicas:
        """Replica 0 run alone and sequentially: the same averaging and ties, its stage functions only."""
        return replace(self, fns=self.fns[:1], batched=None)

    def remake_functions(self, functions: Functions) -> None:
        """Every replica's stage functions anew (after a change of what they recompute)."""
        self.fns = [functions(copy) for copy in self.elastic.replicas]

    @property
    def copies(self) -> list[nn.Module]:
        """The stage's layers and every replica's copy of them."""
        return [*self.layers, *(m for replica in self.elastic.replicas for m in replica)]

    @property
    def uncounted(self) -> set[int]:
        """Ids of the shared weights' copies a global gradient norm must not count on this stage."""
        return self.tied.uncounted()

    def optimizer(self, user: Optimizer) -> Optimizer:
        """The optimizer to step: ``user`` itself when N·D = 1, else one clone of it per replica, stepped together
        and followed by the elastic update (``user`` must be built over the reference's parameters)."""
        elastic, top = self.elastic, self.topology
        if elastic.trivial:
            if self.config.shard_optimizer_state and top.num_groups > 1:  # one model over D groups: ZeRO-1
                return ShardedOptimizer(
                    user, elastic.reference_params, top.stage_group, top.stage_ranks, top.group_index
                )
            return user
        clones = [
            clone_optimizer(user, elastic.replica_params(n), elastic.reference_params)
            for n in range(elastic.num_replicas)
        ]
        return ElasticOptimizer(user, clones, elastic)

    def divergence(self) -> Tensor:
        """``(N,)``: ‖w_n − w_ref‖ / ‖w_ref‖ over all stages of this pipeline (collective over the pipeline).

        Waits for the previous step's reference update first (an overlapped all-reduce had the whole pipeline to
        hide behind).
        """
        self.elastic.wait()
        sums = torch.stack(self.elastic.divergence())  # (N, 2): ‖w_n - w_ref‖², ‖w_ref‖² on this stage
        return collectives.pipeline_divergence(self.topology, sums)
