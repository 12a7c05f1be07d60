"""Profiling for ``AvgPipeTuner``: one batch through the real pipeline at a few micro-batch sizes, timed per stage
(``profile_pipeline``), and the batch it profiles on (``first_batch``). Collective over every rank; ``run.py``
searches what it measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_avgpipe import microbatch
from lightning_avgpipe.noise_scale import GradientNorms
from lightning_avgpipe.optim import clone_optimizer
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.contract import pipeline_inputs
from lightning_avgpipe.plugin.data import loader_generators
from lightning_avgpipe.runtime.trace import COMPUTE
from lightning_avgpipe.schedules import simulate
from lightning_avgpipe.schedules.generate import splits_backward
from lightning_avgpipe.shards import local
from lightning_avgpipe.tuning.busy import (
    BUSY_ROUNDS,
    charged,
    cpu_clock,
    probe_together,
    rounds,
    timing_noise,
)
from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile, predict
from lightning_avgpipe.tuning.profiler import (
    CopyOptimizer,
    Snapshot,
    fit_overhead,
    measure_link,
    split_times,
    tensor_bytes,
    time_allreduce,
    time_elastic_update,
    unit_times,
)

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy


def first_batch(trainer: pl.Trainer, fetches: int = 3) -> tuple[Any, float, int | None, int | None]:
    """One training batch, the median time to draw one, the loader's batches per epoch (``None``: no length) and
    the size of its short last batch (``None``: none or not known).

    Drawn from a fresh iterator; the global RNG states and the loader's own generators (``DataLoader(generator=)``,
    a sampler's ``generator``) are put back, so the data order training sees is kept.
    """
    loader = compat.request_train_dataloader(trainer)
    if loader is None:
        raise ValueError("AvgPipeTuner needs a training DataLoader to profile on; none is attached to fit().")
    snap = Snapshot([], [], generators=loader_generators(loader))
    times = []
    try:
        it = iter(loader)
        batch = next(it)
        for _ in range(fetches):
            t0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            times.append(time.perf_counter() - t0)
    finally:
        snap.restore()
    try:
        batches: int | None = len(loader)
    except TypeError:  # an iterable dataset without a length
        batches = None
    return batch, statistics.median(times) if times else 0.0, batches, _last_batch_size(loader)


def _last_batch_size(loader: Any) -> int | None:
    """The size of an epoch's short last batch (``None``: none, or not known)."""
    size, drop = getattr(loader, "batch_size", None), getattr(loader, "drop_last", True)
    try:
        n = len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    if not isinstance(size, int) or drop or n % size == 0:
        return None
    return n % size


