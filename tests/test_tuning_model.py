"""Pure units for the tuning cost model, the search, the report and the what-if projection (no processes)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lightning_avgpipe.__main__ import main
from lightning_avgpipe.algorithms.noise_scale import ELASTIC_BATCH_FACTOR
from lightning_avgpipe.schedules import build_plan, simulate
from lightning_avgpipe.tuning import (
    NoFeasibleSettingError,
    PipelineProfile,
    TuningTable,
    interpolate,
    predict,
    search,
)
from lightning_avgpipe.tuning.report import write_heatmap, write_report
from lightning_avgpipe.tuning.search import _k_candidates
from lightning_avgpipe.tuning.whatif import allreduce_seconds, project
from tests.helpers.tuning import profile, stage

MiB = 2**20


def uneven() -> PipelineProfile:
    """Three different stages (an embedding-like first stage, a heavy middle, a head)."""
    return PipelineProfile(
        [
            stage(f=1e-3, params=8e6, send=2e5),
            stage(f=3e-3, params=2e6, send=1e5, act=3e6),
            stage(f=2e-3, params=6e6, opt_s=5e-4, elastic_s=3e-4),
        ],
        batch_size=8,
        latency_s=1e-3,
        bandwidth=5e8,
        iteration_overhead_s=4e-3,
    )


# --- interpolate -------------------------------------------------------------------------------------------------


def test_interpolate_inside_beyond_one_point_and_clamp() -> None:
    pts = {2.0: 10.0, 4.0: 14.0, 8.0: 30.0}
    assert interpolate(pts, 3.0) == pytest.approx(12.0)  # inside the first segment
    assert interpolate(pts, 6.0) == pytest.approx(22.0)  # inside the second
    assert interpolate(pts, 4.0) == pytest.approx(14.0)  # at a measured point
    assert interpolate(pts, 16.0) == pytest.approx(62.0)  # past the top: the last segment's slope (4/unit)
    assert interpolate(pts, 1.0) == pytest.approx(8.0)  # below the bottom: the first segment's slope (2/unit)
    assert interpolate({4.0: 6.0}, 2.0) == pytest.approx(3.0)  # one point: proportional to the size
    assert interpolate({4.0: 6.0}, 8.0) == pytest.approx(12.0)
    assert interpolate({2.0: 1.0, 4.0: 9.0}, 1.0) == 0.0  # the extension would be -3: clamped at 0
    with pytest.raises(ValueError, match="at least one"):
        interpolate({}, 1.0)


# --- predict -----------------------------------------------------------------------------------------------------


def test_predict_matches_a_hand_made_simulation() -> None:
    prof = uneven()
    M, N = 4, 2  # b = 2: measured sizes, so the costs are the stages' own numbers
    pred = predict(prof, M, N)
    fwd = [0.002, 0.006, 0.004]
    bwd = [0.004, 0.012, 0.008]
    xfer = [2e5 * 2 / 5e8, 1e5 * 2 / 5e8, 0.0]  # activations downstream: stage s's output
    xfer_b = [0.0, 2e5 * 2 / 5e8, 1e5 * 2 / 5e8]  # gradients upstream: the size of stage s-1's output
    sim = simulate(
        build_plan("1f1b", 3, N * M), fwd, bwd, latency=1e-3, transfer_cost=xfer, backward_transfer_cost=xfer_b
    )
    update = max(N * (2e-4 + 1e-4), N * (2e-4 + 1e-4), N * (5e-4 + 3e-4))
    assert pred.pipeline_time == sim.step_time
    assert pred.update_time == update
    assert pred.step_time == sim.step_time + update + 4e-3
    assert pred.samples_per_sec == pytest.approx(N * 8 / pred.step_time)
    assert pred.bubble_fraction == sim.bubble_fraction
    acts = [1e6 * 2, 3e6 * 2, 1e6 * 2]
    params = [8e6, 2e6, 6e6]
    for s in range(3):
        w, o = params[s], 2 * params[s]
        static = N * (3 * w + o) + 2 * w  # N replicas (weights, grads, offsets, states) + reference + buffer
        assert pred.peak_bytes[s] == pytest.approx(static + sim.peak_stash[s] * acts[s], rel=1e-12)


def test_static_bytes_single_replica_versus_averaging() -> None:
    st = stage(params=10.0)  # w = 10, o = 20
    assert st.static_bytes(1) == 2 * 10 + 20  # the replica is the reference: weights, grads, one state
    assert st.static_bytes(2) == 2 * (3 * 10 + 20) + 2 * 10
    assert st.static_bytes(1, num_groups=2) == 1 * (3 * 10 + 20) + 2 * 10  # D > 1 averages even with N = 1
    # shard_optimizer_state over D = 2: elastic keeps half the reference and no flat buffer; one model half its state
    assert st.static_bytes(2, 2, sharded=True) == 2 * (3 * 10 + 20) + 10 / 2
    assert st.static_bytes(4, 2, exact=True) == 2 * 10 + 20
    assert st.static_bytes(4, 2, sharded=True, exact=True) == 2 * 10 + 20 / 2
    assert st.static_bytes(2, 1, sharded=True) == st.static_bytes(2)  # D = 1: nothing to shard over
    # the sharded reference sums and gathers a whole stage after the backward; nothing else holds more then
    assert st.update_bytes(2, 2, sharded=True) == 10
    assert st.update_bytes(2, 2) == st.update_bytes(2, 2, sharded=True, exact=True) == st.update_bytes(2, 1, True) == 0
    one = predict(profile(), 4, 1)
    assert one.update_time == pytest.approx(2e-4)  # N·D = 1: one optimizer step, no elastic update
    assert one.peak_bytes[0] == pytest.approx(2 * 4e6 + 8e6 + 4 * 1e6 * 2)  # stash 4 at b = 2 on stage 0


def test_more_microbatches_shrink_the_bubble() -> None:
    prof = profile(latency_s=0.0, bandwidth=math.inf)
    preds = [predict(prof, m, 1) for m in (1, 2, 4, 8)]
    bubbles = [p.bubble_fraction for p in preds]
    assert all(a > b for a, b in zip(bubbles, bubbles[1:])), bubbles
    assert bubbles[0] == pytest.approx(3 / 4)  # (S-1)/(M+S-1) with M = 1
    assert bubbles[-1] == pytest.approx(3 / 11)
    times = [p.pipeline_time for p in preds]
    assert all(a > b for a, b in zip(times, times[1:])), times  # linear costs: no per-unit overhead to pay


def test_predict_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="num_microbatches=0"):
        predict(profile(), 0, 1)
    with pytest.raises(ValueError, match="num_pipelines=0"):
        predict(profile(), 2, 0)


# --- search ------------------------------------------------------------------------------------------------------


def test_search_picks_the_most_samples_per_second() -> None:
    prof = profile()
    table = search(prof, num_pipelines=4)
    assert len(table.rows) == 4 * 4  # divisors of 8 times N = 1..4
    best = max(predict(prof, m, n).samples_per_sec for m in (1, 2, 4, 8) for n in (1, 2, 3, 4))
    assert table.choice is not None
    assert table.choice.samples_per_sec >= best * 0.995
    assert (table.choice.num_microbatches, table.choice.num_pipelines) == (2, 4)  # see test above: 186.5 samples/s
    assert table.row(2, 4) is table.choice
    assert "<- chosen" in table.format().splitlines()[1 + 4 * 3 + 1]  # rows sorted by (N, M): N=4, M=2


def test_search_ties_go_to_fewer_pipelines() -> None:
    # One stage, costs proportional to b, no updates, no overhead: every (M, N) gives the same samples/s.
    prof = PipelineProfile([stage(opt_s=0.0, elastic_s=0.0)], batch_size=8)
    table = search(prof, num_pipelines=[1, 2, 4], num_microbatches=[2, 4])
    rates = {r.samples_per_sec for r in table.rows}
    assert max(rates) == pytest.approx(min(rates))
    assert table.choice is not None
    assert (table.choice.num_pipelines, table.choice.num_microbatches) == (1, 2)


@pytest.mark.parametrize(
    "noise, keep, chosen", [(0.0, 4, 8), (0.02, 4, 8), (0.04, 4, 4), (0.5, 4, 4), (0.04, None, 8), (0.5, 2, 8)]
)
def test_the_users_setting_is_kept_within_the_profiles_timing_noise(
    noise: float, keep: int | None, chosen: int
) -> None:
    """M = 8 predicts 6.7% more samples/s than M = 4 here: where the profile's timings are that noisy (a rerun could
    swap them), the user's own M = 4 is kept, and said; a wider gap (M = 2: 26% behind) never is, nor is any M where
    the user set none."""
    prof = profile(latency_s=1e-3)
    prof.timing_noise = noise
    table = search(prof, num_microbatches=[1, 2, 4, 8], num_pipelines=1, keep_microbatches=keep)
    rate = {r.num_microbatches: r.samples_per_sec for r in table.rows}
    assert rate[8] / rate[4] == pytest.approx(1.067, abs=0.001) and rate[8] / rate[2] > 1.3
    assert table.choice is not None and table.choice.num_microbatches == chosen
    assert table.notes["tie_window"] == pytest.approx(min(0.10, max(0.005, 2 * noise)))
    said = (
        "Your own setting (M = 4, N = 1, 1f1b) was kept: it predicts 6.3% less than the best row (M = 8, N = 1, 1f1b)"
    )
    assert (said in table.notes["reason"]) == (chosen == 4)
    if chosen == 4:  # one comparison, both figures of it: the gap within the noise
        window = table.notes["tie_window"]
        assert f"a gap under the tie window of {window:.1%} (twice the profile's timing noise" in table.notes["reason"]
        assert 0.063 <= window


def test_memory_limit_excludes_settings() -> None:
    prof = profile()
    free = search(prof, num_pipelines=4)
    limit = 60 * MiB  # the unlimited choice (N=4) needs ~99 MiB
    assert max(free.choice.peak_bytes) > limit if free.choice else False
    table = search(prof, num_pipelines=4, memory_limit=limit)
    assert table.choice is not None and table.choice.feasible
    assert max(table.choice.peak_bytes) <= limit
    out = [r for r in table.rows if not r.feasible]
    assert out and all(max(r.peak_bytes) > limit for r in out)
    assert all(r.feasible for r in table.rows if max(r.peak_bytes) <= limit)
    assert all("MiB > limit 60.0 MiB" in r.why_not for r in out)
    assert table.choice.samples_per_sec == max(r.samples_per_sec for r in table.rows if r.feasible)


def test_no_feasible_setting_names_the_smallest_need_and_the_fix() -> None:
    prof = profile()
    need = min(max(predict(prof, m, 1).peak_bytes) for m in (1, 2, 4, 8))  # N=1 is the smallest
    with pytest.raises(NoFeasibleSettingError) as info:
        search(prof, memory_limit=10 * MiB)
    msg = str(info.value)
    assert f"{need / MiB:.1f} MiB" in msg
    assert "Raise memory_limit" in msg and "10.0 MiB" in msg
    assert "num_pipelines=1" in msg
    assert isinstance(info.value, ValueError)


def test_candidate_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"num_microbatches=\[3\].*divisor of the batch size 8"):
        search(profile(), num_microbatches=[3])
    with pytest.raises(ValueError, match=r"num_microbatches=0"):
        search(profile(), num_microbatches=0)
    with pytest.raises(ValueError, match=r"num_pipelines=0 must be at least 1"):
        search(profile(), num_pipelines=0)
    with pytest.raises(ValueError, match=r"num_pipelines=\[2, -1\]"):
        search(profile(), num_pipelines=[2, -1])


def test_advance_auto_picks_the_best_k() -> None:
    prof = profile(latency_s=4e-3)  # slow messages: early forwards pay
    table = search(prof, num_pipelines=2, schedule="advance", advance_forwards="auto")
    assert table.schedule == "advance"
    assert any(r.advance_forwards > 0 for r in table.rows)
    for r in table.rows:
        units = r.num_microbatches * r.num_pipelines
        assert r.advance_forwards >= 0
        options = [predict(prof, r.num_microbatches, r.num_pipelines, "advance", k) for k in _k_candidates(4, units)]
        assert r.step_time == min(p.step_time for p in options)
        assert r.step_time <= predict(prof, r.num_microbatches, r.num_pipelines, "1f1b").step_time + 1e-12


# --- JSON round trip and report ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bandwidth", [5e8, math.inf])
def test_json_round_trip_gives_identical_predictions(tmp_path: Path, bandwidth: float) -> None:
    prof = uneven()
    prof.bandwidth = bandwidth
    table = search(prof, num_pipelines=3, memory_limit=80 * MiB)
    path = table.write_json(tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert not list(tmp_path.glob("*.tmp"))
    back = PipelineProfile.from_dict(data["profile"])
    assert back == prof
    for row, saved in zip(table.rows, data["rows"]):
        again = predict(back, row.num_microbatches, row.num_pipelines, "1f1b", row.advance_forwards, 80 * MiB)
        assert again == row
        assert again.to_dict() == saved
    assert data["choice"] == table.choice.to_dict() if table.choice else False


def test_write_report_writes_json_and_png(tmp_path: Path) -> None:
    table = search(profile(), num_pipelines=4, memory_limit=60 * MiB, schedule="advance", advance_forwards="auto")
    assert any(not r.feasible for r in table.rows)
    paths = write_report(table, tmp_path / "out", stem="run")
    assert paths["json"] == tmp_path / "out" / "run.json"
    assert json.loads(paths["json"].read_text())["schedule"] == "advance"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in paths.values())
    pytest.importorskip("matplotlib")
    assert paths["png"] == tmp_path / "out" / "run.png"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_of_a_partial_table(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # The search stopped raising N: (M, N) cells that were never predicted are left blank, not an error.
    table = search(profile(), num_microbatches=[2, 8], num_pipelines=None, memory_limit=30 * MiB)
    assert {r.num_pipelines for r in table.rows} == {1, 2}
    partial = TuningTable(rows=table.rows[:-1], choice=table.choice, memory_limit=None, schedule="1f1b")
    png = write_heatmap(partial, tmp_path / "h.png")
    assert png is not None and png.stat().st_size > 1000


def test_the_heat_map_has_a_panel_per_schedule_and_marks_the_chosen_and_the_best() -> None:
    """Issue 33: cells showed zbh1's values under a title saying 1f1b, and the best row appeared nowhere. Each
    schedule has its own panel of its own rows; the chosen and the best rows are each in their schedule's panel."""
    from lightning_avgpipe.tuning.report import best_row, panels

    table = search(profile(), num_microbatches=[2, 4, 8], num_pipelines=1)
    faster = [dataclasses.replace(r, schedule="zbh1", samples_per_sec=r.samples_per_sec * 1.2) for r in table.rows]
    rows = table.rows + faster
    mixed = TuningTable(rows=rows, choice=table.choice, memory_limit=None, schedule="1f1b")
    shown = dict(panels(mixed))
    assert list(shown) == ["1f1b", "zbh1"]  # the configured schedule first
    assert all(r.schedule == name for name, cells in shown.items() for r in cells.values())
    best = best_row(mixed)
    assert best is not None and best.schedule == "zbh1" and shown["zbh1"][(best.num_microbatches, 1)] is best
    assert mixed.choice is not None and shown["1f1b"][(mixed.choice.num_microbatches, 1)] is mixed.choice


