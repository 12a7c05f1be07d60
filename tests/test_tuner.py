"""AvgPipeTuner: profiling leaves no trace, the choice is applied and reported, known costs give the right pick."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_avgpipe.runtime.trace import Span
from lightning_avgpipe.schedules import build_plan, simulate
from lightning_avgpipe.tuning.busy import BUSY_ROUNDS
from lightning_avgpipe.tuning.model import divisors
from lightning_avgpipe.tuning.profiler import Snapshot, fit_overhead, measure_link, unit_times
from lightning_avgpipe.tuning.search import search
from tests.helpers.equivalence import assert_matches, final_state, run_lightning
from tests.helpers.launch import ROOT, job_env, launch_ranks
from tests.helpers.tuning import profile


# -- the pieces, in process ----------------------------------------------------------------------------------------
def test_snapshot_restores_rng_grads_buffers_and_metrics() -> None:
    import numpy as np
    import torchmetrics

    layer = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params = list(layer.parameters())
    params[0].grad = torch.ones_like(params[0])
    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    snap = Snapshot(params, [layer], [metric])
    expected = (random.random(), float(np.random.rand()), torch.rand(1))
    snap.restore()  # the draws above are undone
    layer(torch.randn(8, 4)).sum().backward()  # changes grads and BatchNorm statistics
    metric.update(torch.tensor([100.0]))
    snap.restore()
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])
    assert torch.equal(params[0].grad, torch.ones_like(params[0]))
    assert params[1].grad is None
    for key, value in layer.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert float(metric.compute()) == pytest.approx(2.0)


def test_unit_times_charge_sends_to_the_compute_before_them() -> None:
    spans = [
        Span("F", 0, 0.0, 0.010),
        Span("send", 0, 0.010, 0.012),
        Span("wait", 1, 0.012, 0.050),
        Span("F", 1, 0.050, 0.060),
        Span("B", 0, 0.060, 0.080),
        Span("send", 0, 0.080, 0.083),
        Span("B", 1, 0.083, 0.103),
    ]
    fwd, bwd = unit_times([spans])
    assert fwd == pytest.approx(0.011)  # mean of 0.012 and 0.010; the wait is not charged
    assert bwd == pytest.approx(0.0215)  # mean of 0.023 and 0.020


def test_on_a_busy_machine_units_are_timed_by_the_cpu_time_charged_to_them() -> None:
    """Wall time stretched by other processes (the wait and the second forward), CPU time as the compute took it."""
    from lightning_avgpipe.runtime.trace import StepTrace
    from lightning_avgpipe.tuning.profiler import split_times

    spans = [
        Span("F", 0, 0.0, 0.010, cpu=0.008),
        Span("send", 0, 0.010, 0.012, cpu=0.002),
        Span("wait", 1, 0.012, 0.050, cpu=0.0001),
        Span("F", 1, 0.050, 0.080, cpu=0.010),
        Span("I", 0, 0.080, 0.090, cpu=0.006),
        Span("W", 0, 0.090, 0.120, cpu=0.004),
    ]
    assert unit_times([spans], cpu=True) == pytest.approx((0.010, 0.0))  # (0.008 + 0.002 + 0.010) / 2
    assert unit_times([spans]) == pytest.approx((0.021, 0.0))
    assert split_times([spans], cpu=True) == pytest.approx((0.006, 0.004))
    trace = StepTrace(0)  # each span is charged the process's CPU time since the one before it
    t0 = time.perf_counter()
    sum(range(300_000))
    trace.add("F", 0, t0, time.perf_counter())
    trace.add("wait", 1, time.perf_counter(), time.perf_counter())
    trace.finish()
    first, second = trace.spans
    assert first.cpu > 0.002 and second.cpu < first.cpu and trace.step_cpu >= first.cpu + second.cpu


def test_the_cpu_time_charged_to_a_span_is_the_stage_threads_own() -> None:
    """A thread beside the stage (gloo's, here one running matrix products, which free the GIL) is not charged to the
    stage's spans: the process's CPU time would charge it, the more the smaller the unit."""
    from lightning_avgpipe.runtime.trace import StepTrace

    stop = threading.Event()

    def beside() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a @ a

    thread = threading.Thread(target=beside, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        trace = StepTrace(0)
        own0, process0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
        end = t0 + 0.2
        while time.perf_counter() < end:
            sum(range(1000))
        trace.add("F", 0, t0, time.perf_counter())
        own, process = time.thread_time() - own0, time.process_time() - process0
    finally:
        stop.set()
        thread.join()
    if process < own + 0.05:
        pytest.skip(f"the thread beside got no core of its own ({process - own:.3f} s of CPU in 0.2 s)")
    assert trace.spans[0].cpu <= own + 0.002 and trace.spans[0].cpu < process - 0.04


@pytest.mark.parametrize("first, expected", [(0.4, 3 * BUSY_ROUNDS), (0.97, 3)])
def test_a_busy_first_probe_runs_more_rounds(monkeypatch: pytest.MonkeyPatch, first: float, expected: int) -> None:
    from lightning_avgpipe.tuning import busy

    probes = iter([first, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # only the first probe decides
    monkeypatch.setattr(busy, "probe_together", lambda group: next(probes))
    shares: list[float] = []
    ran = list(busy.rounds(["a", "b"], 3, shares, None, BUSY_ROUNDS * 3))
    assert ran == ["a", "b"] * expected and len(shares) == expected
    said = busy.busy_machine(0.4, "cpu", expected, 3)
    assert ("ran 6 rounds instead of 3" in said) == (expected == 6) and "timed by their CPU time" in said


def _rounds_worker(rank: int, world_size: int) -> int:
    """Pipeline groups {0, 2} and {1, 3}, as tensor-parallel shards of 2 stages have: group {0, 2} probes a quiet
    machine, {1, 3} a busy one. Returns how many rounds this rank ran."""
    import torch.distributed as dist

    from lightning_avgpipe.tuning import busy

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    busy.cpu_share = lambda: 0.95 if rank % 2 == 0 else 0.5
    ran = list(busy.rounds(["step"], 3, [], groups[rank % 2], BUSY_ROUNDS * 3))
    dist.barrier()  # a rank still in its rounds would leave this barrier waiting
    return len(ran)


@pytest.mark.timeout(120)
def test_every_rank_runs_the_same_rounds_whichever_group_probed_busy() -> None:
    """The busy decision is the least share over the whole job: a tensor-parallel peer in another pipeline group that
    ran 3 rounds while this one ran 6 would hang in the shards' collectives."""
    from tests.helpers.harness import run_distributed

    assert run_distributed(_rounds_worker, 4, timeout=90, what="busy rounds") == [BUSY_ROUNDS * 3] * 4


def test_timing_noise_is_the_median_relative_standard_error_of_a_sizes_step_compute() -> None:
    from lightning_avgpipe.tuning.busy import timing_noise

    def step(*computes: float) -> list[Span]:  # compute spans, each followed by an uncharged wait of 1 s
        spans, t = [], 0.0
        for u, d in enumerate(computes):
            spans += [Span("F", u, t, t + d, cpu=d / 2), Span("wait", u, t + d, t + d + 1.0)]
            t += d + 1.0
        return spans

    steady = [step(0.004, 0.006), step(0.005, 0.005), step(0.006, 0.004)]  # 10 ms of compute every step
    noisy = [step(0.009), step(0.011)]  # 9 and 11 ms: a standard error of 1 ms over 2 steps, 10% of 10 ms
    assert timing_noise([steady]) == pytest.approx(0.0, abs=1e-9) and timing_noise([noisy]) == pytest.approx(0.1)
    assert timing_noise([steady, noisy]) == pytest.approx(0.05)  # the median over sizes
    assert timing_noise([noisy], cpu=True) == pytest.approx(0.1)  # by CPU time: the same spread, halved times
    assert timing_noise([[step(0.01)]]) == 0.0  # one step: nothing to measure


def test_unit_times_are_means_so_a_slow_unit_counts() -> None:
    # three units of 2 ms and one of 10 ms: a step pays 16 ms, so 4 ms per unit (a median would say 2 ms)
    spans = [Span("F", u, 0.1 * u, 0.1 * u + d) for u, d in enumerate((0.002, 0.002, 0.010, 0.002))]
    fwd, bwd = unit_times([spans])
    assert fwd == pytest.approx(0.004) and bwd == 0.0


def test_a_round_the_machine_spent_elsewhere_is_outvoted_by_the_others() -> None:
    """Each step's mean per unit, the median over steps (profile rounds): one step at 3x (a burst of load, one unit
    a step as at the largest size) does not move the unit's time; within a step a slow unit still counts."""
    from lightning_avgpipe.tuning.profiler import split_times

    def one_unit(f: float, b: float) -> list[Span]:
        return [Span("F", 0, 0.0, f), Span("B", 0, f, f + b)]

    steps = [one_unit(0.010, 0.020), one_unit(0.030, 0.060), one_unit(0.011, 0.021)]
    assert unit_times(steps) == pytest.approx((0.011, 0.021))  # the mean would read 0.017 and 0.0337
    split = [
        [Span("I", 0, 0.0, i), Span("W", 0, i, i + w)] for i, w in ((0.004, 0.002), (0.012, 0.006), (0.005, 0.003))
    ]
    assert split_times(split) == pytest.approx((0.005, 0.003))
    two_units = [[Span("F", 0, 0.0, 0.002), Span("F", 1, 0.1, 0.110)]] * 3  # 2 ms and 10 ms in every step
    assert unit_times(two_units) == pytest.approx((0.006, 0.0))


def test_fit_overhead_recovers_a_line_and_clamps() -> None:
    a, c = fit_overhead([1, 4, 16], [0.002 + 0.0005 * u for u in (1, 4, 16)])
    assert a == pytest.approx(0.002) and c == pytest.approx(0.0005)
    assert fit_overhead([2, 8], [-0.01, -0.02]) == (0.0, 0.0)
    assert fit_overhead([4], [0.003]) == (0.003, 0.0)


def test_cpu_share_sees_a_process_competing_for_the_core() -> None:
    """Two busy processes on one core get about half of it each: the tuner's busy-machine probe reads that."""
    from lightning_avgpipe.tuning.busy import busy_machine
    from lightning_avgpipe.tuning.profiler import cpu_share

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    before = os.sched_getaffinity(0)
    core = min(before)
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.sched_setaffinity(0, {{{core}}}); t = time.time()\nwhile time.time() - t < 30: pass",
        ]
    )
    try:
        os.sched_setaffinity(0, {core})
        time.sleep(0.2)  # the hog is up and pinned
        share = cpu_share(0.5)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    assert share < 0.75, share
    assert "this machine is busy: a profiling process got" in busy_machine(share) and busy_machine(0.97) == ""
    assert "timed by their CPU time" in busy_machine(share, "cpu")