def profile_pipeline(strategy: AvgPipeStrategy, batch: Any, sizes: Sequence[float], steps: int) -> PipelineProfile:
    """Run the strategy's step at each micro-batch size and measure; rank 0's profile reaches every rank.

    Each size runs :meth:`StagePipeline.train_step` itself (1F1B, replica 0 of every stage, the user's
    ``training_step`` as the loss; then ZB-H1 once, for the split backward's I and W; with several stages per rank the
    strategy's own schedule), as training does, then puts back gradients, buffers, torchmetrics states, RNG
    states and what the step bridge recorded.
    """
    module = strategy.lightning_module
    assert module is not None
    pipeline, bridge = strategy.pipeline, strategy.bridge
    top = strategy.topology
    S, stage = top.num_stages, top.stage
    device = strategy.root_device
    elastic = pipeline.replicas.elastic
    params = pipeline.params
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    replica_layers = [m for layers in elastic.replicas for m in layers] if not elastic.trivial else []
    snap = Snapshot(params, [*pipeline.layers, *replica_layers], metrics)
    size = microbatch.batch_size(batch)
    last_layer = elastic.replicas[0][-1]  # what this stage sends: the output of replica 0's last layer
    forward_s: dict[float, float] = {}
    backward_s: dict[float, float] = {}
    activation: dict[float, float] = {}
    sent: dict[float, float] = {}
    units_seen: list[int] = []
    residuals: list[float] = []
    noise: list[GradientNorms] = []

    def loss_fn(output: Any, micro: Any, share: float) -> Any:
        return bridge.call_step("training_step", output, micro, share, 0)  # batch_idx 0

    v = pipeline.chunks.v
    base, split, settings, splits = _variants(strategy, sizes, size)
    input_grad: dict[float, float] = {}
    weight_grad: dict[float, float] = {}
    try:
        # Rounds in which every size takes a turn: a burst of background load then lands on every size alike
        # instead of bending the curve at one of them. A turn is two steps, the first untimed: after a change of
        # shape the first step pays for cold caches (allocator, kernels), which training at one shape does not.
        spans: dict[float, list[Any]] = {b: [] for b in sizes}
        step_times: dict[float, list[float]] = {b: [] for b in sizes}
        outside: dict[float, list[float]] = {b: [] for b in sizes}  # CPU seconds of a step outside the charged spans
        peaks: dict[float, list[int]] = {b: [] for b in sizes}
        out_bytes: dict[float, int] = {}
        # Between steps the optimizer of a copy of the stage steps, as the real one does between iterations (it
        # also times one replica's optimizer step): the profiled steps then see caches as training leaves them.
        user = strategy.optimizers[0]
        user = getattr(user, "user", user)
        reference = elastic.reference_params
        copy_opt = CopyOptimizer(lambda ps: clone_optimizer(user, ps, reference), reference)
        split_spans: dict[float, list[Any]] = {b: [] for b in sizes}
        kinds = ("warm", "timed", "split")  # a size with a split variant takes a third step: that variant, timed
        turns = [(setting, kind) for setting in settings for kind in kinds[: 2 + (setting[0] in splits)]]

        def run(probe: Any, measure: bool, noisy: bool) -> Any:
            return probe.train_step(
                [batch],
                loss_fn,
                inputs=lambda micro: pipeline_inputs(module, micro),
                forward_context=strategy.precision_plugin.train_step_context,
                measure=measure,
                noise=noisy,  # the gradient noise on the untimed turns: it costs the timed ones nothing
                key="avgpipe-tune",
            )

        shares: list[float] = []  # how much of a core this process gets: before every round, and at the end
        # on a busy machine (the first probe says so) twice the rounds: each timing is noisier there
        for (b, _m, probe), kind in rounds(turns, steps, shares, top.pipeline_group, BUSY_ROUNDS * steps, device):
            for p in params:
                p.grad = None
            if kind == "split":
                with pipeline.deferring_weight_grads():
                    split_spans[b].append(run(splits[b], False, False).trace.spans)
            else:
                hook = None if b in out_bytes else last_layer.register_forward_hook(_recorder(out_bytes, b))
                try:
                    result = run(probe, True, kind == "warm")
                finally:
                    if hook is not None:
                        hook.remove()
                if result.noise is not None:
                    noise.append(result.noise)
                if kind == "timed":
                    spans[b].append(result.trace.spans)
                    step_times[b].append(result.trace.step_time)
                    outside[b].append(result.trace.step_cpu - sum(s.cpu for s in result.trace.spans if charged(s)))
                    peaks[b].append(result.trace.peak_activation_bytes)
            bridge.take_logs()
            copy_opt.step()
        shares.append(probe_together(top.pipeline_group))
        # each rank's median over its probes (a single preemption in 50 ms reads as a busy machine), the least rank's
        share = -_max_over(strategy, -statistics.median(shares))
        timed = [s for b in sizes for step in spans[b] for s in step if s.kind in COMPUTE]
        work = sum(s.cpu for s in timed) / max(sum(s.end - s.start for s in timed), 1e-9)
        cpu = cpu_clock(device, share, work, top.pipeline_group)
        noise_here = _max_over(strategy, timing_noise([spans[b] for b in sizes], cpu))
        for b, m, probe in settings:
            f, bk = unit_times(spans[b], cpu)
            i, w = split_times(split_spans[b] if b in splits else spans[b] if split else [], cpu)
            if split == base:  # ZB-V: the whole backward never ran; I + W is what it costs
                bk = i + w
            forward_s[b], backward_s[b] = f * v, bk * v
            if split is not None:
                input_grad[b], weight_grad[b] = i * v, w * v
            stash = simulate(probe.plan(True, m)).peak_stash[stage]
            activation[b] = v * statistics.median(peaks[b]) / max(1, stash)
            sent[b] = float(out_bytes.get(b, 0))
            units_seen.append(m)
            # the step as this stage saw it, fitted below; by CPU time, what it spent outside the units' spans
            residuals.append(statistics.median(outside[b] if cpu else step_times[b]))
        # The strategy's own per-iteration collectives (the loss and logs from the last stage, the step figures)
        extra = []
        for _ in range(3):
            t0 = time.thread_time() if cpu else time.perf_counter()
            pipeline.share((torch.zeros(()), []) if pipeline.is_last else None)
            extra.append((time.thread_time() if cpu else time.perf_counter()) - t0)
        per_iteration = statistics.median(extra)
    finally:
        snap.restore()
    step_s, state_bytes = copy_opt.median(cpu), copy_opt.state_bytes()
    del copy_opt
    elastic_s = time_elastic_update(pipeline.layers, device)
    link_bytes = int(max(sent.values())) if sent else 4
    group = top.pipeline_group
    if S > 1:
        link_bytes = int(_max_over(strategy, float(link_bytes)))
        latency, bandwidth = measure_link(stage, top.pipeline_ranks, link_bytes, device, group, least=cpu)
    else:
        latency, bandwidth = 0.0, float("inf")
    mine = StageProfile(
        forward_s=forward_s,
        backward_s=backward_s,
        activation_bytes=activation,
        send_bytes=sent,
        param_bytes=float(tensor_bytes(list(reference))),
        optimizer_state_bytes=float(state_bytes),
        optimizer_step_s=step_s,
        elastic_s=elastic_s,
        input_grad_s=input_grad,
        weight_grad_s=weight_grad,
    )
    stages = _gather_stages(strategy, mine)
    reduce_s = 0.0
    if strategy.topology.num_groups > 1:  # the reference update's all-reduce over the D groups (every rank takes part)
        nbytes = float(sum(local(t).numel() * 4 for t in reference))  # the flat float32 buffer ElasticAveraging reduces
        reduce_s = _max_list(strategy, [time_allreduce(nbytes, device, top.stage_group)])[0]
    profile = PipelineProfile(
        stages=stages,
        batch_size=size,
        latency_s=latency,
        bandwidth=bandwidth,
        num_groups=strategy.topology.num_groups,
        schedule=strategy.config.schedule,
        stages_per_rank=v,
        reference_allreduce_s=reduce_s,
        sync_reference=strategy.config.synchronous_reference,
        averaging_period=int(strategy.config.averaging_period),
        outer_lr=float(strategy.config.outer_lr),
        outer_momentum=float(strategy.config.outer_momentum),
        shard_optimizer_state=bool(strategy.config.shard_optimizer_state),
    )
    profile.noise_scale, profile.noise_measurements = pooled_noise_scale(noise), len(noise)
    profile.cpu_share, profile.clock = round(share, 3), "cpu" if cpu else "wall"
    profile.rounds = len(shares) - 1  # a probe before each round and one at the end
    profile.timing_noise = round(noise_here, 4)
    # What the spans miss (posting, copies, waits the model does not see): measured step - the pipeline part of
    # the prediction itself (the simulator with the same latency and transfer costs), per unit
    measured = _max_list(strategy, residuals)
    sims = [0.0 if cpu else predict(profile, m, 1, schedule=base).pipeline_time for m in units_seen]
    a, c = fit_overhead(units_seen, [t - s for t, s in zip(measured, sims)])
    profile.iteration_overhead_s, profile.unit_overhead_s = a + _max_list(strategy, [per_iteration])[0], c
    return strategy.broadcast(profile, src=0)


