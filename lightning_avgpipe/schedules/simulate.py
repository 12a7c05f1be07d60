"""A discrete-event simulator of a plan: step time, per-stage busy time, bubbles and peak stash, without processes.

Semantics match the executor: receives are posted without blocking, sends never block, and a compute action
starts once its stage is free and the message it consumes has arrived (sent at the producer's end time, plus
the link latency and the transfer time). A plan that cannot make progress is a deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.generate import Plan


class DeadlockError(RuntimeError):
    """Raised when no stage of a plan can make progress."""


@dataclass(frozen=True)
class Event:
    """One compute action as simulated: where and when it ran."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """What the simulator predicts for one iteration of a plan."""

    events: tuple[tuple[Event, ...], ...]  # per stage, in execution order
    step_time: float
    busy: tuple[float, ...]  # per stage: time spent computing
    peak_stash: tuple[int, ...]  # per stage: most units forwarded and not yet finished (B, or W after I)
    peak_deferred: tuple[int, ...] = ()  # per stage: most units whose weight gradient waits (I done, W not yet)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step over all stages: 1 - sum(busy) / (S * step_time)."""
        if self.step_time <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * num_stages
    values = [float(v) for v in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries but the plan has {num_stages} stages; give one per stage.")
    return values


def simulate(
    plan: Plan,
    forward_cost: float | Sequence[float] = 1.0,
    backward_cost: float | Sequence[float] = 2.0,
    latency: float = 0.0,
    transfer_cost: float | Sequence[float] = 0.0,
    backward_transfer_cost: float | Sequence[float] | None = None,
    weight_grad_cost: float | Sequence[float] | None = None,
) -> Simulation:
    """Simulate ``plan`` with per-stage compute costs and a link model.

    Args:
        plan: the plan to run.
        forward_cost: time of one unit's forward, one number or one per stage.
        backward_cost: time of one unit's backward, one number or one per stage.
        latency: fixed time of every message between neighbours.
        transfer_cost: extra time of the message leaving each stage (bytes / bandwidth), one number or per stage.
        backward_transfer_cost: the same for the gradients each stage sends upstream when they differ in size
            from its activations (per stage); ``None``: ``transfer_cost``.
        weight_grad_cost: time of one unit's weight gradient (``W``) where the backward is split; the input
            gradient (``I``) takes the rest of ``backward_cost``. ``None``: half of ``backward_cost``.

    Raises:
        DeadlockError: when the plan cannot finish; the message says where every stage is stuck.
    """
    S = plan.num_stages
    fwd = _per_stage(forward_cost, S, "forward_cost")
    bwd = _per_stage(backward_cost, S, "backward_cost")
    xfer = _per_stage(transfer_cost, S, "transfer_cost")
    xfer_b = xfer if backward_transfer_cost is None else _per_stage(backward_transfer_cost, S, "backward_transfer_cost")
    wgt = [b / 2 for b in bwd] if weight_grad_cost is None else _per_stage(weight_grad_cost, S, "weight_grad_cost")
    cost = {
        Kind.FORWARD: fwd,
        Kind.BACKWARD: bwd,
        Kind.INPUT_GRAD: [b - w for b, w in zip(bwd, wgt)],
        Kind.WEIGHT_GRAD: wgt,
    }
    held = {Kind.FORWARD: 1, Kind.BACKWARD: -1, Kind.INPUT_GRAD: 0, Kind.WEIGHT_GRAD: -1}  # units not finished
    waiting_w = {Kind.INPUT_GRAD: 1, Kind.WEIGHT_GRAD: -1}
    deferred = [0] * S
    peak_deferred = [0] * S
    pos = [0] * S
    clock = [0.0] * S
    busy = [0.0] * S
    stash = [0] * S
    peak = [0] * S
    events: list[list[Event]] = [[] for _ in range(S)]
    arrivals: dict[tuple[Kind, int, int], float] = {}  # (kind, destination stage, unit) -> arrival time
    layout = plan.layout  # several chunks per rank: a stage's output to a stage on the same rank arrives at once
    last = layout.num_chunks - 1

    def step(s: int) -> bool:
        action = plan.stages[s][pos[s]]
        kind, u, j = action.kind, action.unit, action.stage
        if kind in (Kind.RECV_F, Kind.RECV_B):
            pass  # posting a receive never blocks
        elif kind is Kind.SEND_F:
            arrivals[(Kind.FORWARD, j + 1, u)] = clock[s] + latency + xfer[s]
        elif kind is Kind.SEND_B:
            arrivals[(Kind.BACKWARD, j - 1, u)] = clock[s] + latency + xfer_b[s]
        else:
            needs_msg = (kind is Kind.FORWARD and j > 0) or (kind.sends_grads and j < last)
            start = clock[s]
            if needs_msg:
                key = (Kind.FORWARD if kind is Kind.FORWARD else Kind.BACKWARD, j, u)
                if key not in arrivals:
                    return False
                start = max(start, arrivals.pop(key))
            took = cost[kind][s]
            clock[s] = start + took
            if kind is Kind.FORWARD and j < last and not layout.crosses(j, j + 1):
                arrivals[(Kind.FORWARD, j + 1, u)] = clock[s]
            elif kind.sends_grads and j > 0 and not layout.crosses(j - 1, j):
                arrivals[(Kind.BACKWARD, j - 1, u)] = clock[s]
            busy[s] += took
            events[s].append(Event(action, start, clock[s]))
            if plan.training:
                stash[s] += held[kind]
                peak[s] = max(peak[s], stash[s])
                deferred[s] += waiting_w.get(kind, 0)
                peak_deferred[s] = max(peak_deferred[s], deferred[s])
        pos[s] += 1
        return True

    remaining = sum(len(a) for a in plan.stages)
    while remaining:
        progressed = False
        for s in range(S):
            while pos[s] < len(plan.stages[s]) and step(s):
                progressed = True
                remaining -= 1
        if not progressed:
            stuck = ", ".join(
                f"stage {s} at {plan.stages[s][pos[s]]}" for s in range(S) if pos[s] < len(plan.stages[s])
            )
            raise DeadlockError(f"The plan deadlocks: {stuck} wait for messages that are never sent.")
    return Simulation(
        events=tuple(tuple(e) for e in events),
        step_time=max(clock) if clock else 0.0,
        busy=tuple(busy),
        peak_stash=tuple(peak),
        peak_deferred=tuple(peak_deferred),
    )


def timeline_table(sim: Simulation, resolution: float = 1.0, chunked: bool = False) -> str:
    """Render a simulation as a per-stage text timeline, one column per ``resolution`` time units; ``chunked`` (several
    stages per rank): one row per rank, each action labelled with its stage (``F3.0``: stage 3's forward of unit 0)."""
    slots = max(1, math.ceil(sim.step_time / resolution - 1e-9))
    rows = []
    width = 1
    cells: list[list[str]] = []
    for stage_events in sim.events:
        row = ["."] * slots
        for ev in stage_events:
            a = ev.action
            label = f"{a.kind.value}{a.stage}.{a.unit}" if chunked else f"{a.kind.value}{a.unit}"
            width = max(width, len(label))
            first = int(math.floor(ev.start / resolution + 1e-9))
            last = max(first + 1, int(round(ev.end / resolution)))  # every action gets at least one column
            for t in range(first, last):
                if 0 <= t < slots:
                    row[t] = label
        cells.append(row)
    for s, row in enumerate(cells):
        rows.append(f"{'rank' if chunked else 'stage'} {s} | " + " ".join(c.ljust(width) for c in row))
    header = "time    | " + " ".join(str(t % 10).ljust(width) for t in range(slots))
    return "\n".join([header, *rows])
