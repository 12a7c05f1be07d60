"""Predicting an iteration from a profile (docs/how-it-works.md#choosing-m-and-n): plain numbers in, plain numbers out.

A :class:`PipelineProfile` holds what was measured on one setting: per stage, the forward and backward time of
one unit and the activation bytes it saves, each at two or more micro-batch sizes; the bytes a unit sends
downstream; the weights' and one optimizer's state bytes; the time of one replica's optimizer step and elastic
update; and the link's latency and bandwidth. :func:`predict` turns it into the iteration time and each stage's
peak memory for any (M, N): the pipeline part by the simulator of ``schedules.simulate`` run on the plan the
strategy would run, the rest (N optimizer steps and elastic updates, the per-iteration overhead) added on.

Costs between measured micro-batch sizes are interpolated linearly; outside, the nearest segment is extended
(never below zero). Small micro-batches stop getting cheaper where the measured curve flattens: a per-unit
overhead is part of what the profile measures, not an assumption.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lightning_avgpipe.algorithms.noise_scale import effective_batch, efficiency, elastic_factor
from lightning_avgpipe.schedules import build_plan, simulate
from lightning_avgpipe.schedules.generate import CHUNKED, check_stages_per_rank, reads_k, splits_backward
from lightning_avgpipe.tuning.sharding import Sharded, check, wire_bytes


def interpolate(points: Mapping[float, float], x: float) -> float:
    """Piecewise-linear through ``points`` (size -> value), extended linearly past the ends, clamped at 0."""
    if not points:
        raise ValueError("interpolate needs at least one measured point")
    xs = sorted(points)
    if len(xs) == 1:  # one size: proportional to the size
        x0 = xs[0]
        return max(0.0, points[x0] * x / x0) if x0 else points[x0]
    if x <= xs[0]:
        a, b = xs[0], xs[1]
    elif x >= xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(v for v in xs if v >= x)
        a = xs[xs.index(b) - 1]
    slope = (points[b] - points[a]) / (b - a)
    return max(0.0, points[a] + slope * (x - a))


@dataclass
class StageProfile:
    """What one stage costs. Times in seconds, sizes in bytes; dict keys are micro-batch sizes (samples)."""

    forward_s: dict[float, float]
    backward_s: dict[float, float]
    activation_bytes: dict[float, float]  # saved for backward by one unit
    send_bytes: dict[float, float]  # one unit's output sent downstream (the gradient back is the same size)
    param_bytes: float  # one copy of the stage's weights
    optimizer_state_bytes: float  # one replica's optimizer state
    optimizer_step_s: float  # one replica's optimizer step
    elastic_s: float = 0.0  # one replica's share of the elastic update (pull + reference update)
    # the backward split (zbh1, zbadvance, zbv): one unit's input gradient (I) and weight gradient (W); empty when
    # not profiled
    input_grad_s: dict[float, float] = field(default_factory=dict)
    weight_grad_s: dict[float, float] = field(default_factory=dict)
    layer_bytes: float = 0.0  # the largest layer's weights (what FULL_SHARD gathers at once); 0: not measured

    def forward(self, b: float) -> float:
        return interpolate(self.forward_s, b)

    def backward(self, b: float) -> float:
        return interpolate(self.backward_s, b)

    @property
    def split_profiled(self) -> bool:
        """Whether the split backward (I and W) was timed."""
        return bool(self.input_grad_s) and bool(self.weight_grad_s)

    def split(self, b: float) -> tuple[float, float]:
        """One unit's (I, W) at micro-batch size ``b`` (profiled; the split costs what it measured over B)."""
        return interpolate(self.input_grad_s, b), interpolate(self.weight_grad_s, b)

    def activations(self, b: float) -> float:
        return interpolate(self.activation_bytes, b)

    def sent(self, b: float) -> float:
        return interpolate(self.send_bytes, b) if self.send_bytes else 0.0

    def static_bytes(
        self, num_pipelines: int, num_groups: int = 1, sharded: bool = False, exact: bool = False
    ) -> float:
        """Weights, gradients, optimizer states and the averaging's buffers for N replicas, during the step.

        One model per stage (``exact``, or N·D = 1): weights, gradients, one optimizer state. Otherwise N replicas
        with their gradients, optimizer states and pre-step offsets, the reference, and one flat buffer for the mean
        update (``elastic.ElasticAveraging``). ``sharded`` (``shard_optimizer_state`` over D > 1 groups,
        ``runtime/sharding/zero.py``): one model keeps 1/D of its optimizer state; elastic replicas keep a 1/D slice of
        the reference in place of the reference and the flat buffer.
        """
        w, o, n, d = self.param_bytes, self.optimizer_state_bytes, num_pipelines, num_groups
        sharded = sharded and d > 1
        if exact or n * d == 1:
            return 2 * w + (o / d if sharded else o)
        return n * (3 * w + o) + (w / d if sharded else 2 * w)

    def update_bytes(
        self, num_pipelines: int, num_groups: int = 1, sharded: bool = False, exact: bool = False
    ) -> float:
        """What the update holds for a moment after the backward, beyond :meth:`static_bytes`: a sharded elastic
        reference sums and gathers one stage's worth of weights (``runtime/sharding/sharded_reference.py``); nothing
        otherwise."""
        elastic_sharded = sharded and num_groups > 1 and not exact and num_pipelines * num_groups > 1
        return self.param_bytes if elastic_sharded else 0.0


