"""Several model chunks per rank: interleaved 1F1B (loop placement) and ZB-V (V placement, backward split) validate
for S from 2 to 6, M from 1 to 16 and v from 1 to 4 (also under NCCL's in-order streams), send only what crosses
ranks, keep ZB-V at 1F1B's memory, and shrink the simulated bubble."""

from __future__ import annotations

import pytest

from lightning_avgpipe.schedules import Kind, build_plan, plan_errors, simulate
from lightning_avgpipe.schedules.chunks import Layout, rank_of, stages_of
from tests.helpers.cli import schedule_output


def test_placements() -> None:
    assert [rank_of(j, 4, "loop") for j in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [rank_of(j, 4, "v") for j in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stages_of(1, 4, 2, "v") == [1, 6] and stages_of(1, 4, 3, "loop") == [1, 5, 9]
    layout = Layout(4, 2, "v")
    assert layout.num_chunks == 8 and not layout.crosses(3, 4) and layout.crosses(2, 3)


@pytest.mark.parametrize("S", range(2, 7))
def test_every_chunked_plan_validates(S: int) -> None:
    for U in range(1, 17):
        for name, vs in (("interleaved", (1, 2, 3, 4)), ("zbv", (2,))):
            for v in vs:
                plan = build_plan(name, S, U, stages_per_rank=v)
                assert plan_errors(plan) == [], (name, S, U, v)
                assert plan_errors(build_plan(name, S, U, training=False, stages_per_rank=v)) == []
                # NCCL's form: every pair of ranks posts its messages in one order, and the streams never stall
                nccl = build_plan(name, S, U, recv_lookahead=0, stages_per_rank=v)
                assert plan_errors(nccl, nccl=True) == [], (name, S, U, v)
                assert nccl.compute(0) == plan.compute(0)  # the same work, only the messages placed otherwise


@pytest.mark.parametrize(("name", "v"), [("interleaved", 2), ("interleaved", 3), ("zbv", 2)])
def test_only_what_crosses_ranks_is_sent(name: str, v: int) -> None:
    plan = build_plan(name, 4, 8, stages_per_rank=v)
    layout = plan.layout
    for r, actions in enumerate(plan.stages):
        assert all(layout.rank_of(a.stage) == r for a in actions)
        for a in actions:
            if a.kind is Kind.SEND_F:
                assert layout.crosses(a.stage, a.stage + 1)
            if a.kind is Kind.SEND_B:
                assert layout.crosses(a.stage - 1, a.stage)
    if name == "zbv":  # the turn of the V and the loss stay on the ranks
        assert not [a for a in plan.stages[3] if a.kind is Kind.SEND_F and a.stage == 3]
        assert not [a for a in plan.stages[0] if a.kind is Kind.SEND_F and a.stage == 7]


@pytest.mark.parametrize(("S", "U"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (6, 12)])
def test_zbv_beats_zbh1_beats_1f1b_at_1f1b_memory(S: int, U: int) -> None:
    """A chunk costs half a stage (F = 0.5, B = 1): the same model. ZB-V holds at most 1F1B's peak (2S chunks)."""
    f1b = simulate(build_plan("1f1b", S, U), 1.0, 2.0)
    zbh1 = simulate(build_plan("zbh1", S, U), 1.0, 2.0)
    zbv = simulate(build_plan("zbv", S, U), 0.5, 1.0)
    assert zbv.step_time < zbh1.step_time < f1b.step_time
    assert max(zbv.peak_stash) <= 2 * max(f1b.peak_stash)
    assert sum(zbv.busy) == pytest.approx(sum(f1b.busy))


def test_interleaving_divides_the_bubble_when_units_fill_the_ranks() -> None:
    base = simulate(build_plan("1f1b", 4, 4), 1.0, 2.0).bubble_fraction
    two = simulate(build_plan("interleaved", 4, 4, stages_per_rank=2), 0.5, 1.0).bubble_fraction
    four = simulate(build_plan("interleaved", 4, 4, stages_per_rank=4), 0.25, 0.5).bubble_fraction
    assert four < two < base


@pytest.mark.parametrize(
    ("schedule", "v", "match"),
    [("zbv", 3, "exactly 2 chunks"), ("1f1b", 2, "only 'interleaved' and 'zbv'"), ("interleaved", 0, ">= 1")],
)
def test_stages_per_rank_is_checked(schedule: str, v: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_plan(schedule, 2, 4, stages_per_rank=v)


def test_the_schedule_command_prints_zbv_and_its_bubble() -> None:
    out = schedule_output(
        "--schedule", "zbv", "--stages-per-rank", "2", "--stages", "2", "--microbatches", "4", "--actions"
    )
    assert "schedule=zbv stages=2 stages_per_rank=2 units=4 advance_forwards=0: step time 12.5, bubble 4.0%" in out
    assert "rank 0 | F0.0 F0.1" in out and " 3I0 " in out and " 0W3" in out


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_the_strategy_takes_chunked_schedules(schedule: str) -> None:
    from lightning_avgpipe import AvgPipeStrategy

    strategy = AvgPipeStrategy(schedule=schedule, partition=[1, 2, 1, 2], num_stages=2)
    assert strategy.config.chunks_per_rank == 2 and strategy.config.partition == (1, 2, 1, 2)
    with pytest.raises(ValueError, match="stages_per_rank=3 with schedule='zbv'"):
        AvgPipeStrategy(schedule="zbv", stages_per_rank=3)


def test_the_schedule_command_compares_every_schedule() -> None:
    """``schedule --compare``: one row per schedule at one model's costs, 1F1B the base, ZB-V the fastest here."""
    out = schedule_output("--compare", "--stages", "4", "--microbatches", "8")
    rows = {}
    for line in out.splitlines()[2:]:
        name, *rest = line.split()
        rows[name] = [t for t in rest if "=" not in t]  # step, vs 1f1b, bubble, peak (past "k=1", "v=2")
    assert set(rows) == {"afab", "1f1b", "advance", "zbh1", "zbadvance", "interleaved", "zbv"}
    assert rows["1f1b"][:2] == ["33.00", "1.000x"] and rows["zbh1"][0] == "27.00"
    assert min(rows, key=lambda name: float(rows[name][0])) == "zbv"


MEASURED = (13.5, 15.1, 8.5)  # one unit's F, I, W (ms) on the 8-block GPT (benchmarks/bubble.py, 2026-12-02)


@pytest.mark.parametrize("costs", [MEASURED, (1.0, 2.0, 1.0), (1.0, 0.5, 2.0)], ids=["measured", "slow-I", "slow-W"])
def test_plans_placed_by_measured_costs_validate(costs: tuple[float, float, float]) -> None:
    for S in (2, 3, 4, 6):
        for U in (1, 2, 5, 8, 16):
            for name, v in (("zbv", 2), ("interleaved", 2), ("interleaved", 3)):
                plan = build_plan(name, S, U, stages_per_rank=v, costs=costs)
                assert plan_errors(plan) == [], (name, S, U, v, costs)
                nccl = build_plan(name, S, U, recv_lookahead=0, stages_per_rank=v, costs=costs)
                assert plan_errors(nccl, nccl=True) == [], (name, S, U, v, costs)
                assert nccl.compute(0) == plan.compute(0)
                if name == "zbv":  # still 1F1B's memory
                    assert max(simulate(plan, 1.0, 2.0).peak_stash) <= 2 * S


@pytest.mark.parametrize("S", [2, 3, 4, 5, 6])
def test_every_positive_cost_set_gives_a_valid_plan_at_1f1b_memory(S: int) -> None:
    """Issue 33: attention-heavy costs (I >= 1.5 F, W <= 0.3 F) left every rank of a ZB-V plan waiting on another
    (S = 2, U >= 8). Over I/F 0.25-4, W/F 0.05-2 and U 1-16, both chunked schedules build, validate and simulate,
    ZB-V within 1F1B's memory (a rank keeps its last unit of room for its chunk nearest the loss where the
    greedy placement would fill it)."""
    for U in (1, 2, 5, 8, 13, 16):
        for i in (0.25, 1.5, 2.0, 4.0):
            for w in (0.05, 0.1, 0.3, 2.0):
                for name in ("zbv", "interleaved"):
                    plan = build_plan(name, S, U, stages_per_rank=2, costs=(1.0, i, w))
                    assert plan_errors(plan) == [], (name, S, U, i, w)
                    sim = simulate(plan, 1.0, i + w, weight_grad_cost=w if name == "zbv" else None)
                    assert sim.step_time > 0
                    if name == "zbv":
                        assert max(sim.peak_stash) <= 2 * S, (S, U, i, w, sim.peak_stash)


@pytest.mark.parametrize("U", [4, 8])
def test_a_zbv_plan_placed_by_its_costs_idles_less_at_those_costs(U: int) -> None:
    """I and W are seldom equal: placed by unit costs, ZB-V leaves slots a plan placed by the real ratio fills."""
    f, i, w = MEASURED
    unit = simulate(build_plan("zbv", 2, U), f / 2, (i + w) / 2, weight_grad_cost=w / 2)
    placed = build_plan("zbv", 2, U, costs=MEASURED)
    fitted = simulate(placed, f / 2, (i + w) / 2, weight_grad_cost=w / 2)
    assert fitted.step_time < 0.99 * unit.step_time, (fitted.step_time, unit.step_time)  # 2.4% at U = 4, 6% at 8
    assert placed.costs == MEASURED and "placed by F:I:W = 1:1.12:0.63" in str(placed)


def test_only_the_chunked_schedules_take_costs() -> None:
    from lightning_avgpipe import AvgPipeStrategy

    with pytest.raises(ValueError, match=r"schedule_costs=\(1.0, 1.0, 1.0\) with schedule='zbh1'.*fixed orders"):
        build_plan("zbh1", 2, 4, costs=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match=r"schedule_costs=.*with schedule='1f1b'.*Drop schedule_costs"):
        AvgPipeStrategy(schedule_costs=(1.0, 1.2, 0.6))
    with pytest.raises(ValueError, match=r"schedule_costs=\(1.0, -1.0, 0.6\) must be .*three positive numbers"):
        AvgPipeStrategy(schedule="zbv", schedule_costs=(1.0, -1.0, 0.6))
    with pytest.raises(ValueError, match=r"schedule_costs=\(1.0, 2.0\) must be"):
        AvgPipeStrategy(schedule="zbv", schedule_costs=(1.0, 2.0))
    assert AvgPipeStrategy(schedule="interleaved", schedule_costs=[2, 3, 1]).config.schedule_costs == (2.0, 3.0, 1.0)