# --- what-if projection ------------------------------------------------------------------------------------------


def test_project_to_the_same_layout_predicts_the_same() -> None:
    prof = profile(iteration_overhead_s=3e-3, unit_overhead_s=4e-4, batch_fetch_s=1e-3)
    same = project(prof, 4)
    for m, n in [(1, 1), (2, 1), (4, 2), (8, 3)]:
        a, b = predict(prof, m, n), predict(same, m, n)
        assert b.step_time == pytest.approx(a.step_time, rel=1e-9)
        assert b.peak_bytes == pytest.approx(a.peak_bytes, rel=1e-9)
        assert b.samples_per_sec == pytest.approx(a.samples_per_sec, rel=1e-9)


def test_project_to_twice_the_stages_halves_each_stage() -> None:
    prof = uneven()
    twice = project(prof, 2 * prof.num_stages)
    assert twice.num_stages == 6
    for b in (1.0, 2.0, 8.0):
        total_f = sum(st.forward(b) for st in prof.stages)
        total_b = sum(st.backward(b) for st in prof.stages)
        assert twice.stages[0].forward(b) == pytest.approx(total_f / 6)
        assert twice.stages[5].backward(b) == pytest.approx(total_b / 6)
        # the sent bytes are the mean of the two profiled boundaries (stages 0 and 1), not divided
        assert twice.stages[3].sent(b) == pytest.approx((2e5 + 1e5) / 2 * b)
    assert sum(st.param_bytes for st in twice.stages) == pytest.approx(16e6)
    assert twice.stages[0].param_bytes == pytest.approx(16e6 / 6)
    assert twice.stages[0].optimizer_step_s == pytest.approx((2e-4 + 2e-4 + 5e-4) / 6)
    assert twice.stages[0].elastic_s == pytest.approx((1e-4 + 1e-4 + 3e-4) / 6)
    assert twice.iteration_overhead_s == prof.iteration_overhead_s  # D = 1: nothing added
    # identical stages: projecting S -> 2S halves each stage's compute (same total, twice the stages)
    even = profile()
    half = project(even, 8)
    assert half.stages[0].forward(2.0) == pytest.approx(even.stages[0].forward(2.0) / 2)
    assert half.stages[7].activations(2.0) == pytest.approx(even.stages[0].activations(2.0) / 2)


