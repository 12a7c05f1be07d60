"""What ``AvgPipeStrategy.reconfigure`` may change: a new M, N, k, averaging or schedule checked against the running job
before anything moves, and the line that says what it became."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_avgpipe.config import PipelineConfig, check_same_placement
from lightning_avgpipe.schedules.generate import placed_by, reads_k


def next_config(
    old: PipelineConfig,
    changes: dict[str, Any],
    num_groups: int | None,
    loss_scaling: bool = False,
    keep_optimizers: bool = False,
) -> PipelineConfig:
    """``old`` with ``changes`` (``PipelineConfig`` fields), or a ``ValueError`` naming the fix when the running job
    (``num_groups`` D once the pipeline exists, else ``None``) cannot take it: under loss scaling (16-mixed) only one
    model per stage, and with ``keep_optimizers`` one model before and after (its optimizer carries on)."""
    new = replace(old, **changes)
    check_same_placement(old, new)
    if num_groups is None:
        return new
    if loss_scaling and not new.one_model(num_groups):
        raise ValueError(
            f"reconfigure to num_pipelines={new.num_pipelines} with elastic averaging under precision='16-mixed': the "
            "loss scaler unscales one model per stage; use averaging='exact'."
        )
    if keep_optimizers and not (old.one_model(num_groups) and new.one_model(num_groups)):
        raise ValueError(
            f"reconfigure(keep_optimizers=True) from num_pipelines={old.num_pipelines} ({old.averaging}) to "
            f"num_pipelines={new.num_pipelines} ({new.averaging}) would make replicas with fresh optimizers: keep N, "
            "or use averaging='exact', whose one model keeps its optimizer."
        )
    return new


def describe(config: PipelineConfig, num_stages: int, num_groups: int) -> str:
    """The log line of a reconfigure."""
    return (
        f"AvgPipe: reconfigured to num_microbatches={config.microbatches_for(num_stages)}, "
        f"num_pipelines={config.num_pipelines}"
        + (f", averaging='{config.averaging}'" if config.num_pipelines * num_groups > 1 else "")
        + f", schedule={config.schedule!r}"
        + (f", advance_forwards={config.advance_forwards}" if reads_k(config.schedule) else "")
        + (f", {placed_by(config.schedule_costs)}" if config.schedule_costs is not None else "")
        + "."
    )
