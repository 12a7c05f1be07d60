"""``benchmarks/tensor_parallel.py --quick`` runs and prints its table: each mode's weights, activations, traffic and
step time per rank, sequence parallelism holding less for the backward than 1D on every rank."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_command

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_tensor_parallel_benchmark_quick(tmp_path: Path) -> None:
    out = run_command([sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--quick"], tmp_path)
    rows = re.findall(r"^1D \+ sequence parallelism\s+(\d)\s+[0-9.]+\s+[0-9.]+ \(\s*([0-9.]+)x\)", out, re.M)
    assert [r for r, _ in rows] == ["0", "1"], out[-3000:]
    assert all(float(ratio) < 1.0 for _, ratio in rows), rows  # activations: sequence parallelism over 1D
    assert "blocks on a shard of the sequence: [0, 1] of 2" in out, out[-3000:]