def test_project_with_groups_adds_the_allreduce() -> None:
    prof = profile(iteration_overhead_s=1e-3, sync_reference=True)
    lat, bw = 5e-5, 1e10
    four = project(prof, 8, num_groups=4, latency_s=lat, bandwidth=bw)
    w = 4 * 4e6 / 8
    expected = 2 * 3 / 4 * w / bw + 2 * 3 * lat
    assert allreduce_seconds(w, 4, lat, bw) == pytest.approx(expected)
    assert four.num_groups == 4 and four.latency_s == lat and four.bandwidth == bw
    assert four.reference_allreduce_s == pytest.approx(expected)
    assert four.iteration_overhead_s == pytest.approx(1e-3)  # the measured overhead is kept as it is
    one = project(prof, 8, num_groups=1, latency_s=lat, bandwidth=bw)
    assert one.reference_allreduce_s == 0.0
    p4, p1 = predict(four, 4, 1), predict(one, 4, 1)
    # waited for (sync_reference): the all-reduce, plus the elastic update that D > 1 needs even with N = 1
    assert p4.step_time - p1.step_time == pytest.approx(expected + (2e-4 + 1e-4) / 2 - 2e-4 / 2)
    assert p4.samples_per_sec == pytest.approx(4 * 8 / p4.step_time)
    # re-projecting to the same D gives the same all-reduce (the formula, not a subtraction of what was measured)
    assert project(four, 8, num_groups=4).reference_allreduce_s == pytest.approx(expected)


