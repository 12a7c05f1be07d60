"""Measuring layers for ``partition="balanced"``: the tuner's profiler (``tuning/profiler.py``) does it."""

from lightning_avgpipe.tuning.profiler import LayerCost, param_bytes, profile_layers

__all__ = ["LayerCost", "param_bytes", "profile_layers"]
