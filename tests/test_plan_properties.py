"""Property test: any generated plan validates, simulates without deadlock, and is NCCL-safe when batched."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_avgpipe.schedules import build_plan, simulate, validate_plan
from lightning_avgpipe.schedules.nccl import nccl_deadlock


@settings(max_examples=300, deadline=None)
@given(
    schedule=st.sampled_from(["afab", "1f1b", "advance"]),
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 8),
    pipelines=st.integers(1, 4),
    k=st.integers(0, 12),
    training=st.booleans(),
    lookahead=st.sampled_from([0, 1]),
)
def test_random_plans(
    schedule: str, stages: int, microbatches: int, pipelines: int, k: int, training: bool, lookahead: int
) -> None:
    units = microbatches * pipelines
    plan = validate_plan(build_plan(schedule, stages, units, k, training, lookahead), nccl=lookahead == 0)
    sim = simulate(plan, 1.0, 2.0, latency=0.1)
    assert sim.step_time > 0
    if training:
        w = {"afab": units, "1f1b": 0, "advance": k}[schedule]
        for s, peak in enumerate(sim.peak_stash):
            expected = units if schedule == "afab" else min(units, stages - s + w)
            assert peak == expected
    if lookahead == 0:
        assert nccl_deadlock(plan, coalesce=True) is None
