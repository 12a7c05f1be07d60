"""Pure units for ``lightning_avgpipe.schedules``: actions, generators, validator and simulator (no processes)."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest

from lightning_avgpipe.schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Kind,
    Plan,
    PlanError,
    build_plan,
    check_schedule_name,
    compute_order,
    max_advance_forwards,
    peak_stash,
    plan_errors,
    simulate,
    timeline_table,
    validate_plan,
)
from lightning_avgpipe.schedules.actions import B, F
from lightning_avgpipe.schedules.generate import lower

STAGES = range(1, 7)
UNITS = range(1, 13)
GRID = [(S, U) for S in STAGES for U in UNITS]


def _ks(U: int) -> range:
    return range(0, U + 2)  # k = U and U + 1 must both give the final plan (AFAB's order but on the last stage)


def _variants(U: int) -> list[tuple[str, int]]:
    """Every (schedule, k) of the grid; only ``advance`` reads k (test_1f1b_and_afab_ignore_advance_forwards)."""
    return [("afab", 0), ("1f1b", 0)] + [("advance", k) for k in _ks(U)]


def _replace_stage(plan: Plan, stage: int, actions: list[Action]) -> Plan:
    stages = list(plan.stages)
    stages[stage] = tuple(actions)
    return dataclasses.replace(plan, stages=tuple(stages))


# -- actions ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize(("stage", "unit"), [(0, 0), (1, 0), (3, 7), (12, 105)])
def test_action_str_parse_round_trip(kind: Kind, stage: int, unit: int) -> None:
    action = Action(stage, kind, unit)
    text = str(action)
    assert text == f"{stage}{kind.value}{unit}"
    assert Action.parse(text) == action
    assert Action.parse(f"  {text}\n") == action


def test_action_notation_matches_the_docs() -> None:
    assert str(F(1, 0)) == "1F0"
    assert Action.parse("0RB3") == Action(0, Kind.RECV_B, 3)
    assert Action.parse("2SF10") == Action(2, Kind.SEND_F, 10)
    assert repr(B(1, 2)) == "Action(1B2)"
    assert {k for k in Kind if k.is_compute} == {Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD}
    assert Action.parse("1I0") == Action(1, Kind.INPUT_GRAD, 0) and str(Action(1, Kind.WEIGHT_GRAD, 0)) == "1W0"


@pytest.mark.parametrize("text", ["", "F0", "1F", "1X0", "1f0", "-1F0", "1F0x", "1 F 0"])
def test_action_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="Cannot parse action") as info:
        Action.parse(text)
    assert "'1F0'" in str(info.value)  # shows an example of the expected form


# -- names --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("afab", "afab"),
        ("AFAB", "afab"),
        ("gpipe", "afab"),
        ("GPipe", "afab"),
        ("1f1b", "1f1b"),
        ("1F1B", "1f1b"),
        ("1-f-1-b", "1f1b"),
        ("advance", "advance"),
        ("Advance", "advance"),
    ],
)
def test_check_schedule_name_normalises_aliases(given: str, expected: str) -> None:
    assert check_schedule_name(given) == expected


def test_check_schedule_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        check_schedule_name("zigzag")
    message = str(info.value)
    assert "'zigzag'" in message
    for name in SCHEDULES:
        assert repr(name) in message
    with pytest.raises(ValueError, match="zigzag"):
        build_plan("zigzag", 2, 2)


# -- generators ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("S", "U"), GRID)
def test_every_generated_plan_validates(S: int, U: int) -> None:
    for name, k in _variants(U):
        for training in (True, False):
            plan = build_plan(name, S, U, k, training=training)
            assert validate_plan(plan) is plan  # raises PlanError listing every problem otherwise
            assert len(plan.stages) == S
            for s in range(S):
                compute = plan.compute(s)
                assert sorted(a.unit for a in compute if a.kind is Kind.FORWARD) == list(range(U))
                backwards = [a.unit for a in compute if a.kind is Kind.BACKWARD]
                assert sorted(backwards) == (list(range(U)) if training else [])


@pytest.mark.parametrize("S", range(1, 6))
def test_advance_plans_validate_and_finish_for_a_grid_of_m_n_k(S: int) -> None:
    """No deadlock, every send matched by a receive, on gloo (receive one ahead) and NCCL (just in time, batched)."""
    for M in range(1, 5):
        for N in range(1, 4):
            U = M * N
            for k in range(U + 2):
                for lookahead in (0, 1):
                    plan = validate_plan(build_plan("advance", S, U, k, recv_lookahead=lookahead), nccl=lookahead == 0)
                    sim = simulate(plan, 1.0, 2.0, latency=0.3)
                    assert sim.peak_stash[-1] == min(U, 1), (M, N, k)
                    assert list(sim.peak_stash) == peak_stash("advance", S, U, k), (M, N, k)


@pytest.mark.parametrize(("S", "U"), GRID)
def test_advance_spans_1f1b_to_afab_on_all_stages_but_the_last(S: int, U: int) -> None:
    one_f_one_b = build_plan("1f1b", S, U)
    afab = build_plan("afab", S, U)
    assert build_plan("advance", S, U, 0).stages == one_f_one_b.stages
    top = max_advance_forwards(S, U)
    for k in range(top, U + 2):  # k large: stages 0 .. S - 2 run AFAB's order, the last stage 1F1B's
        plan = build_plan("advance", S, U, k)
        for s in range(S - 1):
            assert plan.compute(s) == afab.compute(s), (k, s)
            assert plan.stages[s] == afab.stages[s], (k, s)  # lowering follows the compute order
        assert plan.compute(S - 1) == one_f_one_b.compute(S - 1), k
        assert plan.stages[S - 1] == one_f_one_b.stages[S - 1], k
    if top > 0:  # max_advance_forwards is the first k of the final plan
        assert build_plan("advance", S, U, top - 1).stages != build_plan("advance", S, U, top).stages
    # In between, stage 0 (which has the most room) differs from both ends (with one stage, the last, it is 1F1B).
    for k in range(1, U - S) if S > 1 else ():
        compute = build_plan("advance", S, U, k).compute(0)
        assert compute != one_f_one_b.compute(0) and compute != afab.compute(0), k


@pytest.mark.parametrize(("S", "U"), GRID)
def test_the_last_stage_runs_1f1b_for_every_k(S: int, U: int) -> None:
    last = build_plan("1f1b", S, U).compute(S - 1)
    for k in _ks(U):
        plan = build_plan("advance", S, U, k)
        assert plan.compute(S - 1) == last, k
        assert simulate(plan).peak_stash[S - 1] <= simulate(build_plan("1f1b", S, U)).peak_stash[S - 1] == min(U, 1)


def test_max_advance_forwards() -> None:
    assert [max_advance_forwards(1, U) for U in (1, 2, 8)] == [0, 0, 0]  # one stage: the last, always 1F1B
    assert [max_advance_forwards(2, U) for U in (1, 2, 3, 8)] == [0, 0, 1, 6]
    assert max_advance_forwards(4, 8) == 6
    with pytest.raises(ValueError, match="num_units=0"):
        max_advance_forwards(2, 0)


def test_1f1b_and_afab_ignore_advance_forwards() -> None:
    for name in ("1f1b", "afab"):
        plan = build_plan(name, 3, 6, advance_forwards=4)
        assert plan.advance_forwards == 0
        assert plan.stages == build_plan(name, 3, 6).stages
    assert build_plan("advance", 3, 6, 4).advance_forwards == 4


def test_compute_order_warmup_counts() -> None:
    # S = 4, U = 6: 1F1B warms up with S - s - 1 forwards, advance with k more (but on the last stage), AFAB with all.
    # The first backward follows the warm-up forwards plus, when units are left, one steady-state forward.
    def forwards_before_first_backward(order: list[Action]) -> int:
        return next(i for i, a in enumerate(order) if a.kind is Kind.BACKWARD)

    assert [forwards_before_first_backward(compute_order("1f1b", 4, 6, s)) for s in range(4)] == [4, 3, 2, 1]
    assert [forwards_before_first_backward(compute_order("advance", 4, 6, s, 2)) for s in range(4)] == [6, 5, 4, 1]
    assert [forwards_before_first_backward(compute_order("afab", 4, 6, s)) for s in range(4)] == [6, 6, 6, 6]
    assert compute_order("1f1b", 2, 3, 1) == [F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2)]
    assert compute_order("1f1b", 2, 3, 0, training=False) == [F(0, 0), F(0, 1), F(0, 2)]


def test_lowering_posts_receives_one_compute_ahead_and_sends_right_after() -> None:
    assert lower(compute_order("1f1b", 3, 2, 1), 3) == [
        Action.parse(t) for t in "1RF0 1RF1 1F0 1SF0 1RB0 1F1 1SF1 1RB1 1B0 1SB0 1B1 1SB1".split()
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_stages=2, num_units=0), "num_units=0"),
        (dict(num_stages=2, num_units=4, advance_forwards=-1), "advance_forwards=-1"),
        (dict(num_stages=2, num_units=4, advance_forwards=1.5), "advance_forwards=1.5"),
    ],
)
def test_build_plan_rejects_bad_sizes(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_plan("advance", **kwargs)


def test_compute_order_rejects_a_stage_outside_the_pipeline() -> None:
    with pytest.raises(ValueError, match=r"stage=4 is outside \[0, 4\)"):
        compute_order("1f1b", 4, 8, 4)


@pytest.mark.parametrize("num_stages", [0, -1])
def test_build_plan_rejects_no_stages(num_stages: int) -> None:
    with pytest.raises(ValueError, match=f"num_stages={num_stages}"):
        build_plan("1f1b", num_stages, 4)


# -- simulator: exact values for uniform costs --------------------------------------------------------------------


def _peak_formula(name: str, S: int, U: int, k: int, s: int) -> int:
    if name == "afab":
        return U
    if name == "1f1b" or s == S - 1:  # no advance forwards on the last stage
        return min(U, S - s)
    return min(U, S - s + k)


@pytest.mark.parametrize(("S", "U"), GRID)
def test_peak_stash_matches_the_design_formulas(S: int, U: int) -> None:
    for name, k in _variants(U):
        sim = simulate(build_plan(name, S, U, k))
        assert list(sim.peak_stash) == [_peak_formula(name, S, U, k, s) for s in range(S)], (name, k)
        assert peak_stash(name, S, U, k) == list(sim.peak_stash), (name, k)  # the closed form
    assert simulate(build_plan("afab", S, U, training=False)).peak_stash == (0,) * S


@pytest.mark.parametrize(("S", "U"), GRID)
def test_uniform_costs_give_the_textbook_step_time_and_bubble(S: int, U: int) -> None:
    f, b = 1.0, 2.0
    for name, k in _variants(U):
        sim = simulate(build_plan(name, S, U, k), f, b)
        assert sim.step_time == pytest.approx((U + S - 1) * (f + b))
        assert sim.bubble_fraction == pytest.approx((S - 1) / (U + S - 1))
        assert sim.busy == pytest.approx([U * (f + b)] * S)
    eval_sim = simulate(build_plan("1f1b", S, U, training=False), f, b)
    assert eval_sim.step_time == pytest.approx((U + S - 1) * f)


@pytest.mark.parametrize(("f", "b"), [(2.0, 3.0), (3.0, 1.0), (1.0, 1.0)])
def test_step_time_formula_holds_for_other_uniform_costs(f: float, b: float) -> None:
    for name in ("afab", "1f1b", "advance"):  # the backward whole
        sim = simulate(build_plan(name, 4, 8, 2), f, b)
        assert sim.step_time == pytest.approx(11 * (f + b))


def test_events_do_not_overlap_and_follow_the_plan() -> None:
    plan = build_plan("advance", 4, 8, 2)
    sim = simulate(plan, [1.0, 1.5, 1.0, 0.5], [2.0, 2.0, 3.0, 1.0], latency=0.25)
    for s, events in enumerate(sim.events):
        assert [e.action for e in events] == plan.compute(s)
        for a, b in pairwise(events):
            assert a.end <= b.start + 1e-12
        assert all(e.end > e.start for e in events)
    assert sim.step_time == pytest.approx(max(events[-1].end for events in sim.events))
    assert sim.busy == pytest.approx([8 * 3.0, 8 * 3.5, 8 * 4.0, 8 * 1.5])


def test_timeline_table_draws_the_1f1b_timeline() -> None:
    rows = timeline_table(simulate(build_plan("1f1b", 2, 2), 1.0, 2.0)).splitlines()
    assert len(rows) == 3
    assert rows[1].split("|")[1].split() == "F0 F1 . . B0 B0 . B1 B1".split()
    assert rows[2].split("|")[1].split() == ". F0 B0 B0 F1 B1 B1 . .".split()


# -- simulator: links ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("S", "U"), [(1, 3), (2, 2), (3, 5), (4, 8), (6, 12)])
@pytest.mark.parametrize("latency", [0.5, 1.0])
def test_latency_slows_the_step(S: int, U: int, latency: float) -> None:
    base = (U + S - 1) * 3.0
    # AFAB pays the latency once per hop on the forward chain and once per hop on the backward chain.
    afab = simulate(build_plan("afab", S, U), latency=latency).step_time
    assert afab == pytest.approx(base + 2 * (S - 1) * latency)
    times = [simulate(build_plan("advance", S, U, k), latency=latency).step_time for k in _ks(U)]
    if S == 1:
        assert times == pytest.approx([base] * len(times))  # no links, nothing to pay
    else:
        assert simulate(build_plan("1f1b", S, U), latency=latency).step_time > base
        # Advance forwards hide latency: every extra early forward keeps or shortens the step, down to AFAB's.
        assert all(later <= earlier + 1e-9 for earlier, later in pairwise(times)), times
        assert times[-1] == pytest.approx(afab)
    # A scalar transfer cost is the same as latency.
    assert simulate(build_plan("afab", S, U), transfer_cost=latency).step_time == pytest.approx(afab)


def test_transfer_cost_applies_to_messages_leaving_each_stage() -> None:
    plan = build_plan("afab", 4, 8)
    base = simulate(plan).step_time
    # End stages send one way (on the critical path once); middle stages send both ways (twice).
    for s, hops in enumerate([1, 2, 2, 1]):
        costs = [0.0] * 4
        costs[s] = 2.0
        assert simulate(plan, transfer_cost=costs).step_time == pytest.approx(base + 2.0 * hops), s
    assert simulate(plan, transfer_cost=[0.0] * 4).step_time == base


@pytest.mark.parametrize("name", ["forward_cost", "backward_cost", "transfer_cost"])
def test_per_stage_costs_need_one_entry_per_stage(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} has 2 entries but the plan has 4 stages"):
        simulate(build_plan("1f1b", 4, 4), **{name: [1.0, 2.0]})


def test_per_stage_compute_costs_move_the_bottleneck() -> None:
    plan = build_plan("afab", 3, 6)
    slow_middle = simulate(plan, [1.0, 4.0, 1.0], [2.0, 2.0, 2.0])
    assert slow_middle.busy == pytest.approx([18.0, 36.0, 18.0])
    assert slow_middle.step_time > simulate(plan).step_time
    assert slow_middle.step_time >= max(slow_middle.busy)


# -- validator: broken plans are rejected with a message naming the problem ---------------------------------------


def _base() -> Plan:
    return build_plan("1f1b", 3, 4)


def _errors_of(plan: Plan) -> list[str]:
    errors = plan_errors(plan)
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    assert isinstance(info.value, ValueError)
    assert f"({len(errors)} problems)" in str(info.value)
    for e in errors:
        assert e in str(info.value)
    return errors


def test_rejects_a_missing_backward() -> None:
    plan = _base()
    plan = _replace_stage(plan, 1, [a for a in plan.stages[1] if a != B(1, 2)])
    assert "stage 1: missing 1B2" in _errors_of(plan)


def test_rejects_a_duplicated_forward() -> None:
    plan = _base()
    plan = _replace_stage(plan, 1, [*plan.stages[1], F(1, 0)])
    assert "stage 1: 1F0 appears twice" in _errors_of(plan)


def test_rejects_a_backward_before_its_forward() -> None:
    plan = _base()
    actions = list(plan.stages[2])
    i, j = actions.index(F(2, 0)), actions.index(B(2, 0))
    actions[i], actions[j] = actions[j], actions[i]
    assert "stage 2: 2B0 comes before 2F0" in _errors_of(_replace_stage(plan, 2, actions))


def test_rejects_a_receive_after_its_compute() -> None:
    plan = _base()
    actions = [a for a in plan.stages[1] if a != Action(1, Kind.RECV_F, 0)]
    actions.insert(actions.index(F(1, 0)) + 1, Action(1, Kind.RECV_F, 0))
    errors = _errors_of(_replace_stage(plan, 1, actions))
    assert "stage 1: 1F0 comes before 1RF0" in errors


def test_rejects_a_gradient_receive_before_its_forward() -> None:
    """The gradient buffer is shaped like the unit's output: it cannot be posted before that forward ran."""
    plan = _base()
    actions = [a for a in plan.stages[0] if a != Action(0, Kind.RECV_B, 0)]
    actions.insert(0, Action(0, Kind.RECV_B, 0))
    errors = _errors_of(_replace_stage(plan, 0, actions))
    assert "stage 0: 0RB0 comes before 0F0" in errors


