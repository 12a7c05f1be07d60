"""Property test: any generated plan validates, simulates without deadlock, and is NCCL-safe when batched."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_avgpipe.schedules import build_plan, max_advance_forwards, peak_stash, simulate, validate_plan
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
        assert list(sim.peak_stash) == peak_stash(schedule, stages, units, k)  # the closed form is the simulator's
        w = {"afab": units, "1f1b": 0, "advance": k}[schedule]
        for s, peak in enumerate(sim.peak_stash):
            if schedule == "afab":
                expected = units
            elif s == stages - 1:  # the last stage runs no advance forwards: 1F1B's stash
                expected = min(units, 1)
            else:
                expected = min(units, stages - s + w)
            assert peak == expected
    if schedule == "advance":
        # the last stage runs 1F1B's order; from max_advance_forwards on the plan no longer changes
        assert plan.compute(stages - 1) == build_plan("1f1b", stages, units, 0, training).compute(stages - 1)
        if k >= max_advance_forwards(stages, units):
            top = build_plan("advance", stages, units, max_advance_forwards(stages, units), training, lookahead)
            assert plan.stages == top.stages
    if lookahead == 0:
        assert nccl_deadlock(plan, coalesce=True) is None
