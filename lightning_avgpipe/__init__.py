"""lightning_avgpipe: AvgPipe pipeline parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy, so ``Trainer(strategy="avgpipe")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_avgpipe.__about__ import __version__
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.cpu import share_cpu_threads
from lightning_avgpipe.plugin import AvgPipeStrategy, AvgPipeTuner, PipelineContractError
from lightning_avgpipe.schedules import Plan, build_plan, simulate, validate_plan

AvgPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AvgPipeStrategy",
    "AvgPipeTuner",
    "PipelineConfig",
    "PipelineContractError",
    "Plan",
    "__version__",
    "build_plan",
    "share_cpu_threads",
    "simulate",
    "validate_plan",
]