def _variants(
    strategy: AvgPipeStrategy, sizes: Sequence[float], size: int
) -> tuple[str, str | None, list[tuple[float, int, Any]], dict[float, Any]]:
    """What the profile runs: its schedule, the one that splits the backward (or ``None``), a variant per size (size,
    M, variant) and, where that split is another schedule, its variant per size.

    One stage per rank: 1F1B, and ZB-H1 for the split backward's I and W. Several: the strategy's own schedule (its
    placement is the model's cut), whose spans are a chunk's; a rank's unit is v of them.
    """
    control = strategy.controller
    v = control.pipeline.chunks.v
    base = "1f1b" if v == 1 else strategy.config.schedule
    split = "zbh1" if v == 1 else (base if splits_backward(base) else None)
    settings, splits = [], {}
    for b in sizes:
        m = max(1, round(size / b))
        settings.append((b, m, control.variant(num_microbatches=m, schedule=base, advance_forwards=0)))
        if split is not None and split != base:
            splits[b] = control.variant(num_microbatches=m, schedule=split, advance_forwards=0)
    return base, split, settings, splits


def _recorder(out_bytes: dict[float, int], b: float) -> Any:
    """A forward hook that keeps the size of the first output it sees under ``b`` (the bytes a stage sends)."""

    def record(_mod: Any, _in: Any, out: Any) -> None:  # None: the output is kept
        out_bytes.setdefault(b, tensor_bytes(out))

    return record


def pooled_noise_scale(measurements: Sequence[GradientNorms]) -> float | None:
    """B_simple from the profile's measurements, all weighted alike (the same weights: no drift to follow)."""
    if not measurements:
        return None
    grad_sq = statistics.fmean(m.estimates()[0] for m in measurements)
    trace = statistics.fmean(m.estimates()[1] for m in measurements)
    return trace / grad_sq if grad_sq > 0 and trace > 0 else None


def _gather_stages(strategy: AvgPipeStrategy, mine: StageProfile) -> list[StageProfile]:
    if strategy.topology.num_stages == 1:
        return [mine]
    gathered: list[Any] = [None] * strategy.topology.num_stages
    dist.all_gather_object(gathered, mine, group=strategy.topology.pipeline_group)
    return list(gathered)


def _max_over(strategy: AvgPipeStrategy, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=strategy.root_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=strategy.topology.pipeline_group)
    return float(t[0])


def _max_list(strategy: AvgPipeStrategy, values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=strategy.root_device)
    if strategy.topology.num_stages > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=strategy.topology.pipeline_group)
    return [float(v) for v in t]