def test_measure_link_needs_two_stages() -> None:
    assert measure_link(0, [0], 1024, torch.device("cpu")) == (0.0, math.inf)


def test_tuner_arguments_are_checked() -> None:
    from lightning_avgpipe import AvgPipeTuner

    with pytest.raises(ValueError, match=r"profile_steps=0 must be an int >= 1"):
        AvgPipeTuner(profile_steps=0)
    with pytest.raises(ValueError, match=r"memory_limit=-5"):
        AvgPipeTuner(memory_limit=-5)
    with pytest.raises(ValueError, match=r"num_pipelines=0 must be at least 1"):
        AvgPipeTuner(num_pipelines=0)
    with pytest.raises(ValueError, match=r"calibrate_steps=-1 must be an int >= 0"):
        AvgPipeTuner(calibrate_steps=-1)


def test_calibration_scales_times_and_keeps_the_choice() -> None:
    from lightning_avgpipe.tuning import PipelineProfile, StageProfile, search

    stage = StageProfile(
        {1: 0.001, 8: 0.004}, {1: 0.002, 8: 0.008}, {1: 1e4, 8: 8e4}, {1: 1e3, 8: 8e3}, 1e6, 2e6, 0.003, 0.001
    )
    table = search(PipelineProfile([stage, stage], 8, latency_s=1e-4, bandwidth=1e9), num_pipelines=2)
    before = table.choice
    assert before is not None
    table.calibrate(1.25)
    table.calibrate(1.5)  # always relative to the model's own numbers
    assert table.raw_rows is not None and table.choice is not None
    assert table.choice.num_microbatches == before.num_microbatches
    assert table.choice.step_time == pytest.approx(before.step_time * 1.5)
    assert table.choice.samples_per_sec == pytest.approx(before.samples_per_sec / 1.5)
    assert table.to_dict()["raw_rows"][0]["step_time"] == pytest.approx(table.raw_rows[0].step_time)
    with pytest.raises(ValueError, match="calibration factor"):
        table.calibrate(0.0)


