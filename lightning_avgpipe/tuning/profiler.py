"""Measuring for the tuner (docs/how-it-works.md#choosing-m-and-n), and leaving no trace while doing it.

Everything here touches torch objects and returns plain numbers: the per-unit forward/backward times a traced
pipeline step shows, the bytes a stage's output and its saved activations take, the time of one replica's
optimizer step and elastic update (measured on copies), and the link's latency and bandwidth (a ping-pong
between neighbours). ``Snapshot`` saves and restores what a profiling run may change: RNG states, parameters'
gradients, buffers (BatchNorm statistics) and torchmetrics states.

The same profiler measures single layers for ``partition="balanced"`` (:func:`profile_layers`: forward and
backward time, activation bytes saved for backward, output bytes, parameter bytes per layer), with the same
activation meter and the same restore.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.algorithms.elastic import ElasticAveraging
from lightning_avgpipe.algorithms.microbatch import detached, tensors
from lightning_avgpipe.runtime.trace import ActivationMeter, Span
from lightning_avgpipe.shards import local


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) output, state or container (a tensor-parallel shard: what this rank
    holds of it)."""
    if isinstance(obj, Tensor):
        obj = local(obj)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, set)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


BUSY_BELOW = 0.85  # a profile whose processes got less of a core than this ran on a busy machine


def cpu_share(seconds: float = 0.05) -> float:
    """The share of a core this thread got over about ``seconds`` of pure Python work: its CPU time over the wall
    time (about 1.0 on a core of its own; about 0.5 with another busy process on it). One thread's work, so it
    reads the same whatever torch's thread count."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall0 < seconds:
        sum(range(2000))
    return min(1.0, (time.thread_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(state) for state in optimizer.state.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def took(span: Span, cpu: bool = False) -> float:
    """How long ``span`` held the stage: wall time, or (``cpu``) the stage thread's CPU time charged to it."""
    return span.cpu if cpu else span.end - span.start


def split_times(steps: Sequence[Sequence[Span]], cpu: bool = False) -> tuple[float, float]:
    """Time one unit's input gradient (``I``) and weight gradient (``W``) hold the stage, as :func:`unit_times`
    counts them (a send after ``I`` is charged to it; each step's mean, the median over steps); ``(0, 0)`` where the
    steps split no backward."""
    per_step: dict[str, list[float]] = {"I": [], "W": []}
    for spans in steps:
        grads: dict[str, list[float]] = {"I": [], "W": []}
        last: list[float] | None = None
        for s in spans:
            if s.kind in grads:
                grads[s.kind].append(took(s, cpu))
                last = grads[s.kind]
            elif s.kind == "F":
                last = None
            elif s.kind == "send" and last is not None:
                last[-1] += took(s, cpu)
        for kind, times in grads.items():
            if times:
                per_step[kind].append(statistics.fmean(times))
    return _median_or_zero(per_step["I"]), _median_or_zero(per_step["W"])


def unit_times(steps: Sequence[Sequence[Span]], cpu: bool = False) -> tuple[float, float]:
    """Time one unit's forward and backward hold the stage: each step's mean over its units (``steps``: a stage's
    spans per step, one per profile round), the median over steps.

    The mean within a step: a step's compute is the sum of its units', and the occasional slow unit (a cache miss,
    the other process taking the core) is paid by training at the same rate, so a median over units would make every
    prediction short by a share that grows with the units per step. The median over steps: a round the machine spent
    elsewhere (a burst of load, a collection) is one step's mean, and at the largest size, one unit a step, it would
    otherwise weigh on every row that size predicts.

    A send right after a compute is charged to it: on gloo an ``isend`` copies the tensor before returning, so
    it takes the stage's time like compute does (``wait`` spans are not charged: the simulator makes its own).
    ``cpu``: the stage thread's CPU time charged to each span instead of its wall time (what a busy machine does not
    stretch).
    """
    fwd: list[float] = []
    bwd: list[float] = []
    for spans in steps:
        f: list[float] = []
        b: list[float] = []
        last: list[float] | None = None
        for s in spans:
            if s.kind == "F":
                f.append(took(s, cpu))
                last = f
            elif s.kind == "B":
                b.append(took(s, cpu))
                last = b
            elif s.kind == "send" and last is not None:
                last[-1] += took(s, cpu)
        if f:
            fwd.append(statistics.fmean(f))
        if b:
            bwd.append(statistics.fmean(b))
    return _median_or_zero(fwd), _median_or_zero(bwd)