@pytest.mark.parametrize("S", [2, 3, 4])
def test_one_unit_posts_gradient_receives_after_the_forward(S: int) -> None:
    plan = validate_plan(build_plan("1f1b", S, 1))
    for s in range(S - 1):
        acts = [str(a) for a in plan.stages[s]]
        assert acts.index(f"{s}F0") < acts.index(f"{s}RB0") < acts.index(f"{s}B0")


def test_rejects_a_send_before_its_compute() -> None:
    plan = _base()
    actions = [a for a in plan.stages[1] if a != Action(1, Kind.SEND_B, 3)]
    actions.insert(0, Action(1, Kind.SEND_B, 3))
    assert "stage 1: 1SB3 comes before 1B3" in _errors_of(_replace_stage(plan, 1, actions))


def test_rejects_swapped_activation_send_order() -> None:
    plan = _base()
    compute = plan.compute(0)
    i, j = compute.index(F(0, 0)), compute.index(F(0, 1))
    compute[i], compute[j] = compute[j], compute[i]
    broken = _replace_stage(plan, 0, lower(compute, 3))
    errors = _errors_of(broken)
    assert "activations 0->1: sent in order [1, 0, 2, 3], received in order [0, 1, 2, 3]" in errors


def test_rejects_swapped_gradient_receive_order() -> None:
    plan = _base()
    actions = list(plan.stages[0])
    i, j = actions.index(Action(0, Kind.RECV_B, 0)), actions.index(Action(0, Kind.RECV_B, 1))
    actions[i], actions[j] = actions[j], actions[i]
    errors = _errors_of(_replace_stage(plan, 0, actions))
    assert "gradients 1->0: sent in order [0, 1, 2, 3], received in order [1, 0, 2, 3]" in errors