def test_tuner_needs_the_avgpipe_strategy(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_avgpipe import AvgPipeTuner
    from tests.helpers.lit import PipeNet, loader

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[AvgPipeTuner()],
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(ValueError, match=r"AvgPipeTuner tunes strategy='avgpipe'.*SingleDeviceStrategy"):
        trainer.fit(PipeNet(), loader())


# -- under the strategy, 2 gloo processes -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profiling_leaves_no_trace(tmp_path: Path) -> None:
    """With dropout, BatchNorm, a shuffled loader, Adam and an lr schedule: a run whose tuner profiled (and did
    not apply) trains bit-identically to a run without it: weights, optimizer, RNG and data order untouched."""
    model = {"noisy": True, "optimizer": "adam", "lr": 0.01, "scheduler": True}
    strategy = {"num_microbatches": 2, "partition": [3, 3]}
    plain = run_lightning(tmp_path / "plain", 2, strategy, steps=5, model=model, shuffle=True)
    tuned = run_lightning(
        tmp_path / "tuned",
        2,
        strategy,
        steps=5,
        model=model,
        shuffle=True,
        tuner={
            "apply": False,
            "num_pipelines": 2,
            "num_microbatches": [1, 2, 4],  # BatchNorm: b > 1
            "output_dir": str(tmp_path / "tuning"),
        },
    )
    assert tuned[0]["tuner"]["choice"] is not None  # it did profile and predict
    assert (tmp_path / "tuning" / "tuning.json").exists()
    assert tuned[0]["losses"] == plain[0]["losses"]
    state_plain, state_tuned = final_state(tmp_path / "plain"), final_state(tmp_path / "tuned")
    assert state_plain.keys() == state_tuned.keys()
    for key in state_plain:
        assert torch.equal(state_plain[key], state_tuned[key]), key
    opt_plain = torch.load(tmp_path / "plain" / "final.ckpt", weights_only=False)["optimizer_states"]
    opt_tuned = torch.load(tmp_path / "tuned" / "final.ckpt", weights_only=False)["optimizer_states"]
    assert str(opt_plain) == str(opt_tuned)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tuner_applies_its_choice_and_reports_the_table(tmp_path: Path) -> None:
    out = tmp_path / "tuning"
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 2, "partition": [3, 3]},
        steps=5,
        tuner={"num_pipelines": [1, 2], "output_dir": str(out), "calibrate_steps": 2},
    )
    choice = results[0]["tuner"]["choice"]
    for r in results:  # every rank runs the same setting, the tuner's
        assert r["setting"] == [choice["num_microbatches"], choice["num_pipelines"]]
        assert r["tuner"]["choice"] == choice
        assert r["schedule"] == choice["schedule"]  # 1F1B, or ZB-H1 where the split predicted more
        assert len(r["losses"]) == 5
        if choice["num_pipelines"] > 1:
            assert r["averaging"] == choice["averaging"]
    table = json.loads((out / "tuning.json").read_text())
    # the default objective: goodput, from the noise scale the profile measured on its untimed steps
    assert table["notes"]["objective"] == "goodput" and table["notes"]["reason"]
    assert table["profile"]["noise_measurements"] > 0
    assert {row["averaging"] for row in table["rows"] if row["num_pipelines"] == 2} == {"exact", "elastic"}
    log = results[0]["output"]  # one set of numbers, labelled: the log says which figures are raw, which calibrated
    assert "(the model's raw figures: calibration rescales them)" in log and "the chosen setting now reads" in log
    factor = table["notes"]["calibration_factor"]  # iterations 2-3 of the chosen setting were timed
    assert factor > 0 and table["notes"]["calibration_measured_step_s"] > 0
    for raw, row in zip(table["raw_rows"], table["rows"]):
        assert row["step_time"] == pytest.approx(raw["step_time"] * factor)
        assert row["peak_bytes"] == raw["peak_bytes"]
    cells = {(row["num_microbatches"], row["num_pipelines"]) for row in table["rows"]}
    assert cells == {(m, n) for m in divisors(12) for n in (1, 2)}
    rows = table["rows"]
    if table["profile"]["noise_scale"] is None:  # no estimate: the user's batch (N = 1 here) is kept, and said
        assert table["notes"]["kept_pipelines"] == 1 and "your own batch, kept" in table["notes"]["reason"]
        rows = [row for row in rows if row["num_pipelines"] == 1]
    best = max(rows, key=lambda row: row["goodput"])
    # the best row, or the user's own setting where the best beats it by less than the profile's noise allows (the
    # tie window: twice the timing noise, wider on a loaded machine), which the reason then says
    window = table["notes"]["tie_window"]
    assert table["choice"]["goodput"] >= (1 - window) * best["goodput"], (table["choice"], best, window)
    if table["choice"]["goodput"] < 0.995 * best["goodput"]:
        assert "was kept" in table["notes"]["reason"], table["notes"]["reason"]
    assert (out / "tuning.png").stat().st_size > 0
    profile = table["profile"]
    assert len(profile["stages"]) == 2 and profile["batch_size"] == 12
    for stage in profile["stages"]:
        assert len(stage["forward_s"]) >= 2  # at least two micro-batch sizes were measured
        assert all(v > 0 for v in stage["forward_s"].values())
        assert stage["param_bytes"] > 0
        # the split backward was timed too: I and W of every Linear stage, at every size
        assert stage["input_grad_s"].keys() == stage["forward_s"].keys()
        assert all(v > 0 for v in [*stage["input_grad_s"].values(), *stage["weight_grad_s"].values()])
    # one stage per rank: the backward split weighed on and off, and what cutting the model anew would give
    assert {row["schedule"] for row in table["rows"]} == {"1f1b", "zbh1"}
    assert "Schedule '" in table["notes"]["reason"]
    assert set(table["notes"]["other_placements"]) == {"interleaved", "zbv"}
    # how much of a core the profile got, and whether that made it a busy machine (then said in the log, too)
    assert 0 < profile["cpu_share"] <= 1
    busy = table["notes"]["busy_machine"]
    assert (busy != "") == (profile["cpu_share"] < 0.85) and (busy in log)
    assert profile["clock"] == ("cpu" if busy else "wall")  # busy, on CPU with a thread per rank: timed by CPU time
    assert profile["rounds"] in (3, 3 * BUSY_ROUNDS)  # the tuner's 3 rounds, or more where the first probe was busy
    assert profile["timing_noise"] > 0 and table["notes"]["tie_window"] == pytest.approx(
        min(0.10, max(0.005, 2 * profile["timing_noise"])), abs=1e-4
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_known_costs_give_the_right_pick(tmp_path: Path) -> None:
    """Layers that sleep a fixed time plus a time per row: the profile finds those costs and the pick is the
    setting the true costs make fastest (within 10%)."""
    fixed_f, row_f, fixed_b, row_b = 0.001, 0.001, 0.002, 0.002  # true best M: 3-4 (60 ms; M = 1 or 12: 78)
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 2, "partition": [2, 4]},
        steps=1,
        model={"sleep": [fixed_f, row_f, fixed_b, row_b]},
        tuner={"num_pipelines": 1, "profile_steps": 2},
    )
    profile = results[0]["tuner"]["profile"]
    for stage in profile["stages"]:
        for size, measured in stage["forward_s"].items():
            true = fixed_f + row_f * float(size)
            assert true <= measured + 1e-4 <= true + 0.25 * true + 3e-3, (size, measured, true)
        for size, measured in stage["backward_s"].items():
            true = fixed_b + row_b * float(size)
            assert true <= measured + 1e-4 <= true + 0.25 * true + 3e-3, (size, measured, true)

    def true_time(m: int) -> float:
        b = 12 / m
        plan = build_plan("1f1b", 2, m, 0)
        return simulate(plan, fixed_f + row_f * b, fixed_b + row_b * b).step_time

    times = {m: true_time(m) for m in divisors(12)}
    chosen = results[0]["tuner"]["choice"]["num_microbatches"]
    assert times[chosen] <= 1.10 * min(times.values()), (chosen, times)
    predicted = results[0]["tuner"]["choice"]["pipeline_time"]
    assert abs(predicted - times[chosen]) <= 0.25 * times[chosen], (predicted, times[chosen])
    assert min(times, key=times.__getitem__) not in (1, 12)  # the costs make the choice non-trivial


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_memory_limit_no_setting_meets_stops_every_rank_with_the_need(tmp_path: Path) -> None:
    cfg = {
        "out": str(tmp_path),
        "devices": 2,
        "steps": 2,
        "strategy": {"num_microbatches": 2},
        "tuner": {"memory_limit": 1000, "num_pipelines": 2},
    }
    results = launch_ranks(["-m", "tests.helpers.lightning_worker", json.dumps(cfg)], 2, timeout=240, preload=True)
    for code, out in results:
        assert code != 0
        assert "memory_limit=1000 bytes" in out and "is met by no setting" in out, out[-3000:]
        assert "Raise memory_limit to at least" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tune_command_prints_the_table_without_training(tmp_path: Path) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy: avgpipe\n  logger: false\n"
        "  enable_checkpointing: false\n  enable_progress_bar: false\n  max_steps: 50\n"
        f"  default_root_dir: {tmp_path}\n"
        "model:\n  class_path: tests.helpers.lit.PipeNet\n"
        "data:\n  class_path: tests.test_tuner.TinyData\n"
    )
    env = job_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # not the variables in-process Trainers left
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_avgpipe",
            "tune",
            "--config",
            str(config),
            "--num-pipelines",
            "2",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "<- chosen" in proc.stdout and "plan: num_microbatches=" in proc.stdout
    assert "--trainer.strategy.init_args.num_pipelines" in proc.stdout
    assert (tmp_path / "out" / "tuning.json").exists()
    assert "tune stopped before the first training step" in proc.stdout
    assert "max_steps=0" not in proc.stdout + proc.stderr  # Lightning's line would read as a setting of the user's
    assert proc.stdout.count("<- chosen") == 1 and "<- chosen" not in proc.stderr  # the table once
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("plan:"))
    schedule = plan.split("schedule=")[1].split()[0].rstrip(":")  # the chosen one, also in the command to train
    assert schedule in ("1f1b", "zbh1")
    assert (f"init_args.schedule {schedule}" in proc.stdout) == (schedule != "1f1b")


