"""Stage partitioning: layers measured (``tuning/profiler.py``) apart from the split decided (``blockpartition``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_avgpipe.config import PARTITION_METHODS, PartitionSpec, check_partition
from lightning_avgpipe.partition import blockpartition
from lightning_avgpipe.tuning.profiler import LayerCost, param_bytes, profile_layers

__all__ = ["PARTITION_METHODS", "LayerCost", "PartitionSpec", "check_partition", "partition_layers", "profile_layers"]


def partition_layers(
    layers: Sequence[nn.Module],
    num_stages: int,
    partition: PartitionSpec = "balanced",
    sample: Any = None,
    stages_per_rank: int = 1,
) -> list[int]:
    """Number of consecutive layers per stage.

    Args:
        layers: the model's layers in order.
        num_stages: how many stages to split them into.
        partition: ``"balanced"`` (profiled forward+backward time; needs ``sample``), ``"parameters"``,
            ``"uniform"``, or an explicit list of layer counts.
        sample: an input for the first layer, used by ``"balanced"``; without one, ``"balanced"`` falls back to
            ``"parameters"``.
        stages_per_rank: v, when ``num_stages`` counts the model stages of ranks that hold v each (for messages).
    """
    check_partition(partition, len(layers), num_stages, stages_per_rank)
    if not isinstance(partition, str):
        return list(partition)
    if partition == "uniform":
        return blockpartition.uniform(len(layers), num_stages)
    if partition == "balanced" and sample is not None:
        costs = [c.compute for c in profile_layers(layers, sample)]
        return blockpartition.solve(costs, num_stages)
    return blockpartition.solve([float(param_bytes(layer)) for layer in layers], num_stages)
