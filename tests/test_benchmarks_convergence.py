"""benchmarks/convergence.py: the learning-rate grid logic, and a --quick smoke run (JSON structure, PNG written)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import spearman
from benchmarks.convergence_studies import METHODS, Data, Study
from benchmarks.convergence_train import lr_grid, pick, train_run

ROOT = Path(__file__).resolve().parents[1]


def _runs(final: float | None, loss: float = 1.0) -> list[dict[str, Any]]:
    return [{"final": final, "final_val_loss": loss}] * 3


def test_lr_grid_is_log_spaced_around_its_centre() -> None:
    assert lr_grid(1e-3, 2.0, 5) == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert lr_grid(1e-3, 2.0, 3) == [5e-4, 1e-3, 2e-3]


def test_pick_reports_the_edge_that_holds_the_best_lr() -> None:
    inside = {1e-3: _runs(0.90), 2e-3: _runs(0.95), 4e-3: _runs(0.93)}
    assert pick(inside, higher_is_better=True) == (2e-3, None)
    assert pick({1e-3: _runs(0.99), 2e-3: _runs(0.95), 4e-3: _runs(0.93)}, True) == (1e-3, "low")
    assert pick({1e-3: _runs(2.5), 2e-3: _runs(2.4), 4e-3: _runs(2.3)}, False) == (4e-3, "high")  # a loss: lower wins
    # a seed that diverged makes its lr the worst, whatever the other seeds did
    diverged = {1e-3: _runs(0.90), 2e-3: _runs(0.95), 4e-3: [{"final": None, "final_val_loss": None}] + _runs(0.99)}
    assert pick(diverged, True) == (2e-3, None)
    # equal accuracy: the lower validation loss wins
    assert pick({1e-3: _runs(0.9), 2e-3: _runs(0.95, 0.3), 4e-3: _runs(0.95, 0.2), 8e-3: _runs(0.9)}, True)[0] == 4e-3


def test_with_one_pipeline_every_method_is_the_same_training() -> None:
    """N = 1: same initial weights, same sample stream, same evaluation points, so the same numbers for all of them
    (with one replica the outer optimizer and the period have nothing to act on)."""
    study = Study(
        name="digits",
        metric="val_acc",
        target=0.5,
        batch=16,
        budget_samples=128,
        eval_every=32,
        lr_center=1e-3,
        lr_ratio=2.0,
        grid_points=1,
    )
    data = Data(study)
    runs = {m: train_run(data, m, 1e-3, seed=1, n=1) for m in METHODS}
    curves = {m: [(p["samples"], p["val_loss"], p["val_acc"]) for p in r["curve"]] for m, r in runs.items()}
    assert len(curves["pipe-B"]) == 5
    assert all(curves[m] == curves["pipe-B"] for m in METHODS), curves
    # with N = 2 every averaging differs from pipe-NB and from each other, at the same evaluation points
    two = {m: train_run(data, m, 1e-3, seed=1, n=2) for m in METHODS if m != "pipe-B"}
    samples = {m: [p["samples"] for p in r["curve"]] for m, r in two.items()}
    assert all(v == samples["pipe-NB"] for v in samples.values())
    finals = [r["curve"][-1]["val_loss"] for r in two.values()]
    assert len(set(finals)) == len(finals), finals


def test_spearman_and_the_goodput_check() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties share their rank
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # a constant side has no ranking


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_convergence_benchmark_quick_smoke(tmp_path: Path) -> None:
    out, png = tmp_path / "convergence.json", tmp_path / "convergence.png"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    script = ROOT / "benchmarks" / "convergence.py"
    # one study for CI time: the text and CNN studies run the digits' code path with other models and optimizers
    # (the full run has all three)
    cmd = [
        sys.executable,
        str(script),
        "--quick",
        "--datasets",
        "digits",
        "--json",
        str(out),
        "--png",
        str(png),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Verdict" in proc.stdout and "single-process" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out.read_text())
    assert doc["config"]["quick"] is True and doc["verdict"]
    assert set(doc["studies"]) == {"digits"}
    for name, study in doc["studies"].items():
        assert set(study["methods"]) == set(METHODS), name
        assert set(study["pipeline_step_s"]) == set(METHODS), name
        per_iter = {m: r["samples_per_iteration"] for m, r in study["methods"].items()}
        b, n = study["study"]["batch"], doc["config"]["pipelines"]
        assert per_iter == {m: b if m == "pipe-B" else n * b for m in METHODS}
        goodput = study["goodput"]
        assert set(goodput["rows"]) == set(METHODS) and "lambda_fits" in goodput
        for row in goodput["rows"].values():
            assert row["goodput_predicted"] == pytest.approx(row["samples_per_sec"] * row["efficiency_predicted"])
        if "spearman" in goodput:  # also over pipe-B, pipe-NB, avgpipe-N only (None: one side tied throughout)
            rho = goodput["spearman_tuner_rows"]
            assert rho is None or -1.0 <= rho <= 1.0
        for method, r in study["methods"].items():
            assert r["best_lr"] in [g["lr"] for g in r["grid"]], (name, method)
            assert len(r["grid"]) == 3 and r["seeds"] == 2 and len(r["runs"]) == 2, (name, method)
            assert r["final_metric"]["mean"] is not None, (name, method)
            for key in (
                "iterations_to_target",
                "samples_to_target",
                "single_process_s_to_target",
                "pipeline_s_to_target_projected",
            ):
                assert key in r, (name, method, key)
            for run in r["runs"]:
                curve = run["curve"]
                assert curve[0]["samples"] == 0 and curve[-1]["samples"] == study["study"]["budget_samples"]
                assert run["lr"] == r["best_lr"]
        # every method is evaluated at the same sample counts, and sees the same budget
        counts = {m: [p["samples"] for p in r["runs"][0]["curve"]] for m, r in study["methods"].items()}
        assert all(c == counts["pipe-B"] for c in counts.values()), name
