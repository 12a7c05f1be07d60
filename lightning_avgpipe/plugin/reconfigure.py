"""``AvgPipeStrategy.reconfigure``: a new M, N, k or averaging, applied to the pipeline, loader and optimizers."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.precision import PipelineMixedPrecision

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy


def reconfigure(strategy: AvgPipeStrategy, changes: dict[str, Any], keep_optimizers: bool) -> None:
    """Apply ``changes`` (``PipelineConfig`` fields) to ``strategy``; see :meth:`AvgPipeStrategy.reconfigure`."""
    old, strategy.config = strategy.config, replace(strategy.config, **changes)
    pipeline = strategy._pipeline
    if pipeline is not None:
        if isinstance(strategy.precision_plugin, PipelineMixedPrecision) and not pipeline.one_model(strategy.config):
            strategy.config = old
            raise ValueError(
                f"reconfigure to num_pipelines={changes.get('num_pipelines', old.num_pipelines)} with elastic "
                "averaging under precision='16-mixed': the loss scaler unscales one model per stage; use "
                "averaging='exact'."
            )
        if keep_optimizers and not (pipeline.one_model(old) and pipeline.one_model(strategy.config)):
            strategy.config = old
            raise ValueError(
                f"reconfigure(keep_optimizers=True) from num_pipelines={old.num_pipelines} ({old.averaging}) to "
                f"num_pipelines={strategy.num_pipelines} ({strategy.config.averaging}) would make replicas with fresh "
                "optimizers: keep N, or use averaging='exact', whose one model keeps its optimizer."
            )
        remade = pipeline.reconfigure(strategy.config)
        trainer = strategy.lightning_module.trainer if strategy.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            if remade or old.num_pipelines != strategy.num_pipelines:
                # A loader already grouped for the old N (trainer.estimated_stepping_batches sets it up early) is
                # set up again, and configure_optimizers then sees the new number of iterations per epoch.
                compat.reset_train_dataloader(trainer)
            if remade or (old.num_pipelines != strategy.num_pipelines and not keep_optimizers):
                strategy.setup_optimizers(trainer)
                _optimizers_to_device(strategy.optimizers, strategy.root_device)
    rank_zero_info(
        f"AvgPipe: reconfigured to num_microbatches={strategy.num_microbatches}, num_pipelines={strategy.num_pipelines}"
        + (f", averaging='{strategy.config.averaging}'" if strategy.num_pipelines * strategy.num_groups > 1 else "")
        + (f", advance_forwards={strategy.config.advance_forwards}" if strategy.config.schedule == "advance" else "")
        + "."
    )