def _median_or_zero(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


class CopyOptimizer:
    """A fresh optimizer (``make_optimizer``) over copies of ``params`` with small random gradients.

    Its :meth:`step` is what one replica's optimizer step costs, and, run between profiled pipeline steps, it
    touches memory as the real optimizer does between training iterations. The real parameters and optimizer
    are untouched.
    """

    def __init__(
        self, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], params: Sequence[Tensor]
    ) -> None:
        self.device = params[0].device if params else torch.device("cpu")
        self.copies = [nn.Parameter(p.detach().clone()) for p in params]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for c in self.copies:
                c.grad = torch.randn_like(c) * 1e-3
        self.optimizer = make_optimizer(self.copies) if self.copies else None
        self.times: list[float] = []
        self.cpu_times: list[float] = []

    def step(self) -> float:
        if self.optimizer is None:
            return 0.0
        _sync(self.device)
        t0, c0 = time.perf_counter(), time.thread_time()
        self.optimizer.step()
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        self.times.append(elapsed)
        self.cpu_times.append(time.thread_time() - c0)
        return elapsed

    def median(self, cpu: bool = False) -> float:
        """Median step time (``cpu``: the thread's CPU time), the first (which creates the state) left out."""
        times = self.cpu_times if cpu else self.times
        timed = times[1:] or times
        return statistics.median(timed) if timed else 0.0

    def state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0


