"""Weights that layers on different stages share (a GPT's tied embedding and output head): the groups of ranks that
hold a copy, and the sum of the copies' gradients that keeps them one parameter (docs/contract.md).

Each stage that uses such a weight keeps a copy. Every step their gradients are summed over those stages (one
all-reduce per set of stages, Megatron-LM's embedding group) before the optimizer step, so every copy takes the same
step and they stay bit-identical; a global gradient norm counts each weight once, on the first stage that holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.algorithms.elastic import ElasticAveraging
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.shards import like, local


@dataclass(frozen=True)
class TiedWeights:
    """Weights this stage shares with other stages of its pipeline (a tied embedding and output head).

    Each stage that uses them keeps a copy; their gradients are summed over ``group`` (the ranks of this pipeline
    that hold a copy, Megatron's embedding group) before the optimizer step, so every copy takes the same step and
    stays bit-identical to the others: one parameter of the model, as in single-process training.
    """

    stages: tuple[int, ...]  # the ranks of the pipeline (stage positions) that hold a copy
    names: tuple[str, ...]  # their names in the module (a tied pair: "embed.weight = head.weight")
    params: tuple[nn.Parameter, ...]  # this stage's copies (the reference's)
    group: Any = None  # the process group of the stages' ranks in this pipeline


def tie_groups(
    shared: dict[tuple[int, ...], list[tuple[str, nn.Parameter]]],
    topology: Topology,
    timeout: float = 1800.0,
    rank_of: Callable[[int], int] | None = None,
) -> list[TiedWeights]:
    """A process group per set of stages that share weights, in every pipeline group, and this stage's part of them.

    ``shared``'s keys are model stages; ``rank_of`` maps one to the rank of the pipeline that runs it (with several
    stages per rank; by default stage s runs on rank s). Stages on one rank hold the weight once: there is nothing to
    sum, and a set of stages all on one rank makes no group.

    Collective: every rank makes every group, in the same order (``shared`` is the same on every rank: found on the
    whole model before the split, sorted by stages).
    """
    mine = []
    for model_stages, named in shared.items():
        stages = tuple(sorted({rank_of(s) if rank_of is not None else s for s in model_stages}))
        if len(stages) < 2:
            continue
        for d in range(topology.num_groups):  # under tensor parallelism, one group per shard: its stages' copies
            for t in range(topology.tensor_parallel_size):
                ranks = [topology.rank_of(d, s, t) for s in stages]
                group = dist.new_group(ranks, timeout=timedelta(seconds=timeout))
                if (d, t) == (topology.group_index, topology.tensor_rank) and topology.stage in stages:
                    names = tuple(name for name, _ in named)
                    mine.append(TiedWeights(stages, names, tuple(p for _, p in named), group))
    return mine


class TiedGradients:
    """Sums the shared weights' gradients of one stage's replicas over the stages that hold them."""

    def __init__(self, ties: Sequence[TiedWeights], elastic: ElasticAveraging, stage: int) -> None:
        self.ties = list(ties)
        self.elastic = elastic
        self.stage = stage
        position = {id(p): i for i, p in enumerate(elastic.reference_params)}
        for tie in self.ties:
            for name, p in zip(tie.names, tie.params):
                if id(p) not in position:  # replaced since the ties were found: split by tensor parallelism
                    raise ValueError(
                        f"{name!r} is shared between stages {list(tie.stages)} and tensor parallelism split it on "
                        f"stage {stage}: a weight tied across stages must stay whole on every shard (an embedding and "
                        "the head it is tied to). Leave it out of tensor_parallel_plan, or untie it."
                    )
        self.index = [[position[id(p)] for p in tie.params] for tie in self.ties]

    def copies(self, tie: int, replicas: int) -> list[nn.Parameter]:
        """Replicas ``0..replicas-1``'s copies of the weights of ``ties[tie]`` on this stage."""
        return [self.elastic.replica_params(n)[j] for n in range(replicas) for j in self.index[tie]]

    def before(self, replicas: int) -> list[list[Tensor | None]]:
        """The copies' gradients before a step (accumulated ones must not be summed over the stages again)."""
        return [
            [None if p.grad is None else p.grad.detach().clone() for p in self.copies(t, replicas)]
            for t in range(len(self.ties))
        ]

    def sum(self, replicas: int, before: list[list[Tensor | None]] | None, device: torch.device) -> None:
        """Sum the step's gradients of every shared weight over the stages that hold it (collective over each
        tie's group, in the same order on every rank)."""
        for t, tie in enumerate(self.ties):
            copies = self.copies(t, replicas)
            priors = before[t] if before is not None else [None] * len(copies)
            parts = []
            for p, prior in zip(copies, priors):  # FSDP's or a tensor shard: the local part (the same on each stage)
                g = local(p.grad).detach() if p.grad is not None else torch.zeros_like(local(p))
                parts.append((g - local(prior) if prior is not None else g).reshape(-1))
            flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tie.group)
            offset = 0
            for p, prior in zip(copies, priors):
                part = local(p)
                step = flat[offset : offset + part.numel()].view_as(part)
                offset += part.numel()
                summed = step if prior is None else local(prior) + step
                if p.grad is None:
                    p.grad = like(summed.to(p.dtype), p)
                else:
                    local(p.grad).copy_(summed)

    def uncounted(self) -> set[int]:
        """Ids of the copies a global gradient norm must not count here (counted on the tie's first stage)."""
        replicas = self.elastic.num_replicas
        return {
            id(p) for t, tie in enumerate(self.ties) if tie.stages[0] != self.stage for p in self.copies(t, replicas)
        }
