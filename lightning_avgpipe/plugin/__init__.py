"""The Lightning side. Here: the strategy (``strategy.py``), the module contract (``contract.py``), every use of
Lightning's private state (``compat.py``) and what the tuner may touch of the strategy (``tuner_surface.py``). The
rooms, each saying in its ``__init__.py`` what it may import: ``split/`` (the model cut into stages), ``steps/``
(Lightning's step hooks on the pipeline), ``checkpoint/`` (saving and loading a split model), ``process/`` (one
process per device) and ``tuner/`` (``AvgPipeTuner``, which may import the strategy, ``steps/`` and
``checkpoint/resume.py``)."""

from lightning_avgpipe.plugin.contract import PipelineContractError
from lightning_avgpipe.plugin.strategy import AvgPipeStrategy
from lightning_avgpipe.plugin.tuner import AvgPipeTuner

__all__ = ["AvgPipeStrategy", "AvgPipeTuner", "PipelineContractError"]
