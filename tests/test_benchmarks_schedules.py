"""Smoke test of benchmarks/schedules.py --quick: it runs end to end on 2 and 4 ranks and writes every row and field.

Timings are not asserted (a shared machine makes them noise); peak stash is, because the schedule decides it: 1F1B
stashes S units on stage 0, AFAB all M = 8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW_FIELDS = {
    "name",
    "link",
    "k",
    "step_s_median",
    "step_s",
    "comm_wait_s_median",
    "bubble_fraction_median",
    "peak_stash_bytes",
    "peak_stash_units",
    "peak_stash_bytes_max",
    "step_vs_afab",
    "step_vs_1f1b",
    "step_vs_afab_paired",
    "step_vs_1f1b_paired",
    "memory_vs_afab",
    "memory_vs_1f1b",
    "simulated_step_s",
}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_schedules_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "schedules.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "schedules.py"), "--quick", "--timeout", "100", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EMULATED" in proc.stdout  # the slow link is labelled as emulation
    summary = json.loads(out.read_text())
    assert summary["config"]["slow_link"]["emulated"] is True
    assert [w["world_size"] for w in summary["worlds"]] == [2, 4]
    for world in summary["worlds"]:
        S = world["world_size"]
        assert world["first_loss_ok"], world["first_losses"]
        assert set(world["links"]) == {"loopback", "slow"}
        for link, table in world["links"].items():
            rows = {row["name"]: row for row in table["rows"]}
            assert {"afab", "1f1b", "advance-auto"} <= set(rows), (S, link)
            for name, row in rows.items():
                assert ROW_FIELDS <= set(row), (S, link, name, ROW_FIELDS - set(row))
                assert row["step_s_median"] > 0 and len(row["peak_stash_bytes"]) == S, (S, link, name)
                assert 0.0 <= row["bubble_fraction_median"] <= 1.0, (S, link, name)
            auto = rows["advance-auto"]
            assert isinstance(auto["reason"], str) and auto["reason"], (S, link)
            assert "search_history" in auto and "settled" in auto, (S, link)
            # a property of the schedules, not of timing: 1F1B keeps fewer units in flight on stage 0 than AFAB
            assert rows["1f1b"]["peak_stash_bytes"][0] < rows["afab"]["peak_stash_bytes"][0], (S, link)
            assert rows["afab"]["peak_stash_units"][0] == pytest.approx(8, rel=0.05), (S, link)
            assert rows["1f1b"]["peak_stash_units"][0] == pytest.approx(S, rel=0.05), (S, link)
