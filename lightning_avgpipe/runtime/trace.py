"""What one stage did in one step: a timeline of compute, communication waits and sends, and activation memory.

The executor fills a :class:`StepTrace` on every step (a few ``perf_counter`` calls per action). From it come the
per-step figures the strategy logs (bubble fraction, communication wait, peak activation bytes) and, for a traced
step, Chrome-trace events (:func:`chrome_trace`) that open in Perfetto, with the same format the simulator emits.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.shards import local

COMPUTE = ("F", "B", "I", "W")  # the kinds of span that run the stage: forward, backward, input and weight grads


@dataclass(frozen=True)
class Span:
    """One interval on a stage's timeline. ``kind``: "F", "B", "I", "W" (compute: :data:`COMPUTE`), "wait" (blocked on
    a neighbour), "send"."""

    kind: str
    unit: int
    start: float
    end: float
    cpu: float = 0.0  # the stage thread's CPU seconds since the previous span ended (the span and what led to it)


@dataclass
class StepTrace:
    """One stage's step: spans relative to the step start (seconds), and activation memory. Each span also carries
    the CPU time of the thread that runs the stage since the previous one, which a busy machine does not stretch as it
    stretches wall time (the tuner's profile reads it there). The thread's, not the process's: the communication
    library's threads run beside the stage and would charge each unit their time, the more the smaller the unit."""

    stage: int
    spans: list[Span] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    end: float = 0.0
    peak_activation_bytes: int = 0
    cpu_start: float = field(default_factory=time.thread_time)
    cpu_end: float = 0.0
    cpu_mark: float = -1.0  # the thread's CPU time when the last span was added (-1: none yet)

    def add(self, kind: str, unit: int, t0: float, t1: float) -> None:
        now = time.thread_time()
        since = now - (self.cpu_start if self.cpu_mark < 0 else self.cpu_mark)
        self.cpu_mark = now
        self.spans.append(Span(kind, unit, t0 - self.start, t1 - self.start, since))

    def finish(self) -> None:
        self.end = time.perf_counter()
        self.cpu_end = time.thread_time()

    @property
    def step_time(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def step_cpu(self) -> float:
        """The stage thread's CPU seconds over the step."""
        return max(0.0, self.cpu_end - self.cpu_start)

    @property
    def compute_time(self) -> float:
        return sum(s.end - s.start for s in self.spans if s.kind in COMPUTE)

    @property
    def wait_time(self) -> float:
        return sum(s.end - s.start for s in self.spans if s.kind == "wait")

    @property
    def bubble_fraction(self) -> float:
        """Share of the step this stage was not computing (waiting, communicating or idle)."""
        return 1.0 - self.compute_time / self.step_time if self.step_time > 0 else 0.0

    def summary(self) -> list[float]:
        """[step time, compute time, communication wait, bubble fraction, peak activation bytes]."""
        peak = float(self.peak_activation_bytes)
        return [self.step_time, self.compute_time, self.wait_time, self.bubble_fraction, peak]


_PACKERS: list[Callable[[Tensor], Tensor]] = []  # the meters' hooks of the units whose forward is running


def note_saved(t: Tensor) -> None:
    """Count ``t`` as saved for backward by the unit whose forward is running (if one is metered).

    Activation checkpointing keeps a checkpointed layer's input outside autograd's saved tensors, where the
    saved-tensor hooks do not see it (``runtime/recompute.py`` reports it here).
    """
    if _PACKERS:
        _PACKERS[-1](t)


class ActivationMeter:
    """Bytes of tensors autograd saves for backward, per unit in flight (saved-tensor hooks; parameters excluded).

    The peak over a step is the stage's activation memory (the stash): what the schedule trades against speed.
    """

    def __init__(self, parameters: Sequence[Tensor] = ()) -> None:
        # parameters are excluded by storage: autograd often saves a view of a weight (``weight.t()``); read again
        # at each reset, as a parameter may move into another storage (ZeRO-1 makes them views of one flat buffer)
        self._weights = list(parameters)
        self._params = self._storages()
        self._units: dict[Hashable, int] = {}
        self._seen: set[tuple[int, Hashable]] = set()
        self.current = 0
        self.peak = 0

    @contextlib.contextmanager
    def unit(self, u: Hashable) -> Iterator[None]:
        """Count what the forward of unit ``u`` saves."""

        def pack(saved: Tensor) -> Tensor:
            t = local(saved)  # a tensor-parallel layer saves DTensors: their shard is what memory holds
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            base = t._base if t._base is not None else t  # FSDP's gathered weights: parameters of their own storage
            if ptr not in self._params and not isinstance(base, nn.Parameter):
                key = (t.data_ptr(), u)
                if key not in self._seen:
                    self._seen.add(key)
                    size = t.numel() * t.element_size()  # the tensor itself, not the batch it may be a slice of
                    self._units[u] = self._units.get(u, 0) + size
                    self.current += size
                    self.peak = max(self.peak, self.current)
            return saved

        _PACKERS.append(pack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            _PACKERS.pop()

    def release(self, u: Hashable) -> None:
        """Unit ``u``'s backward ran: its saved tensors are freed."""
        self.current -= self._units.pop(u, 0)

    def _storages(self) -> set[int]:
        return {local(p).untyped_storage().data_ptr() for p in self._weights if p.numel()}

    def reset(self) -> None:
        self._params = self._storages()
        self._units.clear()
        self._seen.clear()
        self.current = self.peak = 0


def saved_bytes(fn: Callable[[], Any], parameters: Sequence[Tensor]) -> int:
    """Bytes autograd saves for the backward while ``fn`` runs, ``parameters`` excluded (:class:`ActivationMeter`
    over one unit): a forward's activation memory."""
    meter = ActivationMeter(parameters)
    with meter.unit(0):
        fn()
    return meter.peak


def spans_from_simulation(sim: Any) -> list[list[Span]]:
    """The simulator's timeline (:class:`~lightning_avgpipe.schedules.Simulation`) as spans, to draw or compare."""
    return [[Span(e.action.kind.value, e.action.unit, e.start, e.end) for e in stage] for stage in sim.events]


def chrome_trace(timelines: Sequence[Sequence[Span]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """Chrome-trace JSON (opens in Perfetto / chrome://tracing): one track per stage, spans in microseconds."""
    colours = {
        "F": "thread_state_running",
        "B": "rail_load",
        "I": "rail_response",
        "W": "rail_idle",
        "wait": "bad",
        "send": "grey",
    }
    events: list[dict[str, Any]] = []
    for s, spans in enumerate(timelines):
        name = names[s] if names else f"stage {s}"
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": name}})
        for span in spans:
            label = f"{span.kind}{span.unit}" if span.kind in COMPUTE else span.kind
            events.append(
                {
                    "name": label,
                    "cat": span.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": s,
                    "ts": span.start * 1e6,
                    "dur": max(0.0, span.end - span.start) * 1e6,
                    "cname": colours.get(span.kind, "generic_work"),
                    "args": {"unit": span.unit},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(
    path: Path,
    timelines: Sequence[Sequence[Span]],
    title: str,
    names: Sequence[str] | None = None,
    time_unit: str | None = None,
) -> tuple[Path, Path | None]:
    """Write ``path`` (.json, Chrome trace) and a PNG Gantt chart beside it (if matplotlib is installed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(timelines, names)))
    tmp.replace(path)
    return path, gantt_png(path.with_suffix(".png"), timelines, title, names, time_unit)


def gantt_png(
    path: Path,
    timelines: Sequence[Sequence[Span]],
    title: str,
    names: Sequence[str] | None = None,
    time_unit: str | None = None,
) -> Path | None:
    """A Gantt chart in the style of the paper's figures: forwards light, backwards dark, waits hatched."""
    try:
        # a Figure with its own Agg canvas: no pyplot, so the user's backend and open figures are left alone
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        return None
    S = len(timelines)
    end = max((span.end for spans in timelines for span in spans), default=1.0) or 1.0
    scale, unit_label = (1e3, "ms") if end < 10 else (1.0, "s")
    if time_unit is not None:  # simulated timelines are in cost units
        scale, unit_label = 1.0, time_unit
    fig = Figure(figsize=(max(8.0, min(24.0, 0.25 * sum(len(t) for t in timelines) / max(1, S) + 6)), 0.6 * S + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    style = {
        "F": ("#9ecae1", None),
        "B": ("#3182bd", None),
        "I": ("#31a354", None),
        "W": ("#a1d99b", None),
        "wait": ("#fdd0a2", "///"),
        "send": ("#d9d9d9", None),
    }
    for s, spans in enumerate(timelines):
        y = S - 1 - s
        for span in spans:
            colour, hatch = style.get(span.kind, ("#cccccc", None))
            width = (span.end - span.start) * scale
            ax.barh(
                y,
                width,
                left=span.start * scale,
                height=0.8,
                color=colour,
                hatch=hatch,
                edgecolor="white",
                linewidth=0.3,
            )
            if span.kind in COMPUTE and width > end * scale / 60:
                ax.text(
                    (span.start + span.end) / 2 * scale,
                    y,
                    f"{span.kind}{span.unit}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if span.kind in ("B", "I") else "black",
                )
    ax.set_yticks(range(S))
    ax.set_yticklabels(list(reversed(names if names else [f"stage {s}" for s in range(S)])))
    ax.set_xlabel(f"time ({unit_label})")
    ax.set_title(title, fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=c, hatch=h) for c, h in style.values()]
    fig.legend(
        handles,
        ["forward", "backward", "input gradient", "weight gradient", "waiting on a neighbour", "send"],
        loc="lower center",
        fontsize=7,
        ncols=6,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    return path