def test_rejects_a_plan_that_deadlocks() -> None:
    # Stage 0 waits for unit 0's gradient before forwarding unit 1; stage 1 wants unit 1's activations before it
    # backwards unit 0. Channel orders agree, so only the simulation can tell.
    compute0 = [F(0, 0), B(0, 0), F(0, 1), B(0, 1)]
    compute1 = [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]
    plan = Plan("1f1b", 2, 2, 0, True, (tuple(lower(compute0, 2)), tuple(lower(compute1, 2))))
    errors = _errors_of(plan)
    assert len(errors) == 1
    assert "deadlocks" in errors[0]
    assert "stage 0 at 0B0" in errors[0] and "stage 1 at 1F1" in errors[0]
    with pytest.raises(DeadlockError):
        simulate(plan)


def test_rejects_an_action_on_the_wrong_stage() -> None:
    plan = _base()
    actions = [Action(0, Kind.FORWARD, 0) if a == F(1, 0) else a for a in plan.stages[1]]
    errors = _errors_of(_replace_stage(plan, 1, actions))
    assert "stage 1 holds action 0F0 of stage 0" in errors


def test_rejects_units_outside_the_plan_and_wrong_stage_counts() -> None:
    plan = _base()
    errors = _errors_of(_replace_stage(plan, 2, [*plan.stages[2], F(2, 4)]))
    assert "stage 2: 2F4 names unit 4 outside [0, 4)" in errors
    short = dataclasses.replace(plan, stages=plan.stages[:2])
    assert _errors_of(short) == ["plan has 2 stage lists for num_stages=3"]


