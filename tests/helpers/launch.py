"""Start one OS process per rank as an external launcher would (torchrun-style env), with a hard timeout.

The launcher is ``tests/helpers/harness.py``, shared with the benchmarks; the tests import it from here.
"""

from __future__ import annotations

from tests.helpers.harness import ROOT, launch_ranks

__all__ = ["ROOT", "launch_ranks"]