def test_overlapped_reference_allreduce_hides_behind_the_pipeline() -> None:
    base = dict(num_groups=2, latency_s=2e-3, bandwidth=1e9)
    short = PipelineProfile([stage() for _ in range(4)], batch_size=8, reference_allreduce_s=1e-3, **base)
    long = PipelineProfile([stage() for _ in range(4)], batch_size=8, reference_allreduce_s=10.0, **base)
    none = PipelineProfile([stage() for _ in range(4)], batch_size=8, **base)
    p_none, p_short, p_long = predict(none, 4, 1), predict(short, 4, 1), predict(long, 4, 1)
    assert p_short.step_time == pytest.approx(p_none.step_time)  # 1 ms hides behind the next pipeline
    assert p_long.step_time == pytest.approx(p_none.step_time + 10.0 - p_none.pipeline_time)  # what sticks out
    waited = PipelineProfile(
        [stage() for _ in range(4)], batch_size=8, reference_allreduce_s=1e-3, sync_reference=True, **base
    )
    assert predict(waited, 4, 1).step_time == pytest.approx(p_none.step_time + 1e-3)


def test_accumulation_spreads_the_update_over_k_iterations() -> None:
    once, every4 = profile(), profile(accumulate=4)
    a, b = predict(once, 4, 2), predict(every4, 4, 2)
    assert b.update_time == pytest.approx(a.update_time / 4)
    assert a.step_time - b.step_time == pytest.approx(a.update_time * 3 / 4)


