"""Stage partitioning: measuring layers (``profile``) apart from deciding the split (``blockpartition``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from torch import nn

from lightning_avgpipe.checks import is_int
from lightning_avgpipe.partition import blockpartition
from lightning_avgpipe.partition.profile import LayerCost, param_bytes, profile_layers

PartitionSpec = Union[str, Sequence[int]]
PARTITION_METHODS: tuple[str, ...] = ("balanced", "parameters", "uniform")

__all__ = ["PARTITION_METHODS", "LayerCost", "PartitionSpec", "check_partition", "partition_layers", "profile_layers"]


def check_partition(partition: PartitionSpec, num_layers: int | None = None, num_stages: int | None = None) -> None:
    """Raise a ``ValueError`` naming the fix when ``partition`` cannot describe ``num_layers`` over ``num_stages``."""
    if isinstance(partition, str):
        if partition not in PARTITION_METHODS:
            raise ValueError(
                f"partition={partition!r} is not a known method. Use one of {list(PARTITION_METHODS)} "
                "or a list with the number of layers of each stage, for example [3, 5]."
            )
        if num_layers is not None and num_stages is not None and num_layers < num_stages:
            raise ValueError(
                f"num_stages={num_stages} is more than the {num_layers} layers configure_pipeline() returns; "
                f"use at most {num_layers} stages or split the model into more layers."
            )
        return
    sizes = list(partition)
    if not sizes or not all(is_int(n, 1) for n in sizes):
        raise ValueError(f"partition={sizes!r} must list a positive layer count per stage, for example [3, 5].")
    if num_stages is not None and len(sizes) != num_stages:
        raise ValueError(
            f"partition={sizes} has {len(sizes)} entries but num_stages={num_stages}; give one layer count per stage."
        )
    if num_layers is not None and sum(sizes) != num_layers:
        raise ValueError(
            f"partition={sizes} sums to {sum(sizes)} layers but configure_pipeline() returns {num_layers}; "
            "make the counts add up to the number of layers."
        )


def partition_layers(
    layers: Sequence[nn.Module], num_stages: int, partition: PartitionSpec = "balanced", sample: Any = None
) -> list[int]:
    """Number of consecutive layers per stage.

    Args:
        layers: the model's layers in order.
        num_stages: how many stages to split them into.
        partition: ``"balanced"`` (profiled forward+backward time; needs ``sample``), ``"parameters"``,
            ``"uniform"``, or an explicit list of layer counts.
        sample: an input for the first layer, used by ``"balanced"``; without one, ``"balanced"`` falls back to
            ``"parameters"``.
    """
    check_partition(partition, len(layers), num_stages)
    if not isinstance(partition, str):
        return list(partition)
    if partition == "uniform":
        return blockpartition.uniform(len(layers), num_stages)
    if partition == "balanced" and sample is not None:
        costs = [c.compute for c in profile_layers(layers, sample)]
        return blockpartition.solve(costs, num_stages)
    return blockpartition.solve([float(param_bytes(layer)) for layer in layers], num_stages)
