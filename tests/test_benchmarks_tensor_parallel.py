"""``benchmarks/tensor_parallel.py --quick`` runs and prints its table: 1D, 1D + sequence parallelism and 2D on 4
ranks, 1D and 2.5D on 8, every rank's row; 1D's bytes sent are the ring all-reduce's count with the group's size;
sequence parallelism, 2D and 2.5D hold less for the backward than 1D, 2.5D less than 2D; the formulas' ratios are
printed beside the measured ones, and each acceptance line says met or missed with its figure."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import run_command

ROOT = Path(__file__).resolve().parents[1]
CELL = r"\s+([0-9.]+) \(\s*([0-9.]+)x,\s+([0-9.]+)x\)"  # a figure (its ratio to 1D's, the formula's)
ROW = re.compile(
    r"^(1D \+ sequence parallelism|1D|2D \(q = 2\)|2\.5D \(q = 2 x d = 2\))\s+(\d)\s+(\d)"
    + CELL * 2
    + r"\s+([0-9.]+) \(\s*([0-9.]+)x\)\s+([0-9.]+) \(\s*([0-9.]+)x\)$",
    re.M,
)


@pytest.mark.timeout(300)
def test_tensor_parallel_benchmark_quick(tmp_path: Path) -> None:
    out = run_command([sys.executable, str(ROOT / "benchmarks" / "tensor_parallel.py"), "--quick"], tmp_path)
    rows: dict[tuple[str, int], dict[int, list[float]]] = {}
    for mode, ranks, rank, *cells in ROW.findall(out):
        rows.setdefault((mode, int(ranks)), {})[int(rank)] = [float(c) for c in cells]
    modes = [("1D", 4), ("1D + sequence parallelism", 4), ("2D (q = 2)", 4), ("1D", 8), ("2.5D (q = 2 x d = 2)", 8)]
    assert list(rows) == modes, out[-4000:]
    for (mode, ranks), by_rank in rows.items():
        assert sorted(by_rank) == list(range(ranks)), (mode, ranks, out[-4000:])
    # cells: weights MiB, ratio, formula; activations MiB, ratio, formula; sent MiB, ratio; step s, ratio
    for ranks in (4, 8):  # 1D sends 4 all-reduces of batch x sequence x width floats per block, each 2 (g-1)/g
        want = 2 * 4 * 2 * (ranks - 1) / ranks * 2 * 32 * 32 * 4 / (1 << 20)
        assert all(abs(c[6] - want) < 0.006 and c[1] == c[4] == 1.0 for c in rows[("1D", ranks)].values()), want
    sp, two, half = rows[modes[1]], rows[modes[2]], rows[modes[4]]
    for rank in range(4):
        assert sp[rank][4] < 1.0 and abs(sp[rank][4] - sp[rank][5]) < 0.1, sp[rank]  # activations
        assert sp[rank][7] > 1.0, sp[rank]  # sequence parallelism sends more than 1D
        assert two[rank][4] < 1.0 and abs(two[rank][4] - two[rank][5]) < 0.15, two[rank]
        assert abs(two[rank][1] - two[rank][2]) < 0.1, two[rank]  # weights: 1/4 of the matrices either way
    for rank in range(8):
        assert half[rank][4] < 1.0 and half[rank][3] < two[rank % 4][3], (half[rank], two[rank % 4])
        assert half[rank][1] > 1.5 and half[rank][2] > 1.5, half[rank]  # 1/q² = 1/4 of the weights, 1D's 1/8
    assert "blocks on a shard of the sequence: [0, 1] of 2" in out, out[-3000:]
    assert "blocks on the grid: 2D [0, 1], 2.5D [0, 1] of 2; left whole: none" in out, out[-3000:]
    checks = re.findall(r"^\((a|b|c)\) .*: (met|missed), ([0-9.]+)x \(formula .*\)$", out, re.M)
    assert [c[0] for c in checks] == ["a", "b", "b", "c"], out[-3000:]
    sp_worst = max(r[4] for r in sp.values())
    assert float(checks[0][2]) == pytest.approx(sp_worst, abs=0.006), (checks, sp_worst)
    assert checks[0][1] == ("met" if sp_worst <= 0.4 else "missed"), checks
