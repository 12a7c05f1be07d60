"""The backward split in two (Zero Bubble Pipeline Parallelism, Qi et al., ICLR 2024): ``I``, the input gradient,
which the previous stage waits for, and ``W``, the weight gradient, which nothing waits for.

:func:`split_backward` takes every stage's forward/backward order (1F1B's for ZB-H1, the advance forward's for
``zbadvance``) and turns each ``B`` into an ``I`` in its place; it then places the ``W`` s by list scheduling on a
unit-cost clock (F = I = W): a stage runs its next ``F``/``I`` as soon as its input is there, and while it waits for
one it runs a queued ``W``. A stage holds at most ``cap`` units it has forwarded and not finished; at the cap a queued
``W`` runs before the next forward, and what is left of the queue runs at the end.

With ``cap`` the unsplit schedule's largest peak (stage 0's: S for 1F1B) the memory peak of the pipeline stays the
unsplit schedule's, and on every stage the units forwarded and not yet ``I``-ed stay what the unsplit order holds;
a unit past its ``I`` keeps only what its ``W`` needs. At these costs ZB-H1 idles S - 1 slots per stage where 1F1B
idles 3 (S - 1)::

    $ python -m lightning_avgpipe schedule --stages 4 --microbatches 8 --schedule zbh1

The placement is decided once, for unit costs: the executor runs the order as written, whatever the real costs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.chunks import PLACEMENT_COSTS


def split_backward(orders: Sequence[Sequence[Action]], cap: int) -> list[list[Action]]:
    """Each stage's order with every ``B`` split into ``I`` (in its place) and ``W`` (placed as the module says)."""
    return _ListScheduler(orders, cap).run()


class _ListScheduler:
    def __init__(self, orders: Sequence[Sequence[Action]], cap: int) -> None:
        S = self.S = len(orders)
        self.cap = cap
        self.seqs = [
            [Action(a.stage, Kind.INPUT_GRAD, a.unit) if a.kind is Kind.BACKWARD else a for a in o] for o in orders
        ]
        self.out: list[list[Action]] = [[] for _ in range(S)]
        self.pos = [0] * S
        self.free = [0.0] * S  # when each stage is next free
        self.held = [0] * S  # units forwarded and not finished
        self.queued: list[deque[Action]] = [deque() for _ in range(S)]
        self.arrival: dict[tuple[Kind, int, int], float] = {}  # (kind the message feeds, stage, unit) -> time

    def run(self) -> list[list[Action]]:
        blocked: set[int] = set()  # stages waiting for a message no stage has sent yet
        while any(self.busy(s) for s in range(self.S)):
            waiting = [s for s in range(self.S) if self.busy(s) and s not in blocked]
            if not waiting:
                stuck = [str(self.seqs[s][self.pos[s]]) for s in sorted(blocked)]
                raise RuntimeError(f"split_backward: the stages wait for {stuck}, which never come")
            s = min(waiting, key=lambda r: (self.free[r], r))
            if self.act(s):
                blocked.clear()  # what it sent may be what a blocked stage waits for
            else:
                blocked.add(s)
        return self.out

    def busy(self, s: int) -> bool:
        return self.pos[s] < len(self.seqs[s]) or bool(self.queued[s])

    def ready_at(self, s: int, a: Action) -> float | None:
        """When ``a``'s input is there: at once for the first stage's forward and the last stage's input gradient;
        ``None`` while its producer has not run."""
        if a.kind is Kind.FORWARD:
            return 0.0 if s == 0 else self.arrival.get((Kind.FORWARD, s, a.unit))
        return 0.0 if s == self.S - 1 else self.arrival.get((Kind.INPUT_GRAD, s, a.unit))

    def act(self, s: int) -> bool:
        """One decision of stage ``s`` at its free time; ``False`` when it can only wait, for a time not yet known."""
        now = self.free[s]
        if self.pos[s] == len(self.seqs[s]):
            self.execute(s, self.queued[s].popleft(), now)
            return True
        nxt = self.seqs[s][self.pos[s]]
        at = self.ready_at(s, nxt)
        at_cap = nxt.kind is Kind.FORWARD and self.held[s] >= self.cap and bool(self.queued[s])
        if at is not None and at <= now and not at_cap:
            self.pos[s] += 1
            self.execute(s, nxt, now)
        elif self.queued[s]:
            self.execute(s, self.queued[s].popleft(), now)
        elif at is not None:
            self.free[s] = at  # wait for the input, then run it
        else:
            return False
        return True

    def execute(self, s: int, a: Action, start: float) -> None:
        self.out[s].append(a)
        end = self.free[s] = start + PLACEMENT_COSTS[a.kind]
        if a.kind is Kind.FORWARD:
            self.held[s] += 1
            if s < self.S - 1:
                self.arrival[(Kind.FORWARD, s + 1, a.unit)] = end
        elif a.kind is Kind.INPUT_GRAD:
            self.queued[s].append(Action(a.stage, Kind.WEIGHT_GRAD, a.unit))
            if s > 0:
                self.arrival[(Kind.INPUT_GRAD, s - 1, a.unit)] = end
        else:
            self.held[s] -= 1
