"""Smoke test of benchmarks/tuner_accuracy.py: it runs end to end and reports every cell. No timing assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = (
    "time_error_median",
    "time_error_worst",
    "peak_error_median",
    "peak_error_worst",
    "spearman_samples_per_sec",
    "pick_fraction_of_best",
    "tuner_seconds",
    "tuner_trainer_wall_s",
    "sweep_wall_s",
    "sweep_timed_s",
    "tuner_fraction_of_sweep",
    "tuner_fraction_of_sweep_timed",
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tuner_accuracy_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "tuner_accuracy.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "tuner_accuracy.py"),
        "--quick",
        "--timeout",
        "80",
        "--out-dir",
        str(tmp_path / "out"),
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank correlation" in proc.stdout and "target pick" in proc.stdout
    report = json.loads(out.read_text())
    ms, ns = report["config"]["microbatches"], report["config"]["pipelines"]
    cells = {(c["num_microbatches"], c["num_pipelines"]): c for c in report["cells"]}
    assert set(cells) == {(m, n) for m in ms for n in ns}
    for key, c in cells.items():
        assert c["measured_iteration_s"] > 0 and c["predicted_iteration_s"] > 0, key
        assert c["measured_samples_per_sec"] > 0 and c["predicted_samples_per_sec"] > 0, key
        assert len(c["measured_peak_mib"]) == len(c["predicted_peak_mib"]) == 2, key
        assert all(v > 0 for v in c["measured_peak_mib"] + c["predicted_peak_mib"]), key
        assert c["configured_as"] == list(key), key  # the Trainer ran the setting it was meant to
    summary = report["summary"]
    for name in SUMMARY:
        assert math.isfinite(summary[name]), name
    assert summary["tuner_seconds"] > 0 and summary["sweep_wall_s"] > 0
    assert tuple(summary["pick"]) in cells and tuple(summary["best"]) in cells
    assert [t["applied"] for t in report["tuners"]] == summary["picks"]  # each choice is what its Trainer trained with
    assert 0 < summary["pick_fraction_of_best"] <= 1
    assert set(summary["targets"]) == {
        "median_time_error",
        "pick_fraction_of_best",
        "tuner_fraction_of_sweep",
        "repeatability",
    }
    # a second tuner ran back to back in every round: the run-to-run spread of its predicted iteration times
    assert len(summary["repeatability_per_round"]) == report["config"]["repeats"]
    assert all(0 <= v < 1 for v in summary["repeatability_per_round"])
    assert len(report["tuners"]) == report["config"]["repeats"] and summary["pick"] in summary["picks"]
    rows = report["tuners"][0]["table"]["rows"]
    assert {(r["num_microbatches"], r["num_pipelines"]) for r in rows} == set(cells)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tuner_load_benchmark_smoke(tmp_path: Path) -> None:
    """``benchmarks/tuner_load.py --quick``: a quiet tune and one beside a CPU hog, compared; no timing assertions."""
    out = tmp_path / "tuner_load.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tuner_load.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same choice in" in proc.stdout and "busy machine said in" in proc.stdout
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert 0 < run["cpu_share"] <= 1 and run["busy_said"] == (run["cpu_share"] < 0.85)
    assert 0 < run["choice_in_quiet_table"] <= 1 and run["ratio_change_max"] >= run["ratio_change_median"] >= 0
