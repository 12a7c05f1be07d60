"""Plans with the backward split into the input gradient (I) and the weight gradient (W): ZB-H1 (``zbh1``) and the
advance forward with the split (``zbadvance``) validate for every S, M and k, keep the unsplit order of F and I, run
each W after its I, hold no more than the unsplit schedule's peak, and shrink the simulated bubble to ZB-H1's."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_avgpipe.schedules import (
    Action,
    Kind,
    build_plan,
    compute_order,
    max_advance_forwards,
    peak_stash,
    plan_errors,
    simulate,
)
from tests.helpers.cli import schedule_output

SPLIT_OF = {"zbh1": "1f1b", "zbadvance": "advance"}


def _ks(name: str, S: int, U: int) -> list[int]:
    return list(range(max_advance_forwards(S, U) + 2)) if name == "zbadvance" else [0]


@pytest.mark.parametrize("S", range(2, 7))
@pytest.mark.parametrize("name", sorted(SPLIT_OF))
def test_every_split_plan_validates(name: str, S: int) -> None:
    """S from 2 to 6, M from 1 to 16, every k: valid and deadlock-free (gloo's lowering)."""
    for U in range(1, 17):
        for k in _ks(name, S, U):
            plan = build_plan(name, S, U, k)
            assert plan_errors(plan) == [], (name, S, U, k)
            assert not plan_errors(build_plan(name, S, U, k, training=False))


@pytest.mark.parametrize("name", sorted(SPLIT_OF))
@pytest.mark.parametrize(("S", "U"), [(2, 1), (2, 4), (3, 7), (4, 8), (5, 3), (6, 16)])
def test_split_plans_finish_under_nccl_when_lowered_just_in_time(name: str, S: int, U: int) -> None:
    for k in sorted({0, 1, max_advance_forwards(S, U)}) if name == "zbadvance" else [0]:
        assert plan_errors(build_plan(name, S, U, k, recv_lookahead=0), nccl=True) == []


@pytest.mark.parametrize("name", sorted(SPLIT_OF))
@pytest.mark.parametrize(("S", "U"), [(2, 4), (3, 5), (4, 8), (6, 12)])
def test_forwards_and_input_gradients_keep_the_unsplit_order(name: str, S: int, U: int) -> None:
    for k in _ks(name, S, U):
        for s in range(S):
            split = compute_order(name, S, U, s, k)
            unsplit = compute_order(SPLIT_OF[name], S, U, s, k)
            kept = [a for a in split if a.kind is not Kind.WEIGHT_GRAD]
            assert kept == [Action(a.stage, Kind.INPUT_GRAD, a.unit) if a.kind is Kind.BACKWARD else a for a in unsplit]
            position = {(a.kind, a.unit): i for i, a in enumerate(split)}
            assert all(position[(Kind.INPUT_GRAD, u)] < position[(Kind.WEIGHT_GRAD, u)] for u in range(U))


@pytest.mark.parametrize("name", sorted(SPLIT_OF))
@pytest.mark.parametrize(("S", "U"), [(2, 4), (4, 4), (4, 8), (6, 16)])
def test_memory_stays_the_unsplit_schedules(name: str, S: int, U: int) -> None:
    """No stage holds more units than the unsplit schedule's largest peak, and on every stage the units forwarded
    and not yet past their I are at most the unsplit order's there (a unit past its I keeps only what W needs)."""
    for k in _ks(name, S, U):
        base = peak_stash(SPLIT_OF[name], S, U, k)
        sim = simulate(build_plan(name, S, U, k), 1.0, 2.0)
        assert max(sim.peak_stash) <= max(base)
        for s in range(S):
            live = peak = 0
            for a in compute_order(name, S, U, s, k):
                live += {Kind.FORWARD: 1, Kind.INPUT_GRAD: -1}.get(a.kind, 0)
                peak = max(peak, live)
            assert peak <= base[s]


@pytest.mark.parametrize(("S", "U"), [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 16), (6, 12)])
def test_zbh1_idles_s_minus_1_slots_where_1f1b_idles_three_times_that(S: int, U: int) -> None:
    """F = I = W = 1 (B = 2): 1F1B's step is 3 (U + S - 1), ZB-H1's 3 U + S - 1 (Qi et al.'s (S - 1)(F + I - W))."""
    assert simulate(build_plan("1f1b", S, U), 1.0, 2.0).step_time == 3 * (U + S - 1)
    sim = simulate(build_plan("zbh1", S, U), 1.0, 2.0)
    assert sim.step_time == 3 * U + S - 1
    assert sim.busy == (3.0 * U,) * S