try:
    import lightning.pytorch as _pl

    class TinyData(_pl.LightningDataModule):
        """The tests' 48-sample data set in batches of 12, for LightningCLI configs."""

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            from tests.helpers.lit import loader

            return loader()
except ImportError:  # pragma: no cover
    pass


def test_batch_norm_drops_micro_batches_of_one_sample() -> None:
    from lightning_avgpipe.plugin.tuner.run import batch_norm_candidates

    plain = [nn.Linear(4, 4)]
    norm = [nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4), nn.ReLU())]
    assert batch_norm_candidates([1, 2, 4, 8], 8, plain, given=False) == [1, 2, 4, 8]
    assert batch_norm_candidates([1, 2, 4, 8], 8, norm, given=False) == [1, 2, 4]  # M = 8: one sample each
    with pytest.raises(ValueError, match=r"num_microbatches=\[2, 8\] includes \[8\].*BatchNorm.*Leave out \[8\]"):
        batch_norm_candidates([2, 8], 8, norm, given=True)
    with pytest.raises(ValueError, match="batch size of at least 2"):
        batch_norm_candidates([1], 1, norm, given=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tuner_keeps_the_setting_when_resuming(tmp_path: Path) -> None:
    """A resumed run keeps the strategy's setting: profiling then would measure a different model state, and the
    restored optimizer states belong to the checkpoint's replicas."""
    strategy = {"num_microbatches": 2, "partition": [3, 3]}
    run_lightning(tmp_path / "first", 2, strategy, steps=2)
    resumed = run_lightning(
        tmp_path / "resumed",
        2,
        strategy,
        steps=4,
        ckpt_path=str(tmp_path / "first" / "final.ckpt"),
        tuner={"num_pipelines": [1, 2], "output_dir": str(tmp_path / "tuning")},
    )
    for r in resumed:
        assert r["tuner"]["choice"] is None and r["setting"] == [2, 1]
        assert len(r["losses"]) == 2  # steps 3 and 4
    assert "resuming from a checkpoint; keeping the strategy's" in resumed[0]["output"]
    assert not (tmp_path / "tuning").exists()


def test_resuming_from_reads_the_path_fit_is_about_to_restore() -> None:
    from lightning_avgpipe.plugin.tuner.callback import resuming_from

    class FakeTrainer:
        ckpt_path = None

    trainer = FakeTrainer()

    def _run(self: object, model: object, ckpt_path: str | None = None, probe: object = None) -> object:
        """Shaped like Trainer._run; asks about ``probe`` (default: itself)."""
        return resuming_from(probe or self)  # type: ignore[arg-type]

    assert _run(trainer, None, "last.ckpt") == "last.ckpt"
    assert _run(trainer, None) is None
    assert _run(FakeTrainer(), None, "other.ckpt", probe=trainer) is None  # another Trainer's _run is not this one's
    assert resuming_from(trainer) is None  # type: ignore[arg-type]
    trainer.ckpt_path = "set.ckpt"  # type: ignore[assignment]
    assert resuming_from(trainer) == "set.ckpt"  # type: ignore[arg-type]


def test_batch_norm_looks_at_the_short_last_batch_too() -> None:
    from lightning_avgpipe.plugin.tuner.run import batch_norm_candidates

    norm = [nn.BatchNorm1d(4)]
    # B = 8, last batch 5: M = 4 splits it into 2/1/1/1, M = 2 into 3/2
    assert batch_norm_candidates([1, 2, 4, 8], 8, norm, last_batch=5) == [1, 2]
    # a last batch of 3 with M = 4: split into 3 parts of one
    assert batch_norm_candidates([1, 2, 4], 8, norm, last_batch=3) == [1]
    with pytest.raises(ValueError, match=r"and a last batch of 5 that gives micro-batches of one sample"):
        batch_norm_candidates([2, 4], 8, norm, given=True, last_batch=5)


def _fake_trainer(loader: Any, **attrs: Any) -> Any:
    from types import SimpleNamespace

    source = SimpleNamespace(dataloader=lambda: loader)
    return SimpleNamespace(fit_loop=SimpleNamespace(_data_source=source), **attrs)


def test_first_batch_leaves_the_loaders_own_generators_as_they_were() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_avgpipe.plugin.tuner.run import first_batch

    data = TensorDataset(torch.arange(50.0))

    def order(loader: DataLoader) -> list[float]:
        return [float(v) for (b,) in loader for v in b]

    untouched = order(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    batch, fetch_s, batches, last = first_batch(_fake_trainer(loader))
    assert batch[0].shape == (4,) and fetch_s >= 0 and batches == 13 and last == 2  # 50 = 12 x 4 + 2
    assert order(loader) == untouched  # without the restore the first training batch changes
    sampler_gen = DataLoader(
        data,
        batch_size=4,
        sampler=torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(5)),
        drop_last=True,
    )
    before = order(
        DataLoader(
            data,
            batch_size=4,
            sampler=torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(5)),
            drop_last=True,
        )
    )
    assert first_batch(_fake_trainer(sampler_gen))[3] is None  # drop_last: no short batch
    assert order(sampler_gen) == before