def test_project_with_tensor_parallelism_splits_the_stage_and_adds_its_allreduces() -> None:
    """T = 4 over all of a stage: a quarter of its compute, weights and stash, plus the pairs' all-reduces."""
    from lightning_avgpipe.tuning.whatif import TensorParallel

    prof = profile()
    plain = project(prof, 4)
    lat, bw = 1e-5, 1e11
    tp = TensorParallel(size=4, fraction=1.0, allreduces=8, latency_s=lat, bandwidth=bw)
    four = project(prof, 4, tensor=tp)
    for b in (1.0, 2.0, 8.0):
        reduce = 8 / 4 * allreduce_seconds(plain.stages[0].sent(b), 4, lat, bw)
        assert four.stages[1].forward(b) == pytest.approx(plain.stages[1].forward(b) / 4 + reduce)
        assert four.stages[1].backward(b) == pytest.approx(plain.stages[1].backward(b) / 4 + reduce)
        assert four.stages[2].activations(b) == pytest.approx(plain.stages[2].activations(b) / 4)
    assert four.stages[0].param_bytes == pytest.approx(plain.stages[0].param_bytes / 4)
    assert four.stages[0].optimizer_state_bytes == pytest.approx(plain.stages[0].optimizer_state_bytes / 4)
    # half of the work split: (1 - 1/2 + 1/8) of it per rank, and T = 1 leaves the projection as it was
    half = project(prof, 4, tensor=TensorParallel(size=4, fraction=0.5))
    assert half.stages[0].forward(2.0) == pytest.approx(plain.stages[0].forward(2.0) * 0.625)
    same = project(prof, 4, tensor=TensorParallel(size=1, fraction=0.5, allreduces=8))
    assert same.stages[0].forward(2.0) == plain.stages[0].forward(2.0)
    with pytest.raises(ValueError, match="tensor_fraction=1.5"):
        TensorParallel(size=2, fraction=1.5)
    # with checkpointing too: the kept inputs are whole on every shard, the recomputed forward's all-reduces are paid
    both = project(prof, 4, tensor=tp, checkpointed_layers=8)
    reduce = 8 / 4 * allreduce_seconds(plain.stages[0].sent(2.0), 4, lat, bw)
    assert both.stages[1].activations(2.0) == pytest.approx(2 * plain.stages[1].sent(2.0))
    fwd = plain.stages[1].forward(2.0) / 4 + reduce
    assert both.stages[1].backward(2.0) == pytest.approx(plain.stages[1].backward(2.0) / 4 + reduce + fwd)


def test_project_with_activation_checkpointing_keeps_layer_inputs_and_recomputes() -> None:
    """Every layer checkpointed: a unit keeps one boundary-sized input per layer, and the backward runs the forward
    again."""
    prof = profile()
    plain = project(prof, 4)
    ac = project(prof, 4, checkpointed_layers=8)  # 2 layers per stage
    for b in (1.0, 8.0):
        assert ac.stages[0].activations(b) == pytest.approx(2 * plain.stages[0].sent(b))
        assert ac.stages[0].backward(b) == pytest.approx(plain.stages[0].backward(b) + plain.stages[0].forward(b))
    assert predict(ac, 4, 1).peak_bytes[0] < predict(plain, 4, 1).peak_bytes[0]
    assert predict(ac, 4, 1).step_time > predict(plain, 4, 1).step_time
    with pytest.raises(ValueError, match="checkpointed_layers=0"):
        project(prof, 4, checkpointed_layers=0)