@dataclass
class PipelineProfile:
    """One profiled pipeline: its stages, the link between neighbours, and the setting it describes."""

    stages: list[StageProfile]
    batch_size: int  # B: samples per pipeline per iteration (the DataLoader's batch size)
    latency_s: float = 0.0  # one message between neighbours
    bandwidth: float = math.inf  # bytes per second between neighbours
    num_groups: int = 1  # D
    iteration_overhead_s: float = 0.0  # per iteration, besides the pipeline and the updates
    unit_overhead_s: float = 0.0  # per unit on the critical path, outside the measured compute (posting, copies)
    batch_fetch_s: float = 0.0  # drawing one batch from the DataLoader (an iteration draws N)
    schedule: str = "1f1b"
    stages_per_rank: int = 1  # v of the profiled schedule (its costs are per rank: v chunks together)
    reference_allreduce_s: float = 0.0  # D > 1: one all-reduce of a stage's reference update over the D groups
    sync_reference: bool = False  # that all-reduce waited for (True) or overlapped with the next step's pipeline
    accumulate: int = 1  # K = accumulate_grad_batches: one optimizer step and elastic update every K iterations
    noise_scale: float | None = None  # B_simple measured on the profiled steps (None: not measured, or not positive)
    noise_measurements: int = 0  # profiled steps that measured it
    # the strategy's elastic options, which set elastic averaging's λ (noise.elastic_factor)
    averaging_period: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    shard_optimizer_state: bool = (
        False  # ZeRO-1 over the D groups (runtime/sharding/zero.py): what a stage holds per rank
    )
    cpu_share: float = 1.0  # the share of a core the profile's processes got (profiler.cpu_share): < 0.85 is busy
    clock: str = "wall"  # what timed the stages: "wall", or "cpu" (the stage threads' CPU time, on a busy CPU machine)
    timing_noise: float = 0.0  # relative standard error of a size's timed step compute (busy.timing_noise)
    rounds: int = 0  # the profile's timed rounds (every micro-batch size once each): busy.BUSY_ROUNDS x more when busy
    # how the D ranks of a stage shared it when profiled (tuning/sharding.py); a profile without it: NO_SHARD, or
    # SHARD_OPTIM with shard_optimizer_state
    sharding_strategy: str = "NO_SHARD"
    reduce_gradients: str = "per_microbatch"

    @property
    def sharding(self) -> str:
        """The profiled level: ``sharding_strategy``, or ``"SHARD_OPTIM"`` where only ``shard_optimizer_state`` says."""
        level = check(self.sharding_strategy, self.reduce_gradients)[0]
        return "SHARD_OPTIM" if level == "NO_SHARD" and self.shard_optimizer_state else level

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not math.isfinite(out["bandwidth"]):
            out["bandwidth"] = None  # strict JSON has no Infinity: null means free transfers
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PipelineProfile:
        def keyed(d: Mapping[Any, float]) -> dict[float, float]:
            return {float(k): float(v) for k, v in d.items()}

        stages = []
        for s in data["stages"]:
            s = dict(s)
            for name in ("forward_s", "backward_s", "activation_bytes", "send_bytes", "input_grad_s", "weight_grad_s"):
                s[name] = keyed(s.get(name, {}))
            stages.append(StageProfile(**s))
        rest = {k: v for k, v in data.items() if k != "stages"}
        if rest.get("bandwidth", 0.0) is None:
            rest["bandwidth"] = math.inf
        return cls(stages=stages, **rest)