def test_search_caps_the_pipelines_at_the_batches_an_epoch_has() -> None:
    table = search(profile(), [1, 2], num_pipelines=[1, 2, 4, 8], max_pipelines=3)
    assert {r.num_pipelines for r in table.rows} == {1, 2}
    assert search(profile(), [1], num_pipelines=[4], max_pipelines=2).rows[0].num_pipelines == 4  # nothing else


def test_resuming_from_prefers_this_fits_path_over_a_stale_one() -> None:
    from lightning_avgpipe.plugin.tuner.callback import resuming_from

    trainer = _fake_trainer(None, ckpt_path="validated.ckpt")  # left by an earlier trainer.validate(ckpt_path=...)

    def _run(self: object, model: object, ckpt_path: str | None = None) -> object:
        return resuming_from(self)  # type: ignore[arg-type]

    assert _run(trainer, None) is None  # this fit restores nothing
    assert _run(trainer, None, "resume.ckpt") == "resume.ckpt"


def test_a_report_that_cannot_be_written_warns(tmp_path: Path) -> None:
    from lightning_avgpipe.plugin.tuner.callback import _write

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match="could not write the report"):
        assert _write(search(profile(), [1, 2], [1]), blocker / "tuning") == {}


def test_calibration_times_whole_accumulation_cycles(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 2: every second interval holds the optimizer step; the factor uses the mean over whole cycles."""
    from types import SimpleNamespace

    from lightning_avgpipe import AvgPipeTuner
    from lightning_avgpipe.plugin.tuner import callback as tuner_module

    tuner = AvgPipeTuner(calibrate_steps=3)
    tuner.table = search(profile(), [1, 2], [1])
    predicted = tuner.table.choice.step_time
    tuner._calibrating = True
    clock = iter([0.0, 5.0, 6.0, 9.0, 10.0, 15.0])  # a warm-up interval, then 1, 3, 1, 5
    monkeypatch.setattr(tuner_module.time, "perf_counter", lambda: next(clock))
    trainer = SimpleNamespace(
        accumulate_grad_batches=2,
        strategy=SimpleNamespace(broadcast=lambda v, src: v),
        is_global_zero=False,
        loggers=[],
        global_step=0,
    )
    for i in range(5):
        tuner.on_train_batch_start(trainer, None, None, i)  # type: ignore[arg-type]
    assert tuner._calibrating  # 3 steps round up to 4 intervals (two cycles of K = 2) after the warm-up
    tuner.on_train_batch_start(trainer, None, None, 5)  # type: ignore[arg-type]
    assert not tuner._calibrating
    # the mean over two whole cycles: the median would say 2.0, three intervals alone 5/3
    assert tuner.table.notes["calibration_measured_step_s"] == pytest.approx(2.5)
    assert tuner.table.notes["calibration_factor"] == pytest.approx(2.5 / predicted)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tuner_with_two_groups_times_the_reference_allreduce(tmp_path: Path) -> None:
    out = tmp_path / "tuning"
    results = run_lightning(
        tmp_path,
        4,
        {"num_stages": 2, "num_microbatches": 2, "partition": [3, 3]},
        steps=2,
        tuner={"num_pipelines": [1, 2], "num_microbatches": [1, 2], "output_dir": str(out), "calibrate_steps": 0},
    )
    choice = results[0]["tuner"]["choice"]
    for r in results:  # all four ranks (two groups of two stages) run the same choice
        assert r["setting"] == [choice["num_microbatches"], choice["num_pipelines"]]
    profile = json.loads((out / "tuning.json").read_text())["profile"]
    assert profile["num_groups"] == 2 and profile["reference_allreduce_s"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_n_regroups_a_loader_set_up_early(tmp_path: Path) -> None:
    """configure_optimizers reading trainer.estimated_stepping_batches sets the training loader up (grouped for the
    strategy's N) before the tuner runs; the tuner's new N must regroup it."""
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 2, "partition": [3, 3]},
        steps=3,
        model={"stepping": True},
        trainer={"max_epochs": 10},  # max_epochs: it loads the data
        tuner={
            "num_pipelines": [2],
            "num_microbatches": [2],
            "calibrate_steps": 0,
            "output_dir": str(tmp_path / "tuning"),
        },
    )
    for r in results:
        assert r["setting"] == [2, 2] and len(r["losses"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tuner_profiles_a_tensor_parallel_layout(tmp_path: Path) -> None:
    """T = 2 x S = 2 (4 ranks): the tuner profiles the sharded stages as they run, and every rank applies the same
    choice."""
    strategy = {
        "num_stages": 2,
        "num_microbatches": 2,
        "partition": [3, 3],
        "tensor_parallel_size": 2,
        "tensor_parallel_plan": {"layers.3": "colwise", "layers.5": "rowwise"},
    }
    tuner = {"num_pipelines": 2, "num_microbatches": [1, 2, 4], "output_dir": str(tmp_path / "tuning")}
    results = run_lightning(tmp_path, 4, strategy, steps=3, model={"optimizer": "adam", "lr": 0.01}, tuner=tuner)
    choices = [(r["tuner"]["choice"]["num_microbatches"], r["tuner"]["choice"]["num_pipelines"]) for r in results]
    assert len(set(choices)) == 1 and [tuple(r["setting"]) for r in results] == choices
    assert results[2]["sharded"] == ["layers.3.bias", "layers.3.weight", "layers.5.bias", "layers.5.weight"]
    assert (tmp_path / "tuning" / "tuning.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tuner_profiles_a_zbv_strategy_in_its_own_placement(tmp_path: Path) -> None:
    """Two stages per rank: the profile runs ZB-V itself (its V is the model's cut), the search weighs ZB-V alone,
    and training under the chosen M equals plain training."""
    out = tmp_path / "tuning"
    strategy = {"num_microbatches": 2, "partition": [1, 2, 1, 2], "schedule": "zbv"}
    results = run_lightning(tmp_path, 2, strategy, steps=4, tuner={"num_pipelines": 1, "output_dir": str(out)})
    table = json.loads((out / "tuning.json").read_text())
    assert {(row["schedule"], row["stages_per_rank"]) for row in table["rows"]} == {("zbv", 2)}
    assert table["profile"]["stages_per_rank"] == 2 and table["notes"]["other_placements"] == {}
    assert all(v > 0 for stage in table["profile"]["stages"] for v in stage["weight_grad_s"].values())
    m = results[0]["setting"][0]
    assert results[0]["schedule"] == "zbv" and m == table["choice"]["num_microbatches"]
    costs = table["choice"]["schedule_costs"]  # the plan is placed by the profiled F, I, W, and the log says so
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert "placed by F:I:W = 1:" in results[0]["output"], results[0]["output"][-3000:]
    assert_matches(tmp_path, results, m)


def test_candidate_schedules_keep_the_cut() -> None:
    from lightning_avgpipe.plugin.tuner.run import candidate_schedules
    from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile

    def profile(split: bool) -> PipelineProfile:
        grads = {4.0: 1.0} if split else {}
        stage = StageProfile({4.0: 1.0}, {4.0: 2.0}, {4.0: 1.0}, {4.0: 1.0}, 1.0, 1.0, 0.0, 0.0, grads, grads)
        return PipelineProfile([stage, stage], batch_size=8)

    assert candidate_schedules("1f1b", profile(True)) == ["1f1b", "zbh1"]
    assert candidate_schedules("zbadvance", profile(True)) == ["zbadvance", "advance"]
    assert candidate_schedules("1f1b", profile(False)) == ["1f1b"]  # the split was not timed: not weighed
    assert candidate_schedules("afab", profile(True)) == ["afab"]
    assert candidate_schedules("zbv", profile(True)) == ["zbv"]
