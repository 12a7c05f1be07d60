"""The tuner's measurement of the running pipeline: one batch through the real step at a few micro-batch sizes, timed
per stage, through a :class:`~lightning_avgpipe.tuning.probe.StageProbe` (docs/how-it-works.md#choosing-m-and-n).

:func:`profile_pipeline` runs the sizes in rounds (``tuning/busy.py``), reads each step's trace into per-unit times
(``tuning/profiler.py``), times the optimizer step, the elastic update, the link and the groups' all-reduce, and
returns rank 0's :class:`~lightning_avgpipe.tuning.model.PipelineProfile` on every rank. Collective over every rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.algorithms.noise_scale import GradientNorms
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.trace import COMPUTE
from lightning_avgpipe.schedules import simulate
from lightning_avgpipe.schedules.generate import splits_backward
from lightning_avgpipe.shards import local
from lightning_avgpipe.tuning.busy import BUSY_ROUNDS, charged, cpu_clock, probe_together, rounds, timing_noise
from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile, predict
from lightning_avgpipe.tuning.probe import StageProbe
from lightning_avgpipe.tuning.profiler import (
    CopyOptimizer,
    fit_overhead,
    measure_link,
    split_times,
    tensor_bytes,
    time_allreduce,
    time_elastic_update,
    unit_times,
)


@dataclass
class SizeRun:
    """One micro-batch size of the profile: the settings it runs and what their steps showed."""

    size: float  # samples per micro-batch
    m: int  # micro-batches of the profiled batch
    setting: StagePipeline  # the profile's schedule
    split_setting: StagePipeline | None  # the schedule that splits the backward, where it is another
    spans: list[Any] = field(default_factory=list)  # per timed step
    split_spans: list[Any] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    outside: list[float] = field(default_factory=list)  # CPU seconds of a step outside the charged spans
    peaks: list[int] = field(default_factory=list)
    sent: int | None = None  # bytes of the stage's output

    def turns(self) -> list[tuple[SizeRun, str]]:
        """Two steps, the first untimed (after a change of shape it pays for cold caches), and a third where the
        split backward is another schedule."""
        return [(self, kind) for kind in ("warm", "timed", "split")[: 2 + (self.split_setting is not None)]]


@dataclass
class Rounds:
    """What the rounds of steps measured besides each size's spans."""

    shares: list[float]  # how much of a core this process got: before every round, and at the end
    noise: list[GradientNorms]  # the gradient noise of the untimed turns
    optimizer: CopyOptimizer  # a copy of the stage's optimizer, stepped between steps
    per_iteration: float = 0.0  # the strategy's own collectives of an iteration (loss and logs shared)


def profile_pipeline(probe: StageProbe, batch: Any, sizes: Sequence[float], steps: int) -> PipelineProfile:
    """Run the stage's step at each micro-batch size (samples per micro-batch) and measure; rank 0's profile reaches
    every rank.

    One stage per rank: 1F1B, replica 0 of every stage, the user's ``training_step`` as the loss; then ZB-H1 once,
    for the split backward's I and W. Several: the strategy's own schedule, whose spans are a chunk's. Everything the
    steps change is put back (``StageProbe.held``).
    """
    size = microbatch.batch_size(batch)
    base, split, runs = _settings(probe, sizes, size)
    with probe.held():
        measured = _run_rounds(probe, batch, runs, steps)
        share = -probe.max_over([-statistics.median(measured.shares)])[0]  # each rank's median, the least rank's
        timed = [s for run in runs for step in run.spans for s in step if s.kind in COMPUTE]
        work = sum(s.cpu for s in timed) / max(sum(s.end - s.start for s in timed), 1e-9)
        cpu = cpu_clock(probe.device, share, work, probe.topology.pipeline_group)
        noise_here = probe.max_over([timing_noise([run.spans for run in runs], cpu)])[0]
        measured.per_iteration = _collectives_cost(probe, cpu)
    mine = _stage_profile(probe, runs, base, split, measured.optimizer, cpu)
    profile = _pipeline_profile(probe, probe.gather(mine), size, mine, cpu)
    profile.noise_scale, profile.noise_measurements = pooled_noise_scale(measured.noise), len(measured.noise)
    profile.cpu_share, profile.clock = round(share, 3), "cpu" if cpu else "wall"
    profile.rounds = len(measured.shares) - 1  # a probe before each round and one at the end
    profile.timing_noise = round(noise_here, 4)
    # What the spans miss (posting, copies, waits the model does not see): measured step - the pipeline part of
    # the prediction itself (the simulator with the same latency and transfer costs), per unit
    residuals = probe.max_over([statistics.median(run.outside if cpu else run.step_times) for run in runs])
    units = [run.m for run in runs]
    sims = [0.0 if cpu else predict(profile, m, 1, schedule=base).pipeline_time for m in units]
    a, c = fit_overhead(units, [t - s for t, s in zip(residuals, sims)])
    profile.iteration_overhead_s, profile.unit_overhead_s = a + probe.max_over([measured.per_iteration])[0], c
    return probe.broadcast(profile)