@dataclass(frozen=True)
class Prediction:
    """What one setting is predicted to do per iteration."""

    num_microbatches: int
    num_pipelines: int
    advance_forwards: int
    step_time: float  # seconds per iteration, everything included
    pipeline_time: float  # the forwards and backwards of all units, with the bubbles
    update_time: float  # N optimizer steps, the elastic update and its all-reduce (slowest stage), per iteration
    samples_per_sec: float  # N·B·D / step_time
    peak_bytes: tuple[float, ...]  # per stage: static + the stash at its peak
    bubble_fraction: float
    feasible: bool = True
    why_not: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    averaging: str = "elastic"  # how the N batches combine: "elastic" (the paper's rule) or "exact" (one batch)
    # progress per sample relative to plain training at the user's batch B (algorithms/noise_scale.py)
    efficiency: float = 1.0
    goodput: float = math.nan  # samples_per_sec x efficiency
    schedule: str = "1f1b"
    stages_per_rank: int = 1  # v: model chunks per rank (interleaved, zbv)
    schedule_costs: tuple[float, float, float] | None = None  # a chunked plan's (F, I, W): what it was placed by
    sharding: str = "NO_SHARD"  # how the D ranks of a stage share it (tuning/sharding.py)
    reduce_gradients: str = "per_microbatch"
    rest_bytes: tuple[float, ...] = ()  # per stage: weights, gradients and optimizer state between steps
    traffic_bytes: float = 0.0  # per rank and iteration, the collectives over D (slowest stage)
    traffic_s: float = 0.0  # their time at the profiled all-reduce's rate, hidden or not

    def __post_init__(self) -> None:
        if math.isnan(self.goodput):
            object.__setattr__(self, "goodput", self.samples_per_sec * self.efficiency)

    def scaled(self, factor: float) -> Prediction:
        """This prediction with every time multiplied by ``factor`` (measured / predicted)."""
        return replace(
            self,
            step_time=self.step_time * factor,
            pipeline_time=self.pipeline_time * factor,
            update_time=self.update_time * factor,
            samples_per_sec=self.samples_per_sec / factor,
            goodput=self.goodput / factor,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["peak_bytes"], out["rest_bytes"] = list(self.peak_bytes), list(self.rest_bytes)
        for key in ("samples_per_sec", "goodput"):
            if not math.isfinite(out[key]):
                out[key] = None
        return out


def placing_costs(profile: PipelineProfile, schedule: str, b: float) -> tuple[float, float, float] | None:
    """What a chunked schedule (``interleaved``, ``zbv``) places its actions by at micro-batch size ``b``: one unit's
    (F, I, W) over all stages, as profiled (``schedule_costs``); ``None`` for the fixed-order schedules. Without a
    profiled split, I and W are each half the backward (only their sum, B, places ``interleaved``)."""
    if schedule not in CHUNKED:
        return None
    f = sum(st.forward(b) for st in profile.stages)
    if all(st.split_profiled for st in profile.stages):
        parts = [st.split(b) for st in profile.stages]
        i, w = sum(p[0] for p in parts), sum(p[1] for p in parts)
    else:
        i = w = sum(st.backward(b) for st in profile.stages) / 2
    return (round(f, 9), round(i, 9), round(w, 9)) if f > 0 and i > 0 and w > 0 else None


def predict(
    profile: PipelineProfile,
    num_microbatches: int,
    num_pipelines: int,
    schedule: str | None = None,
    advance_forwards: int = 0,
    memory_limit: float | None = None,
    latency_s: float | None = None,
    bandwidth: float | None = None,
    averaging: str = "elastic",
    stages_per_rank: int | None = None,
    sharding: str | None = None,
    reduce_gradients: str | None = None,
) -> Prediction:
    """Iteration time and per-stage peak memory of (M, N) from ``profile``.

    ``schedule`` may be any of ``schedules.SCHEDULES``: one that splits the backward (``zbh1``, ``zbadvance``,
    ``zbv``) runs on the profiled input- and weight-gradient times (it raises where they were not profiled); one
    with ``stages_per_rank`` v > 1 (``interleaved``, ``zbv``) cuts each rank's layers into v chunks of equal cost
    and activations. A unit whose weight gradient waits counts as held whole (an upper bound on its memory).

    ``latency_s``/``bandwidth`` override the profiled link (what-if); ``memory_limit`` (bytes) marks the
    setting infeasible when a stage's predicted peak exceeds it. ``averaging="exact"`` runs the same N·M units
    through one model: one optimizer step, no replicas, and with D > 1 an all-reduce of the gradients that the
    step waits for. The efficiency is that of :func:`noise.efficiency` at the profile's noise scale.

    ``sharding``/``reduce_gradients`` (``None``: the profile's) hold each stage as ``tuning/sharding.py`` counts it:
    its bytes per rank, and its collectives over D in the units (placed by the simulator) and at the step's end.
    ZeRO-2/3 need one model (``averaging="exact"``, or N x D = 1).
    """
    M, N = int(num_microbatches), int(num_pipelines)
    if M < 1 or N < 1:
        raise ValueError(f"num_microbatches={M} and num_pipelines={N} must be at least 1")
    if profile.batch_size % M:
        raise ValueError(
            f"num_microbatches={M} does not divide the batch size {profile.batch_size}; use one of "
            f"{divisors(profile.batch_size)}."
        )
    schedule = schedule or profile.schedule
    S = profile.num_stages
    b = profile.batch_size / M
    latency = profile.latency_s if latency_s is None else latency_s
    bw = profile.bandwidth if bandwidth is None else bandwidth
    if stages_per_rank is None and schedule == profile.schedule and profile.stages_per_rank > 1:
        stages_per_rank = profile.stages_per_rank
    v = check_stages_per_rank(schedule, stages_per_rank)
    exact = averaging == "exact"
    D = profile.num_groups
    level, reduce = check(sharding or profile.sharding, reduce_gradients or profile.reduce_gradients)
    held = Sharded(level, reduce, splits_backward(schedule))
    if held.fsdp and D > 1 and not exact and N * D > 1:
        raise ValueError(f"sharding={level!r} shards one model over the D groups: it needs averaging='exact'.")
    fwd = [st.forward(b) / v for st in profile.stages]
    bwd = [st.backward(b) / v for st in profile.stages]
    wgt = None
    if splits_backward(schedule):
        if not all(st.split_profiled for st in profile.stages):
            raise ValueError(
                f"schedule={schedule!r} splits the backward, whose input and weight gradients this profile did not "
                "time (StageProfile.input_grad_s, weight_grad_s); profile with AvgPipeTuner, which times them."
            )
        parts = [st.split(b) for st in profile.stages]
        bwd, wgt = [(i + w) / v for i, w in parts], [w / v for _, w in parts]
    if not bw > 0:
        raise ValueError(f"bandwidth={bw!r} must be a positive number of bytes per second (math.inf: free transfers).")
    if latency < 0:
        raise ValueError(f"latency_s={latency!r} must be >= 0 seconds.")
    # a unit's collectives over D, beyond those the profiled units ran: an all-gather of stage s's weights costs
    # half the measured all-reduce, scaled from the largest stage's
    profiled = Sharded(
        profile.sharding, profile.reduce_gradients, profile.stages_per_rank > 1 and splits_backward(profile.schedule)
    )
    biggest = max((st.param_bytes for st in profile.stages), default=0.0) or 1.0
    half = [profile.reference_allreduce_s / 2 * st.param_bytes / biggest for st in profile.stages]
    (f_new, b_new), (f_old, b_old) = held.per_unit(D), profiled.per_unit(D)
    fwd = [max(0.0, f + (f_new - f_old) * h / v) for f, h in zip(fwd, half)]
    bwd = [max(0.0, x + (b_new - b_old) * h / v) for x, h in zip(bwd, half)]
    free = S == 1 or not math.isfinite(bw)
    # stage s sends its activations downstream and, upstream, the gradients of its input (stage s-1's output)
    xfer = [0.0 if free or s == S - 1 else profile.stages[s].sent(b) / bw for s in range(S)]
    xfer_b = [0.0 if free or s == 0 else profile.stages[s - 1].sent(b) / bw for s in range(S)]
    k = advance_forwards if reads_k(schedule) else 0
    costs = placing_costs(profile, schedule, b)
    plan = build_plan(schedule, S, N * M, k, stages_per_rank=v, costs=costs)
    sim = simulate(
        plan,
        fwd,
        bwd,
        latency=latency if S > 1 else 0.0,
        transfer_cost=xfer,
        backward_transfer_cost=xfer_b,
        weight_grad_cost=wgt,
    )
    replicated = N * profile.num_groups > 1 and not exact
    update = max(
        N * (st.optimizer_step_s + st.elastic_s) if replicated else st.optimizer_step_s for st in profile.stages
    )
    if profile.num_groups > 1:  # the reference update's all-reduce; overlapped, it hides behind the next pipeline
        allreduce = profile.reference_allreduce_s  # exact: the gradients' all-reduce (the same bytes) and what the
        if exact:  # level adds (tuning/sharding.py), always waited for
            update += held.per_step(D, exact) * allreduce / 2
        else:
            update += allreduce if profile.sync_reference else max(0.0, allreduce - sim.step_time)
    update /= max(1, profile.accumulate)  # per iteration: one update every K iterations
    step = (
        sim.step_time
        + update
        + profile.iteration_overhead_s
        + profile.unit_overhead_s * N * M
        + profile.batch_fetch_s * N
    )
    one = exact or N * D == 1
    zero1 = level == "SHARD_OPTIM"
    rests = tuple(
        held.rest_bytes(st.param_bytes, st.optimizer_state_bytes, D) if one else st.static_bytes(N, D, zero1, exact)
        for st in profile.stages
    )
    peaks = tuple(
        (held.step_bytes(st.param_bytes, st.optimizer_state_bytes, st.layer_bytes, D) if one else rests[s])
        + max(  # the activations peak in the step; a sharded reference's update comes after them
            sim.peak_stash[s] * st.activations(b) / v,
            st.update_bytes(N, D, zero1, exact),
        )
        for s, st in enumerate(profile.stages)
    )
    units = N * M
    collectives = held.collectives(units, D, exact) if exact else (2.0 if D > 1 else 0.0)
    traffic = max((wire_bytes(st.param_bytes, D) for st in profile.stages), default=0.0) * collectives
    feasible, why = True, ""
    if memory_limit is not None:
        worst = max(range(S), key=lambda s: peaks[s])
        if peaks[worst] > memory_limit:
            feasible = False
            why = f"stage {worst} needs {peaks[worst] / 2**20:.1f} MiB > limit {memory_limit / 2**20:.1f} MiB"
    samples = N * profile.batch_size * profile.num_groups
    user_batch = profile.batch_size * max(1, profile.accumulate)  # what one optimizer step of N = 1 takes
    factor, _ = elastic_factor(profile.averaging_period, profile.outer_lr, profile.outer_momentum)
    b_eff = effective_batch(averaging, N, user_batch, profile.num_groups, factor)
    eff = efficiency(profile.noise_scale, user_batch, b_eff)
    return Prediction(
        num_microbatches=M,
        num_pipelines=N,
        advance_forwards=k,
        step_time=step,
        pipeline_time=sim.step_time,
        update_time=update,
        samples_per_sec=samples / step if step > 0 else math.inf,
        peak_bytes=peaks,
        bubble_fraction=sim.bubble_fraction,
        feasible=feasible,
        why_not=why,
        averaging="exact" if exact else "elastic",
        efficiency=eff,
        schedule=schedule,
        stages_per_rank=v,
        schedule_costs=costs,
        sharding=level if D > 1 else "NO_SHARD",
        reduce_gradients=reduce,
        rest_bytes=rests,
        traffic_bytes=traffic,
        traffic_s=collectives * profile.reference_allreduce_s / 2,
    )


def checkpointed_unit_bytes(
    activation_bytes: Sequence[float], output_bytes: Sequence[float], input_bytes: float, mask: Sequence[bool]
) -> float:
    """One unit's saved bytes on a stage whose layers in ``mask`` are checkpointed (``runtime/recompute.py``).

    A checkpointed layer keeps its input (the previous layer's output, or ``input_bytes`` for the first) instead
    of what its operations save; the others keep what they save. From a per-layer profile
    (``tuning.profiler.profile_layers``: ``activation_bytes`` and ``output_bytes`` per layer) at one micro-batch
    size; with ``mask`` all False it is the plain stash of one unit.
    """
    total, previous = 0.0, float(input_bytes)
    for saved, out, checkpointed in zip(activation_bytes, output_bytes, mask):
        total += previous if checkpointed else float(saved)
        previous = float(out)
    return total


def checkpointed(profile: PipelineProfile, layers: Sequence[int]) -> PipelineProfile:
    """``profile`` with every layer of every stage checkpointed (``runtime/recompute.py``), estimated from what a
    stage-level profile has: a unit keeps one input per layer, each the size of a boundary activation (what the
    previous stage sends; stage 0 takes its own output's size), and the backward runs the forward again.

    ``layers``: the layer count of each stage. A per-layer profile gives the exact stash instead
    (:func:`checkpointed_unit_bytes`)."""
    stages = []
    sent = [st.send_bytes for st in profile.stages]
    fallback = next((d for d in sent if d), {})
    for s, (st, count) in enumerate(zip(profile.stages, layers)):
        boundary = (sent[s - 1] if s > 0 else sent[s]) or fallback
        stash = (
            {b: count * interpolate(boundary, b) for b in st.activation_bytes}
            if boundary
            else dict(st.activation_bytes)
        )
        stages.append(
            replace(
                st,
                activation_bytes={b: min(v, st.activation_bytes[b]) for b, v in stash.items()},
                backward_s={b: v + st.forward(b) for b, v in st.backward_s.items()},
            )
        )
    return replace(profile, stages=stages)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_sizes(batch_size: int, candidates: Sequence[int]) -> list[float]:
    """The micro-batch sizes to profile so that every candidate M is interpolated, not extrapolated.

    The smallest and the largest size the candidates use, and (when they are far apart) one in between.
    """
    sizes = sorted({batch_size / m for m in candidates})
    if len(sizes) <= 2:
        return sizes
    lo, hi = sizes[0], sizes[-1]
    mid = min(sizes[1:-1], key=lambda v: abs(math.log(v) - (math.log(lo) + math.log(hi)) / 2))
    return [lo, mid, hi]
