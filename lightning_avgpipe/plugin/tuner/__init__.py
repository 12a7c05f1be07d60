"""``AvgPipeTuner``, the Lightning side of the tuner (docs/tuning.md): the callback (``callback.py``) runs the tuner
(``run.py``) before ``fit`` trains, which measures the real pipeline (``measure.py``) and searches with
``tuning/``; between epochs it may re-decide (``retune.py``)."""

from lightning_avgpipe.plugin.tuner.callback import AvgPipeTuner

__all__ = ["AvgPipeTuner"]
