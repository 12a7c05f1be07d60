"""The Lightning side: the strategy, the module contract and the bridge that runs user steps on the last stage."""

from lightning_avgpipe.plugin.contract import PipelineContractError
from lightning_avgpipe.plugin.strategy import AvgPipeStrategy

__all__ = ["AvgPipeStrategy", "PipelineContractError"]
