"""The Lightning side: the strategy, the tuner callback, the module contract and the step bridge."""

from lightning_avgpipe.plugin.contract import PipelineContractError
from lightning_avgpipe.plugin.strategy import AvgPipeStrategy
from lightning_avgpipe.plugin.tuner import AvgPipeTuner

__all__ = ["AvgPipeStrategy", "AvgPipeTuner", "PipelineContractError"]
