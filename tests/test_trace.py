"""Timelines and per-step figures: a traced step matches the printed plan; activation memory follows the stash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_avgpipe.__main__ import main as cli
from lightning_avgpipe.runtime.trace import ActivationMeter, Span, chrome_trace, spans_from_simulation
from lightning_avgpipe.schedules import build_plan, simulate
from tests.helpers.equivalence import run_lightning


def _compute_order(trace: dict, tid: int) -> list[str]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["tid"] == tid and e["cat"] in "FB"]
    return [e["name"] for e in sorted(events, key=lambda e: e["ts"])]


@pytest.mark.slow
def test_traced_step_matches_the_plan_and_memory_follows_the_schedule(tmp_path: Path) -> None:
    base = {"num_microbatches": 4, "partition": [3, 3]}
    advance = {**base, "schedule": "advance", "advance_forwards": 1, "trace_dir": str(tmp_path / "traces")}
    results = run_lightning(tmp_path / "advance", 2, advance, steps=3)
    trace = json.loads((tmp_path / "traces" / "step2.json").read_text())
    assert (tmp_path / "traces" / "step2.png").stat().st_size > 10_000
    plan = build_plan("advance", 2, 4, 1)  # what `python -m lightning_avgpipe schedule ... --advance-forwards 1` prints
    for s in range(2):
        assert _compute_order(trace, s) == [f"{a.kind.value}{a.unit}" for a in plan.compute(s)]
    metrics = results[0]["metrics"]
    assert 0.0 <= metrics["avgpipe/bubble_fraction"] < 1.0 and metrics["avgpipe/comm_wait_s"] >= 0.0
    peaks = {"advance": metrics["avgpipe/peak_memory_mb/stage0"]}
    for schedule in ("afab", "1f1b"):
        out = run_lightning(
            tmp_path / schedule, 2, {**base, "schedule": schedule}, steps=2, trainer={"log_every_n_steps": 1}
        )  # the figures are measured on log steps
        peaks[schedule] = out[0]["metrics"]["avgpipe/peak_memory_mb/stage0"]
    # the logged peak is the stage's tensors (the same in the three runs) plus the activation stash: stage 0 keeps
    # M = 4 units under AFAB, S - s + k = 3 under advance(k=1) and S - s = 2 under 1F1B
    unit = peaks["afab"] - peaks["advance"]
    assert unit > 0, peaks
    assert peaks["advance"] - peaks["1f1b"] == pytest.approx(unit, rel=0.1), peaks
    assert peaks["1f1b"] > 2 * unit  # the weights and gradients are counted too


def test_activation_meter_counts_saved_tensors_per_unit() -> None:
    layer = nn.Linear(16, 16)
    meter = ActivationMeter(list(layer.parameters()))
    outs = []
    for u in range(3):
        with meter.unit(u):
            outs.append(torch.tanh(layer(torch.randn(8, 16))))
    per_unit = meter.peak / 3
    assert per_unit >= 8 * 16 * 4 * 2  # the Linear's input and tanh's output, not the weight
    meter.release(0)
    assert meter.current == pytest.approx(2 * per_unit)
    assert meter.peak == pytest.approx(3 * per_unit)


def test_simulated_timeline_uses_the_same_trace_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = simulate(build_plan("1f1b", 3, 4))
    trace = chrome_trace(spans_from_simulation(sim))
    assert _compute_order(trace, 2) == [f"{a.action.kind.value}{a.action.unit}" for a in sim.events[2]]
    assert chrome_trace([[Span("wait", 0, 0.0, 1.0)]])["traceEvents"][1]["dur"] == 1e6
    cli(["schedule", "--stages", "3", "--microbatches", "4", "--trace", str(tmp_path / "sim.json")])
    assert json.loads((tmp_path / "sim.json").read_text())["traceEvents"]
    assert (tmp_path / "sim.png").exists() and "trace written to" in capsys.readouterr().out