def _settings(probe: StageProbe, sizes: Sequence[float], size: int) -> tuple[str, str | None, list[SizeRun]]:
    """The profile's schedule, the one that splits the backward (or ``None``), and a run per size."""
    v = probe.pipeline.chunks.v
    base = "1f1b" if v == 1 else probe.config.schedule
    split = "zbh1" if v == 1 else (base if splits_backward(base) else None)
    runs = []
    for b in sizes:
        m = max(1, round(size / b))
        other = probe.setting(m, split) if split is not None and split != base else None
        runs.append(SizeRun(b, m, probe.setting(m, base), other))
    return base, split, runs


def _run_rounds(probe: StageProbe, batch: Any, runs: list[SizeRun], steps: int) -> Rounds:
    """Rounds in which every size takes its turns: a burst of background load then lands on every size alike
    instead of bending the curve at one of them. Between steps a copy of the stage's optimizer steps, as the real
    one does between iterations (it also times one replica's optimizer step)."""
    group, device = probe.topology.pipeline_group, probe.device
    measured = Rounds([], [], probe.optimizer_copy())
    turns = [turn for run in runs for turn in run.turns()]
    # on a busy machine (the first probe says so) twice the rounds: each timing is noisier there
    for run, kind in rounds(turns, steps, measured.shares, group, BUSY_ROUNDS * steps, device):
        if kind == "split":
            assert run.split_setting is not None
            run.split_spans.append(probe.step(run.split_setting, batch, False, False, split=True).trace.spans)
        else:
            hook = None if run.sent is not None else probe.last_layer.register_forward_hook(_recorder(run))
            try:
                result = probe.step(run.setting, batch, True, kind == "warm")  # the noise: on the untimed turns
            finally:
                if hook is not None:
                    hook.remove()
            if result.noise is not None:
                measured.noise.append(result.noise)
            if kind == "timed":
                trace = result.trace
                run.spans.append(trace.spans)
                run.step_times.append(trace.step_time)
                run.outside.append(trace.step_cpu - sum(s.cpu for s in trace.spans if charged(s)))
                run.peaks.append(trace.peak_activation_bytes)
        measured.optimizer.step()
    measured.shares.append(probe_together(group))
    return measured


def _collectives_cost(probe: StageProbe, cpu: bool) -> float:
    """The strategy's own per-iteration collectives (the loss and logs from the last stage, the step figures)."""
    pipeline, extra = probe.pipeline, []
    for _ in range(3):
        t0 = time.thread_time() if cpu else time.perf_counter()
        pipeline.share((torch.zeros(()), []) if pipeline.executor.is_last else None)
        extra.append((time.thread_time() if cpu else time.perf_counter()) - t0)
    return statistics.median(extra)


