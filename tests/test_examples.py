"""The worked examples for real models (docs/guide.md#worked-examples) run as scripts and check themselves."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.test_launchers import ROOT, run

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_a_cnn_with_batchnorm_equals_accumulation_over_the_micro_batches(tmp_path: Path) -> None:
    """``examples/cnn_batchnorm.py --check``: 3 pipelined steps of a BatchNorm CNN equal one process with gradient
    accumulation over the same 4 micro-batches: every weight and running statistic, and num_batches_tracked = M x
    steps (BatchNorm updates once per micro-batch)."""
    out = run([sys.executable, str(ROOT / "examples" / "cnn_batchnorm.py"), "--check", "--steps", "3"], tmp_path)
    assert "check: OK" in out, out[-3000:]
    worst = float(re.search(r"max \|pipelined - one process .*?\| = ([0-9.e+-]+)", out).group(1))  # type: ignore[union-attr]
    assert worst < 1e-5
    assert "(M x steps = 12)" in out and "'0.2.num_batches_tracked': 12" in out