def test_rejects_backwards_in_an_eval_plan_and_comms_on_the_wrong_side() -> None:
    plan = build_plan("1f1b", 2, 2, training=False)
    errors = _errors_of(_replace_stage(plan, 1, [*plan.stages[1], B(1, 0)]))
    assert "stage 1: unexpected 1B0" in errors
    train = build_plan("1f1b", 2, 2)
    errors = _errors_of(_replace_stage(train, 0, [Action(0, Kind.RECV_F, 0), *train.stages[0]]))
    assert "stage 0: unexpected 0RF0" in errors


# -- NCCL semantics -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["afab", "1f1b", "advance"])
@pytest.mark.parametrize("S", [2, 3, 4, 6])
def test_just_in_time_coalesced_plans_never_deadlock_under_nccl(name: str, S: int) -> None:
    from lightning_avgpipe.schedules.nccl import nccl_deadlock

    for U in range(1, 10):
        for k in [0] if name != "advance" else range(U + 2):
            for training in (True, False):
                plan = build_plan(name, S, U, k, training, recv_lookahead=0)
                assert nccl_deadlock(plan, coalesce=True) is None, (name, S, U, k, training)
                validate_plan(plan, nccl=True)


def test_receives_posted_ahead_deadlock_under_nccl_and_the_validator_says_so() -> None:
    from lightning_avgpipe.schedules.nccl import nccl_deadlock

    plan = build_plan("1f1b", 2, 3)  # recv_lookahead=1: fine on gloo
    validate_plan(plan)
    problem = nccl_deadlock(plan, coalesce=False)
    assert problem is not None and "stage 0 at 0B0" in problem and "stage 1 at 1F1" in problem
    with pytest.raises(PlanError, match="NCCL deadlock.*recv_lookahead=0"):
        validate_plan(plan, nccl=True)
    # the same just-in-time plan without coalescing deadlocks too: the batches are what makes it safe
    assert nccl_deadlock(build_plan("1f1b", 2, 3, recv_lookahead=0), coalesce=False) is not None


def test_last_stage_receives_early_what_the_stage_before_sends_ahead_under_nccl() -> None:
    """Advance's last stage runs 1F1B's order while the stage before runs k more forwards ahead: lowered just in
    time without regard to that, their NCCL streams deadlock (the sender's activations queue before the gradient it
    waits for); the plan receives them in the batch that sends the gradient."""
    from lightning_avgpipe.schedules.nccl import nccl_deadlock

    plan = build_plan("advance", 2, 4, 2, recv_lookahead=0)
    assert plan.stages[1] == tuple(
        Action.parse(a) for a in "1RF0 1F0 1B0 1SB0 1RF1 1RF2 1RF3 1F1 1B1 1SB1 1F2 1B2 1SB2 1F3 1B3 1SB3".split()
    )
    validate_plan(plan, nccl=True)
    naive = _replace_stage(plan, 1, lower(plan.compute(1), 2, recv_lookahead=0))  # no upstream order
    problem = nccl_deadlock(naive, coalesce=True)
    assert problem is not None and "stage 0 at 0B0" in problem
    assert build_plan("advance", 2, 4, 2).stages[1] == tuple(lower(plan.compute(1), 2))  # gloo: one ahead, unchanged