def time_elastic_update(layers: Sequence[nn.Module], device: torch.device, repeats: int = 3) -> float:
    """Median seconds one replica adds to the elastic update (offsets, pull, mean update), on copies."""
    copies = [copy.deepcopy(layer) for layer in layers]
    if not any(True for m in copies for _ in m.parameters()):
        return 0.0
    pair = ElasticAveraging(copies, 2, 1, None, None, True, device=device)
    times = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        pair.begin_step()
        pair.finish_step()
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def measure_link(
    stage: int,
    ranks: Sequence[int],
    nbytes: int,
    device: torch.device,
    group: Any = None,
    repeats: int = 5,
    least: bool = False,
) -> tuple[float, float]:
    """(latency seconds, bytes per second) between neighbouring stages: a ping-pong of 4 bytes and of ``nbytes``,
    the median of ``repeats`` (``least``: the fastest, what a busy machine's scheduling added least to).

    Every stage of the pipeline calls it (pairs take turns, in stage order). Returns the median over the pairs.
    """
    S = len(ranks)
    results = torch.zeros(2, dtype=torch.float64, device=device)  # on the device: NCCL has no CPU tensors
    if S < 2:
        return 0.0, float("inf")
    big = max(int(nbytes) // 4, 1)
    small_t, big_t = torch.zeros(1, device=device), torch.zeros(big, device=device)
    per_pair = []
    for s in range(S - 1):
        if stage not in (s, s + 1):
            continue
        peer = ranks[s + 1] if stage == s else ranks[s]
        times = []
        for t in (small_t, big_t):
            samples = []
            for r in range(repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                if stage == s:
                    dist.send(t, peer)
                    dist.recv(t, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(t, peer)
                _sync(device)
                if r:
                    samples.append((time.perf_counter() - t0) / 2)
            times.append(min(samples) if least else statistics.median(samples))
        if stage == s:
            per_pair.append(times)
    if per_pair:
        lat, t_big = per_pair[0]
        extra = max(t_big - lat, 1e-9)
        results[0], results[1] = lat, (big * 4) / extra
    # the pair's first stage measured it; every stage gets the median over pairs
    table = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(S)]
    dist.all_gather(table, results, group=group)
    pairs = [t for i, t in enumerate(table) if i < S - 1]
    lat = statistics.median(float(t[0]) for t in pairs)
    bw = statistics.median(float(t[1]) for t in pairs)
    return lat, bw


class Snapshot:
    """What a profiling run may change, saved on creation and put back by :meth:`restore`.

    RNG states (Python, NumPy, torch CPU and CUDA, and the ``generators`` given), the gradients of ``params``, the
    buffers of ``modules`` (BatchNorm statistics) and the states of ``metrics`` (torchmetrics objects, compared by
    their ``_defaults``).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        modules: Sequence[nn.Module],
        metrics: Sequence[Any] = (),
        generators: Sequence[torch.Generator] = (),
    ) -> None:
        self.python = random.getstate()
        self.generators = [(g, g.get_state()) for g in generators]  # e.g. a DataLoader's own generator
        try:
            import numpy as np

            self.numpy: Any = np.random.get_state()
        except ImportError:  # pragma: no cover
            self.numpy = None
        self.torch = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params]
        self.buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
        self.metrics = [(m, _metric_state(m)) for m in metrics]

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        for generator, generator_state in self.generators:
            generator.set_state(generator_state)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        for p, g in self.grads:  # a copy: backward accumulates into .grad in place, and restore may run twice
            p.grad = None if g is None else g.clone()
        with torch.no_grad():
            for b, value in self.buffers:
                b.copy_(value)
        for m, state in self.metrics:
            _load_metric_state(m, state)


def _metric_state(metric: Any) -> dict[str, Any]:
    state = {name: copy.deepcopy(getattr(metric, name)) for name in getattr(metric, "_defaults", {})}
    for name in ("_update_count", "_computed", "_forward_cache"):
        if hasattr(metric, name):
            state[name] = copy.deepcopy(getattr(metric, name))
    return state


def _load_metric_state(metric: Any, state: dict[str, Any]) -> None:
    for name, value in state.items():  # a copy: updates change states in place, and restore may run twice
        setattr(metric, name, copy.deepcopy(value))


def time_allreduce(nbytes: float, device: torch.device, group: Any, repeats: int = 3) -> float:
    """Median seconds of one all-reduce of ``nbytes`` (float32) over ``group``, after one untimed; collective."""
    t = torch.zeros(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
    times = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        _sync(device)
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_overhead(units: Sequence[int], residuals: Sequence[float]) -> tuple[float, float]:
    """Least squares ``residual = a + c * units`` (both clamped at 0): time a step spends outside the spans."""
    n = len(units)
    if n == 0:
        return 0.0, 0.0
    if n == 1 or len(set(units)) == 1:
        return max(0.0, statistics.mean(residuals)), 0.0
    mx, my = statistics.mean(units), statistics.mean(residuals)
    sxx = sum((x - mx) ** 2 for x in units)
    c = sum((x - mx) * (y - my) for x, y in zip(units, residuals)) / sxx
    c = max(0.0, c)
    a = max(0.0, my - c * mx)
    return a, c


# -- layers, for partition="balanced" --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """What one layer costs on the sample: median forward and backward seconds, and bytes."""

    forward: float
    backward: float
    param_bytes: int
    activation_bytes: int = 0  # saved for backward by one forward (parameters excluded)
    output_bytes: int = 0  # what the layer hands to the next (what a stage boundary after it would send)

    @property
    def compute(self) -> float:
        return self.forward + self.backward


def param_bytes(layer: nn.Module) -> int:
    return sum(local(p).numel() * p.element_size() for p in layer.parameters())


def profile_layers(
    layers: Sequence[nn.Module], sample: Any, repeats: int = 3, device: torch.device | None = None
) -> list[LayerCost]:
    """Time every layer's forward and backward on the activations that ``sample`` produces, layer by layer.

    Each layer is run ``repeats`` times after one warm-up run and the median is kept. Profiling leaves no
    trace: parameter gradients, buffers (BatchNorm statistics) and the random number generators are restored.
    """
    device = device or torch.device("cpu")
    snap = Snapshot([p for layer in layers for p in layer.parameters()], list(layers))
    try:
        return [_time_layer(layer, x, repeats, device) for layer, x in _inputs(layers, sample)]
    finally:
        snap.restore()


def _inputs(layers: Sequence[nn.Module], sample: Any) -> Iterator[tuple[nn.Module, Any]]:
    """Yield (layer, its input), running each layer once more on a detached input to get the next one."""
    x = sample
    for layer in layers:
        yield layer, x
        x = detached(layer(detached(x, requires_grad=True)), requires_grad=True)


def _time_layer(layer: nn.Module, x: Any, repeats: int, device: torch.device) -> LayerCost:
    fwd_times, bwd_times = [], []
    saved = out_bytes = 0
    for r in range(repeats + 1):
        inp = detached(x, requires_grad=True)
        meter = ActivationMeter(list(layer.parameters()))
        _sync(device)
        t0 = time.perf_counter()
        with meter.unit(0):
            out = layer(inp)
        _sync(device)
        t1 = time.perf_counter()
        outs = [t for t in tensors(out) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        _sync(device)
        t2 = time.perf_counter()
        if r > 0:  # the first run is a warm-up
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
        saved, out_bytes = meter.peak, tensor_bytes(out)
    return LayerCost(statistics.median(fwd_times), statistics.median(bwd_times), param_bytes(layer), saved, out_bytes)