def test_whatif_command_projects_tensor_parallelism(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tuning_json(tmp_path)
    base = ["whatif", "--profile", str(path), "--stages", "4"]
    assert main([*base, "--tensor-parallel-size", "2", "--tensor-allreduces", "8", "--checkpoint-layers", "8"]) == 0
    assert capsys.readouterr().out.startswith("what-if: 4 profiled stage(s) -> S=4, D=1, T=2, every layer checkpointed")
    with pytest.raises(SystemExit):
        main([*base, "--tensor-parallel-size", "0"])
    assert "--tensor-parallel-size 0" in capsys.readouterr().err


def test_project_rejects_bad_layouts() -> None:
    with pytest.raises(ValueError, match="num_stages=0"):
        project(profile(), 0)
    with pytest.raises(ValueError, match="num_groups=0"):
        project(profile(), 2, num_groups=0)
    with pytest.raises(ValueError, match="bandwidth=0"):
        project(profile(), 2, bandwidth=0)


# --- whatif command ----------------------------------------------------------------------------------------------


def _tuning_json(tmp_path: Path) -> Path:
    return search(profile(), num_pipelines=2).write_json(tmp_path / "tuning.json")


def test_whatif_command_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tuning_json(tmp_path)
    args = [
        "whatif",
        "--profile",
        str(path),
        "--stages",
        "8",
        "--groups",
        "4",
        "--latency-ms",
        "0.05",
        "--bandwidth-gbs",
        "10",
        "--num-pipelines",
        "3",
        "--memory-limit-mb",
        "40",
    ]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("what-if: 4 profiled stage(s) -> S=8, D=4, T=1, B=8, latency 0.05 ms, bandwidth 10 GB/s")
    assert lines[1].split()[:5] == ["M", "N", "avg", "k", "iter"]
    body = lines[2 : 2 + 4 * 3]
    assert [tuple(int(x) for x in line.split()[:2]) for line in body] == [
        (m, n) for n in (1, 2, 3) for m in (1, 2, 4, 8)
    ]
    assert sum("<- chosen" in line for line in body) == 1
    projected = project(profile(), 8, 4, 5e-5, 1e10)  # the command searches as tune does: goodput by default
    expected = search(projected, num_pipelines=3, memory_limit=40 * MiB, objective="goodput").choice
    assert expected is not None
    assert lines[-1].startswith(
        f"choice: num_microbatches={expected.num_microbatches} "
        f"num_pipelines={expected.num_pipelines}: {expected.samples_per_sec:.1f} samples/s"
    )


def test_whatif_command_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tuning_json(tmp_path)
    args = [
        "whatif",
        "--profile",
        str(path),
        "--stages",
        "2",
        "--num-microbatches",
        "2",
        "4",
        "--num-pipelines",
        "1",
        "2",
        "--schedule",
        "advance",
        "--report",
        str(tmp_path / "rep"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "advance_forwards=" in out.splitlines()[-2]
    data = json.loads((tmp_path / "rep" / "whatif.json").read_text())
    assert data["profile"]["stages"][0]["param_bytes"] == pytest.approx(2 * 4e6)
    assert {(r["num_microbatches"], r["num_pipelines"]) for r in data["rows"]} == {(2, 1), (4, 1), (2, 2), (4, 2)}


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--stages", "0"], "--stages 0: must be at least 1"),
        (["--stages", "2", "--groups", "0"], "--groups 0: must be at least 1"),
        (["--stages", "2", "--bandwidth-gbs", "0"], "--bandwidth-gbs 0.0: must be > 0"),
        (["--stages", "2", "--num-microbatches", "3"], "--num-microbatches: num_microbatches=[3]"),
        (["--stages", "2", "--advance-forwards", "x"], "--advance-forwards x: must be an int >= 0 or 'auto'"),
    ],
)
def test_whatif_command_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    path = _tuning_json(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["whatif", "--profile", str(path), *extra])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_whatif_command_missing_or_wrong_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(SystemExit):
        main(["whatif", "--profile", str(missing), "--stages", "2"])
    err = capsys.readouterr().err
    assert f"--profile {missing}: no such file" in err and "pass the JSON a tuning run wrote" in err
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        main(["whatif", "--profile", str(bare), "--stages", "2"])
    assert f"--profile {bare}: has no 'profile' object" in capsys.readouterr().err


def test_whatif_command_nothing_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tuning_json(tmp_path)
    assert main(["whatif", "--profile", str(path), "--stages", "2", "--memory-limit-mb", "1"]) == 1
    captured = capsys.readouterr()
    assert "Raise memory_limit" in captured.err and captured.out == ""


def test_whatif_takes_comma_lists_like_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _tuning_json(tmp_path)
    base = ["whatif", "--profile", str(path), "--stages", "4"]
    assert main([*base, "--num-microbatches", "2,4", "--num-pipelines", "1,2"]) == 0
    comma = capsys.readouterr().out
    assert main([*base, "--num-microbatches", "2", "4", "--num-pipelines", "1", "2"]) == 0
    assert capsys.readouterr().out == comma  # the same table either way
    with pytest.raises(SystemExit) as exc:
        main([*base, "--num-microbatches", "3"])
    assert exc.value.code == 2
    assert "leave the option out for all of them" in capsys.readouterr().err


# -- goodput --------------------------------------------------------------------------------------------------------
def test_goodput_is_samples_per_second_times_the_efficiency_at_the_noise_scale() -> None:
    p = profile()
    p.noise_scale = 40.0
    exact = predict(p, 4, 3, averaging="exact")
    elastic = predict(p, 4, 3, averaging="elastic")
    assert exact.efficiency == pytest.approx((40 + 8) / (40 + 24))
    assert elastic.efficiency == pytest.approx((40 + 8) / (40 + ELASTIC_BATCH_FACTOR * 24))
    for r in (exact, elastic):
        assert r.goodput == pytest.approx(r.samples_per_sec * r.efficiency)
    # one model: one optimizer step and no replicas, so it is never slower nor bigger than N replicas
    assert exact.update_time < elastic.update_time and max(exact.peak_bytes) < max(elastic.peak_bytes)
    assert predict(p, 4, 1).efficiency == 1.0


def test_the_elastic_options_set_their_fitted_factor() -> None:
    """λ follows the strategy's elastic options: the paper's rule, H = 4's fit, and an outer momentum at H = 1 that
    reached no target (efficiency 0); each says what it rests on."""
    from lightning_avgpipe.algorithms.noise_scale import OUTER_BATCH_FACTOR, PERIOD_BATCH_FACTOR, elastic_factor

    assert elastic_factor() == (ELASTIC_BATCH_FACTOR, "the paper's rule, fitted (±0.35)")
    assert elastic_factor(period=4)[0] == PERIOD_BATCH_FACTOR and "fitted at averaging_period=4" in elastic_factor(4)[1]
    assert "not fitted at this period" in elastic_factor(period=8)[1]
    assert elastic_factor(outer_lr=0.7, outer_momentum=0.9)[0] == OUTER_BATCH_FACTOR
    assert elastic_factor(period=8, outer_lr=0.7, outer_momentum=0.9) == (
        PERIOD_BATCH_FACTOR,
        "not fitted for this outer optimizer: the nearest fitted rule's",
    )
    p = profile()
    p.noise_scale = 40.0
    p.averaging_period = 4
    period = predict(p, 4, 3, averaging="elastic")
    assert period.efficiency == pytest.approx((40 + 8) / (40 + PERIOD_BATCH_FACTOR * 24))
    assert predict(p, 4, 3, averaging="exact").efficiency == pytest.approx((40 + 8) / (40 + 24))  # exact ignores them
    p.averaging_period, p.outer_lr, p.outer_momentum = 1, 0.7, 0.9
    outer = predict(p, 4, 3, averaging="elastic")
    assert outer.efficiency == 0.0 and outer.goodput == 0.0
    p.noise_scale = None  # no estimate makes every batch equally efficient, but not a rule that learns nothing
    assert predict(p, 4, 3, averaging="elastic").efficiency == 0.0
    again = PipelineProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert (again.averaging_period, again.outer_lr, again.outer_momentum) == (1, 0.7, 0.9)


def test_goodput_picks_n_1_when_the_noise_scale_is_small_and_says_so() -> None:
    p = profile()
    p.noise_scale = 2.0  # far below B = 8: a bigger batch mostly repeats what B already teaches
    table = search(p, num_pipelines=4, objective="goodput", averaging=("exact", "elastic"))
    assert table.choice is not None and table.choice.num_pipelines == 1
    best_more = max((r for r in table.rows if r.num_pipelines > 1), key=lambda r: r.goodput)
    assert best_more.samples_per_sec > table.choice.samples_per_sec  # N > 1 is faster per sample, and still loses
    reason = table.notes["reason"]
    assert reason.startswith("N = 1 is the right answer: no N > 1 pays at the measured noise scale B_noise = 2")
    assert reason in table.format()
    # the throughput objective, on the same predictions, takes the N > 1 that goodput turned down
    fast = search(p, num_pipelines=4, objective="throughput", averaging=("exact", "elastic"))
    assert fast.choice is not None and fast.choice.num_pipelines > 1


def test_goodput_takes_the_larger_batch_when_the_noise_scale_is_large() -> None:
    p = profile()
    p.noise_scale = 1e6  # far above every batch: per-sample progress barely drops with N
    table = search(p, num_pipelines=4, objective="goodput", averaging=("exact", "elastic"))
    c = table.choice
    assert c is not None and c.num_pipelines > 1 and c.averaging == "exact"
    assert c.efficiency > 0.99
    assert "with averaging='exact'" in table.notes["reason"] and "x the goodput of N = 1" in table.notes["reason"]


def test_report_json_and_console_carry_the_same_numbers(tmp_path: Path) -> None:
    p = profile()
    p.noise_scale = 30.0
    table = search(p, num_pipelines=3, objective="goodput", averaging=("exact", "elastic"))
    out = write_report(table, tmp_path)
    data = json.loads(out["json"].read_text())
    assert data["notes"]["objective"] == "goodput" and data["notes"]["reason"] == table.notes["reason"]
    assert data["profile"]["noise_scale"] == 30.0
    text = table.format()
    for row in data["rows"]:
        assert row["goodput"] == pytest.approx(row["samples_per_sec"] * row["efficiency"])
        line = f"{row['samples_per_sec']:>10.1f} {row['efficiency']:>6.3f} {row['goodput']:>9.1f}"
        assert line in text, line
    assert data["choice"]["averaging"] in ("exact", "elastic")


def test_no_noise_estimate_counts_every_batch_as_efficient_and_says_so() -> None:
    p = profile()
    assert p.noise_scale is None
    table = search(p, num_pipelines=2, objective="goodput", averaging=("exact",))
    assert all(r.efficiency == 1.0 for r in table.rows)
    assert "no noise-scale estimate" in table.notes["reason"]


def test_bad_objective_and_averaging_name_the_value() -> None:
    with pytest.raises(ValueError, match="objective='speed'"):
        search(profile(), objective="speed")
    with pytest.raises(ValueError, match="averaging=\\['mean'\\]"):
        search(profile(), averaging=["mean"])


def test_a_sharded_reference_peaks_at_its_update_when_the_activations_are_small() -> None:
    """With D = 2 and shard_optimizer_state, an elastic setting holds N replicas, a half reference and, after the
    backward, one stage's worth of weights for the update: the peak is the larger of that and the activations."""
    from dataclasses import replace

    small = profile(num_stages=1, act=1.0, params=4e6)  # activations negligible against the weights
    plain = replace(small, num_groups=2)
    sharded = replace(small, num_groups=2, shard_optimizer_state=True)
    w, o = 4e6, 8e6
    stash = predict(plain, 2, 2).peak_bytes[0] - (2 * (3 * w + o) + 2 * w)
    assert predict(plain, 2, 2).peak_bytes[0] == pytest.approx(2 * (3 * w + o) + 2 * w + stash)
    assert predict(sharded, 2, 2).peak_bytes[0] == pytest.approx(2 * (3 * w + o) + w / 2 + w)
    # exact averaging (ZeRO-1): half the optimizer state, no update transient
    assert predict(sharded, 2, 2, averaging="exact").peak_bytes[0] == pytest.approx(2 * w + o / 2 + stash)


def _split_profile(num_stages: int = 2) -> PipelineProfile:
    """Stages whose backward splits into I and W of equal cost (a forward 1 ms, I + W 2 ms), free links."""
    prof = profile(num_stages, latency_s=0.0, bandwidth=math.inf)
    for st in prof.stages:
        st.forward_s = {b: 1e-3 * b for b in (1.0, 2.0, 4.0, 8.0)}
        st.backward_s = {b: 2e-3 * b for b in st.forward_s}
        st.input_grad_s = {b: 1e-3 * b for b in st.forward_s}
        st.weight_grad_s = {b: 1e-3 * b for b in st.forward_s}
    return prof


def test_every_schedule_is_predicted_from_one_profile() -> None:
    """The split schedules run on I and W; the chunked ones on v chunks of the rank's cost: at S = 2, M = 4 the
    simulated bubbles order as the schedules promise, ZB-V at 1F1B's memory."""
    prof = _split_profile()
    rows = {name: predict(prof, 4, 1, name) for name in ("1f1b", "zbh1", "interleaved", "zbv")}
    assert rows["zbv"].stages_per_rank == rows["interleaved"].stages_per_rank == 2
    bubble = {name: r.bubble_fraction for name, r in rows.items()}
    assert bubble["zbv"] < bubble["zbh1"] < bubble["1f1b"] and bubble["interleaved"] < bubble["1f1b"]
    assert rows["zbv"].step_time < rows["zbh1"].step_time < rows["1f1b"].step_time
    assert max(rows["zbv"].peak_bytes) <= max(rows["1f1b"].peak_bytes) * 1.000001
    with pytest.raises(ValueError, match="did not time"):
        predict(profile(2), 4, 1, "zbh1")  # no I and W: the split cannot be predicted


def test_the_search_weighs_schedules_and_says_why() -> None:
    table = search(_split_profile(), [4], [1], schedules=["1f1b", "zbh1"])
    assert table.choice is not None and table.choice.schedule == "zbh1"
    assert "Schedule 'zbh1'" in table.notes["reason"] and "x '1f1b'" in table.notes["reason"]
    assert table.format().split()[0] == "schedule"  # a column where the rows' schedules differ


def test_whatif_projects_every_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``whatif --schedules all`` at S = 4, M = 8: every schedule's bubble and peak per rank, from a 2-stage profile."""
    path = search(_split_profile(), [4], [1]).write_json(tmp_path / "tuning.json")
    argv = ["whatif", "--profile", str(path), "--stages", "4", "--num-pipelines", "1", "--num-microbatches", "8"]
    assert main([*argv, "--schedules", "all"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:9]}
    assert set(rows) == {"afab", "1f1b", "advance", "zbh1", "zbadvance", "interleaved", "zbv"}
    bubble = {name: float(cells[9].rstrip("%")) for name, cells in rows.items()}
    assert bubble["zbv"] < bubble["zbh1"] < bubble["1f1b"]
    with pytest.raises(SystemExit):
        main([*argv, "--schedules", "zigzag"])
    assert "--schedules zigzag" in capsys.readouterr().err


def test_goodput_without_a_noise_estimate_keeps_the_users_batch() -> None:
    """No noise scale: every batch would count as equally efficient and the largest N would win on samples/s; the
    search keeps the user's N instead and says why. With an estimate, N is free again."""
    prof = _split_profile()
    prof.noise_scale = None
    table = search(prof, [4], [1, 2, 4], objective="goodput", averaging=["exact"])
    faster = max(table.rows, key=lambda r: r.samples_per_sec)
    assert faster.num_pipelines > 1  # what counting every batch as equally efficient would have chosen
    assert table.choice is not None and table.choice.num_pipelines == 1 and table.notes["kept_pipelines"] == 1
    assert "your own batch, kept" in table.notes["reason"]
    kept = search(prof, [4], [1, 2, 4], objective="goodput", averaging=["exact"], keep_pipelines=2)
    assert kept.choice is not None and kept.choice.num_pipelines == 2
    prof.noise_scale = 1e9  # measured, and huge: a larger batch is as efficient, so the faster N wins
    table = search(prof, [4], [1, 2, 4], objective="goodput", averaging=["exact"])
    assert table.choice is not None and table.choice.num_pipelines > 1 and "kept_pipelines" not in table.notes
