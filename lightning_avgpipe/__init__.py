"""lightning_avgpipe: AvgPipe pipeline parallelism as a PyTorch Lightning strategy.

Importing the package registers the strategy, so ``Trainer(strategy="avgpipe")`` works whichever of Lightning
and this package is imported first (``_register.py``). The import itself stays light: it loads neither Lightning
nor torch. The names that need them (``AvgPipeStrategy``, ``AvgPipeTuner``, ``PipelineContractError``: Lightning;
``PipelineConfig``, ``share_cpu_threads``: torch) load on first use (PEP 562), so the schedule tools, the
partitioner, the runtime and ``python -m lightning_avgpipe schedule`` never pay for Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_avgpipe import _register
from lightning_avgpipe.__about__ import __version__
from lightning_avgpipe.schedules import Plan, build_plan, simulate, validate_plan

if TYPE_CHECKING:
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.cpu import share_cpu_threads
    from lightning_avgpipe.plugin import AvgPipeStrategy, AvgPipeTuner, PipelineContractError
    from lightning_avgpipe.plugin.checkpoint.sharded import consolidate
    from lightning_avgpipe.runtime.build.pretrained import load_pretrained

_register.register_avgpipe()

# name -> module that defines it, imported on first access
_LAZY = {
    "AvgPipeStrategy": "lightning_avgpipe.plugin.strategy",
    "AvgPipeTuner": "lightning_avgpipe.plugin.tuner",
    "PipelineContractError": "lightning_avgpipe.plugin.contract",
    "PipelineConfig": "lightning_avgpipe.config",
    "share_cpu_threads": "lightning_avgpipe.cpu",
    "load_pretrained": "lightning_avgpipe.runtime.build.pretrained",
    "consolidate": "lightning_avgpipe.plugin.checkpoint.sharded",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AvgPipeStrategy",
    "AvgPipeTuner",
    "PipelineConfig",
    "PipelineContractError",
    "Plan",
    "__version__",
    "build_plan",
    "consolidate",
    "load_pretrained",
    "share_cpu_threads",
    "simulate",
    "validate_plan",
]
