"""Tuning in three pieces: measuring (``profiler``), predicting (``model``) and choosing (``search``).
(Design: docs/how-it-works.md#choosing-m-and-n.)

The model and the search take and give plain numbers; only the profiler touches torch modules, and none of
them imports Lightning (the ``AvgPipeTuner`` callback in ``plugin/tuner/callback.py`` is the glue).
"""

from lightning_avgpipe.tuning.model import PipelineProfile, Prediction, StageProfile, interpolate, predict
from lightning_avgpipe.tuning.search import NoFeasibleSettingError, TuningTable, search

__all__ = [
    "NoFeasibleSettingError",
    "PipelineProfile",
    "Prediction",
    "StageProfile",
    "TuningTable",
    "interpolate",
    "predict",
    "search",
]
