"""The pipeline runtime (Lightning-free). The step's core lives here: ``pipeline.py`` (the one step), ``controller.py``,
``executor.py``, ``units.py``, ``request.py``, ``trace.py``, ``deferred.py``, ``recompute.py``, ``streams.py`` and
``rank_stages.py``; it may import every room below. The rooms, each saying in its ``__init__.py`` what it may import:
``comms/`` (ranks, transfers, collectives), ``sync/`` (what keeps a weight's copies one), ``sharding/`` (tensors and
optimizer state split over ranks), ``build/`` (a stage built and loaded), ``files/`` (checkpoint files on disk) and
``failures/`` (failure handling, which imports nothing of the rest)."""

from lightning_avgpipe.runtime.comms.p2p import Link, OutputMeta, StageOutputError
from lightning_avgpipe.runtime.executor import StageExecutor

__all__ = ["Link", "OutputMeta", "StageExecutor", "StageOutputError"]