def _stage_profile(
    probe: StageProbe, runs: list[SizeRun], base: str, split: str | None, optimizer: CopyOptimizer, cpu: bool
) -> StageProfile:
    """This stage's figures per size (per unit: v chunks), its memory and its optimizer's and averaging's cost."""
    v, stage = probe.pipeline.chunks.v, probe.topology.stage
    f_s, b_s, i_s, w_s, act, sent = {}, {}, {}, {}, {}, {}
    for run in runs:
        b = run.size
        f, bk = unit_times(run.spans, cpu)
        i, w = split_times(run.split_spans if run.split_setting is not None else run.spans if split else [], cpu)
        if split == base:  # ZB-V: the whole backward never ran; I + W is what it costs
            bk = i + w
        f_s[b], b_s[b] = f * v, bk * v
        if split is not None:
            i_s[b], w_s[b] = i * v, w * v
        stash = simulate(run.setting.plan(True, run.m)).peak_stash[stage]
        act[b] = v * statistics.median(run.peaks) / max(1, stash)
        sent[b] = float(run.sent or 0)
    reference = probe.pipeline.replicas.elastic.reference_params
    whole = _whole(probe)  # under ZeRO-2/3 a rank holds 1/D of each: the profile keeps a stage's whole bytes
    return StageProfile(
        forward_s=f_s,
        backward_s=b_s,
        activation_bytes=act,
        send_bytes=sent,
        param_bytes=whole * tensor_bytes(list(reference)),
        optimizer_state_bytes=whole * optimizer.state_bytes(),
        optimizer_step_s=optimizer.median(cpu),
        elastic_s=time_elastic_update(probe.pipeline.layers, probe.device),
        input_grad_s=i_s,
        weight_grad_s=w_s,
        layer_bytes=whole * max((tensor_bytes(list(m.parameters())) for m in probe.pipeline.layers), default=0),
    )


def _whole(probe: StageProbe) -> float:
    """What a rank's bytes of its stage's weights are multiplied by to give the stage's: D under ZeRO-2/3."""
    return float(probe.topology.num_groups) if probe.config.fsdp else 1.0


def _pipeline_profile(
    probe: StageProbe, stages: list[StageProfile], size: int, mine: StageProfile, cpu: bool
) -> PipelineProfile:
    """The stages' profiles with the link between them and the all-reduce between the D groups."""
    top, config, device = probe.topology, probe.config, probe.device
    link_bytes = int(max(mine.send_bytes.values())) if mine.send_bytes else 4
    latency, bandwidth = 0.0, float("inf")
    if top.num_stages > 1:
        link_bytes = int(probe.max_over([float(link_bytes)])[0])
        latency, bandwidth = measure_link(
            top.stage, top.pipeline_ranks, link_bytes, device, top.pipeline_group, least=cpu
        )
    reduce_s = 0.0
    if top.num_groups > 1:  # the reference update's all-reduce over the D groups (every rank takes part)
        reference = probe.pipeline.replicas.elastic.reference_params
        nbytes = _whole(probe) * sum(
            local(t).numel() * 4 for t in reference
        )  # the flat float32 buffer ElasticAveraging reduces
        reduce_s = probe.max_over([time_allreduce(nbytes, device, top.stage_group)])[0]
    return PipelineProfile(
        stages=stages,
        batch_size=size,
        latency_s=latency,
        bandwidth=bandwidth,
        num_groups=top.num_groups,
        schedule=config.schedule,
        stages_per_rank=probe.pipeline.chunks.v,
        reference_allreduce_s=reduce_s,
        sync_reference=config.synchronous_reference,
        averaging_period=int(config.averaging_period),
        outer_lr=float(config.outer_lr),
        outer_momentum=float(config.outer_momentum),
        shard_optimizer_state=bool(config.shard_optimizer_state),
        sharding_strategy=config.sharding_strategy,
        reduce_gradients=config.reduce_gradients,
    )


def _recorder(run: SizeRun) -> Any:
    """A forward hook that keeps the size of the first output it sees (the bytes a stage sends)."""

    def record(_mod: Any, _in: Any, out: Any) -> None:  # None: the output is kept
        if run.sent is None:
            run.sent = tensor_bytes(out)

    return record


def pooled_noise_scale(measurements: Sequence[GradientNorms]) -> float | None:
    """B_simple from the profile's measurements, all weighted alike (the same weights: no drift to follow)."""
    if not measurements:
        return None
    grad_sq = statistics.fmean(m.estimates()[0] for m in measurements)
    trace = statistics.fmean(m.estimates()[1] for m in measurements)
    return trace / grad_sq if grad_sq > 0 and trace > 0 else None