@pytest.mark.parametrize(("S", "U"), [(2, 1), (3, 2), (4, 3), (5, 8)])
def test_split_plans_are_never_slower_than_their_unsplit_order(S: int, U: int) -> None:
    for name, base in SPLIT_OF.items():
        for k in _ks(name, S, U):
            for w in (0.5, 1.0, 1.5):
                split = simulate(build_plan(name, S, U, k), 1.0, 2.0, weight_grad_cost=w).step_time
                assert split <= simulate(build_plan(base, S, U, k), 1.0, 2.0).step_time + 1e-9


def test_the_simulator_splits_the_backward_cost_and_counts_waiting_weight_gradients() -> None:
    sim = simulate(build_plan("zbh1", 2, 4), 1.0, 3.0, weight_grad_cost=1.0)
    costs = {(e.action.kind, e.action.unit): e.end - e.start for stage in sim.events for e in stage}
    assert costs[(Kind.INPUT_GRAD, 0)] == 2.0 and costs[(Kind.WEIGHT_GRAD, 0)] == 1.0
    assert sim.peak_deferred == (1, 2)
    assert simulate(build_plan("1f1b", 2, 4)).peak_deferred == (0, 0)


def _with(plan: object, stage: int, actions: list[Action]) -> object:
    stages = list(plan.stages)  # type: ignore[attr-defined]
    stages[stage] = tuple(actions)
    return dataclasses.replace(plan, stages=tuple(stages))  # type: ignore[type-var]


def test_the_validator_rejects_a_weight_gradient_before_its_input_gradient() -> None:
    plan = build_plan("zbh1", 2, 2)
    acts = list(plan.stages[1])
    i, w = acts.index(Action(1, Kind.INPUT_GRAD, 0)), acts.index(Action(1, Kind.WEIGHT_GRAD, 0))
    acts[i], acts[w] = acts[w], acts[i]
    assert any("1I0 comes before 1W0" in e or "1W0 comes before 1I0" in e for e in plan_errors(_with(plan, 1, acts)))


def test_the_validator_rejects_half_a_split_and_a_backward_twice() -> None:
    plan = build_plan("zbh1", 2, 2)
    no_w = [a for a in plan.stages[0] if a != Action(0, Kind.WEIGHT_GRAD, 1)]
    assert "stage 0: missing 0W1" in plan_errors(_with(plan, 0, no_w))
    both = [*plan.stages[0], Action(0, Kind.BACKWARD, 1)]
    assert "stage 0: unit 1 has both 0B1 and a split backward" in plan_errors(_with(plan, 0, both))
    nothing = [a for a in plan.stages[0] if a.kind not in (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD) or a.unit != 0]
    assert "stage 0: missing 0B0" in plan_errors(_with(plan, 0, nothing))


def test_the_schedule_command_prints_the_split_plan_and_its_bubble() -> None:
    out = schedule_output("--stages", "4", "--microbatches", "8", "--schedule", "zbh1", "--actions")
    assert "schedule=zbh1 stages=4 units=8 advance_forwards=0: step time 27, bubble 11.1%" in out
    assert "stage 3 | .  .  .  F0 I0 F1 I1" in out
    assert " 1I0 " in out and " 1W0 " in out
