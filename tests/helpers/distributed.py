"""Run a function on several gloo processes with a hard timeout: a hang is a failed test, never a stuck suite.

The launcher is ``tests/helpers/harness.py``, shared with the benchmarks; the tests import it from here.
"""

from __future__ import annotations

from tests.helpers.harness import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
