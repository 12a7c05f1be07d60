"""The pipeline runtime: point-to-point links between stages and the executor that runs a stage's plan."""

from lightning_avgpipe.runtime.executor import StageExecutor
from lightning_avgpipe.runtime.p2p import Link, OutputMeta, StageOutputError

__all__ = ["Link", "OutputMeta", "StageExecutor", "StageOutputError"]
