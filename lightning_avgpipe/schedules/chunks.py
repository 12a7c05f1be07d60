"""Several model chunks per rank: where each stage runs, and the list scheduler of the chunked schedules.

With ``v`` chunks per rank the model is cut into ``S x v`` stages, and rank ``r`` runs ``v`` of them:

- loop placement (interleaved 1F1B, Megatron's virtual stages): stage ``c x S + r`` is chunk ``c`` of rank ``r``, so a
  unit goes round the ranks ``v`` times;
- V placement (ZB-V, ``v = 2``): rank ``r`` runs stages ``r`` and ``2S - 1 - r``, so a unit goes down the ranks and
  back up, and the first and last stages share rank 0 (the loss's gradient starts where the input came in).

An action's ``stage`` is the stage (``0 .. S v - 1``); a plan holds one action list per rank. Between stages on one
rank nothing is sent: the output stays on the rank.

:func:`chunked_orders` places every rank's computes by list scheduling on a clock of action costs: unit costs
(F = 1, B = 2, or I = W = 1 where the backward is split), or measured ones (:func:`placement_costs`; I and W are
seldom equal, and a plan placed by their real ratio idles less). At each free moment a rank runs the ready backward
of its highest stage (it unblocks the most), else a ready forward of its highest stage while it holds fewer than
``cap`` unfinished units, else a queued weight gradient, else it waits. ``cap`` is the memory in chunk units:
``v x S`` for ZB-V (1F1B's peak, S stage-sized units on rank 0), Megatron's warm-up plus one for interleaved 1F1B.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lightning_avgpipe.schedules.actions import Action, Kind

PLACEMENTS = ("loop", "v")
# the costs the list schedules place actions by (a forward is 1): what they are for a stage of Linear layers
PLACEMENT_COSTS: dict[Kind, float] = {
    Kind.FORWARD: 1.0,
    Kind.BACKWARD: 2.0,
    Kind.INPUT_GRAD: 1.0,
    Kind.WEIGHT_GRAD: 1.0,
}


def placement_costs(forward: float, input_grad: float, weight_grad: float) -> dict[Kind, float]:
    """The costs to place actions by, from one unit's forward, input-gradient and weight-gradient times (any unit),
    scaled so a forward is 1; the whole backward is ``input_grad + weight_grad``."""
    values = {"forward": forward, "input_grad": input_grad, "weight_grad": weight_grad}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r} must be a positive time; give the measured (F, I, W) of one unit.")
    f = float(forward)
    return {
        Kind.FORWARD: 1.0,
        Kind.BACKWARD: (input_grad + weight_grad) / f,
        Kind.INPUT_GRAD: input_grad / f,
        Kind.WEIGHT_GRAD: weight_grad / f,
    }


@dataclass(frozen=True)
class Layout:
    """Which rank runs which stage: ``num_ranks`` ranks of ``v`` chunks each, placed ``placement``."""

    num_ranks: int
    v: int = 1
    placement: str = "loop"

    @property
    def num_chunks(self) -> int:
        """The model's stages: ``num_ranks x v``."""
        return self.num_ranks * self.v

    def rank_of(self, stage: int) -> int:
        return rank_of(stage, self.num_ranks, self.placement)

    def crosses(self, stage: int, other: int) -> bool:
        """Whether what goes between ``stage`` and ``other`` leaves the rank (a message) or stays on it."""
        return self.rank_of(stage) != self.rank_of(other)


def rank_of(stage: int, num_ranks: int, placement: str = "loop") -> int:
    """The rank that runs ``stage`` (of ``num_ranks x v``)."""
    if placement == "v":
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def stages_of(rank: int, num_ranks: int, v: int, placement: str = "loop") -> list[int]:
    """The stages ``rank`` runs, in stage order."""
    return [s for s in range(num_ranks * v) if rank_of(s, num_ranks, placement) == rank]


def chunked_orders(
    num_ranks: int,
    num_units: int,
    v: int,
    placement: str,
    split: bool,
    caps: list[int],
    training: bool = True,
    sequences: list[tuple[list[Action], list[Action]]] | None = None,
    costs: dict[Kind, float] | None = None,
) -> list[list[Action]]:
    """Every rank's compute actions, in execution order (see the module docstring). With ``sequences`` (per rank,
    its forwards and its backwards in order) a rank takes the next of each in that order, as they become ready;
    ``costs``: what each kind of action costs (:func:`placement_costs`; ``None``: ``PLACEMENT_COSTS``)."""
    if not training:  # evaluation: each unit down the stages, in unit order on every rank
        return [
            [Action(s, Kind.FORWARD, u) for u in range(num_units) for s in stages_of(r, num_ranks, v, placement)]
            for r in range(num_ranks)
        ]
    try:
        return _ChunkScheduler(num_ranks, num_units, v, placement, split, caps, sequences, costs).run()
    except _DeadlockError:  # some cost sets fill a rank with its first chunk's units while its last chunk's input waits
        pass
    try:  # each rank keeps its last unit of room for its chunk nearest the loss: that chunk always moves on
        return _ChunkScheduler(num_ranks, num_units, v, placement, split, caps, sequences, costs, reserve=True).run()
    except _DeadlockError:  # pragma: no cover - the reserve leaves a way through (tests/test_chunks.py's cost grid)
        raise RuntimeError(
            f"chunked_orders: the ranks wait for each other (S={num_ranks}, units={num_units}, v={v}, costs "
            f"{ {k.name: c for k, c in (costs or PLACEMENT_COSTS).items()} }); build the plan without costs "
            "(schedule_costs=None) and report this."
        ) from None


class _DeadlockError(Exception):
    """Every rank waits on another (raised by the scheduler, handled by :func:`chunked_orders`)."""


def megatron_sequences(num_ranks: int, num_units: int, v: int, rank: int) -> tuple[list[Action], list[Action]]:
    """Interleaved 1F1B's orders on ``rank`` (Megatron-LM's): the forwards through the chunks in groups of
    ``num_ranks`` units (the last group may be smaller), the backwards through them in reverse."""
    S = num_ranks
    groups = [list(range(g, min(num_units, g + S))) for g in range(0, num_units, S)]
    forwards = [Action(c * S + rank, Kind.FORWARD, u) for us in groups for c in range(v) for u in us]
    backwards = [Action(c * S + rank, Kind.BACKWARD, u) for us in groups for c in reversed(range(v)) for u in us]
    return forwards, backwards


class _ChunkScheduler:
    def __init__(
        self,
        S: int,
        U: int,
        v: int,
        placement: str,
        split: bool,
        caps: list[int],
        sequences: list[tuple[list[Action], list[Action]]] | None = None,
        costs: dict[Kind, float] | None = None,
        reserve: bool = False,
    ) -> None:
        self.S, self.U, self.V, self.split, self.caps = S, U, S * v, split, caps
        self.reserve = reserve  # a rank's last unit of room kept for its highest stage (the chunk nearest the loss)
        self.costs = PLACEMENT_COSTS if costs is None else costs
        self.sequences = sequences
        self.taken = [[0, 0] for _ in range(S)]  # with sequences: forwards and backwards taken per rank
        self.placement = placement
        self.rank = [rank_of(j, S, placement) for j in range(self.V)]
        self.stages = [stages_of(r, S, v, placement) for r in range(S)]
        self.next_f = [0] * self.V  # per stage: the next unit to forward
        self.next_b = [0] * self.V  # per stage: the next unit to backward
        self.free = [0.0] * S
        self.held = [0] * S
        self.queued: list[deque[Action]] = [deque() for _ in range(S)]
        self.ready: dict[tuple[Kind, int, int], float] = {}  # (F or B, stage, unit) -> when its input is there
        self.out: list[list[Action]] = [[] for _ in range(S)]

    def run(self) -> list[list[Action]]:
        blocked: set[int] = set()
        while any(self.busy(r) for r in range(self.S)):
            waiting = [r for r in range(self.S) if self.busy(r) and r not in blocked]
            if not waiting:
                raise _DeadlockError
            r = min(waiting, key=lambda q: (self.free[q], q))
            if self.act(r):
                blocked.clear()
            else:
                blocked.add(r)
        return self.out

    def busy(self, r: int) -> bool:
        return bool(self.queued[r]) or any(self.next_b[j] < self.U for j in self.stages[r])

    def at(self, kind: Kind, j: int, u: int) -> float | None:
        """When the input of stage ``j``'s forward (or backward) of unit ``u`` is there; ``None``: not yet known."""
        if kind is Kind.FORWARD:
            return 0.0 if j == 0 else self.ready.get((Kind.FORWARD, j, u))
        return self.ready.get((Kind.BACKWARD, j, u))  # the last stage's: its own forward's end

    def candidates(self, r: int, kind: Kind) -> list[tuple[float | None, int, int]]:
        """(input time, stage, unit) of rank ``r``'s next forward or backward on each of its stages, highest stage
        first."""
        if self.sequences is not None:
            which = 0 if kind is Kind.FORWARD else 1
            seq, i = self.sequences[r][which], self.taken[r][which]
            return [(self.at(kind, seq[i].stage, seq[i].unit), seq[i].stage, seq[i].unit)] if i < len(seq) else []
        out = []
        for j in sorted(self.stages[r], reverse=True):
            u = self.next_f[j] if kind is Kind.FORWARD else self.next_b[j]
            if u < self.U and (kind is Kind.FORWARD or u < self.next_f[j]):
                out.append((self.at(kind, j, u), j, u))
        return out

    def act(self, r: int) -> bool:
        now = self.free[r]
        backs = [(Kind.BACKWARD, *c) for c in self.candidates(r, Kind.BACKWARD)]
        room = self.caps[r] - self.held[r]
        top = max(self.stages[r])
        fwds = [
            (Kind.FORWARD, *c)
            for c in (self.candidates(r, Kind.FORWARD) if room > 0 else [])
            if not self.reserve or room > 1 or c[1] == top
        ]
        for group in (backs, fwds):
            # the highest stage whose input is there, among each link's first arrival (a link delivers in order)
            first: dict[object, tuple[float, int, int, Kind]] = {}
            for kind, t, j, u in group:
                if t is not None and t <= now:
                    link = self.source(kind, j)
                    if link not in first or t < first[link][0]:
                        first[link] = (t, j, u, kind)
            if first:
                _, j, u, kind = max(first.values(), key=lambda c: c[1])
                self.execute(r, j, u, kind, now)
                return True
        if self.queued[r]:
            self.finish_weight(r, now)
            return True
        times = [t for _, t, _, _ in backs + fwds if t is not None]
        if times:
            self.free[r] = min(times)
            return True
        return False

    def source(self, kind: Kind, j: int) -> object:
        """Where the input of stage ``j``'s forward (backward) comes from: a rank's link, or this rank."""
        other = j - 1 if kind is Kind.FORWARD else j + 1
        if not 0 <= other < self.V or self.rank[other] == self.rank[j]:
            return ("here", j)
        return ("link", self.rank[other], kind)

    def execute(self, r: int, j: int, u: int, kind: Kind, now: float) -> None:
        self.taken[r][0 if kind is Kind.FORWARD else 1] += 1
        if kind is Kind.FORWARD:
            self.out[r].append(Action(j, Kind.FORWARD, u))
            end = self.free[r] = now + self.costs[Kind.FORWARD]
            self.next_f[j] += 1
            self.held[r] += 1
            if j + 1 < self.V:
                self.ready[(Kind.FORWARD, j + 1, u)] = end
            else:
                self.ready[(Kind.BACKWARD, j, u)] = end  # the loss: its backward may start
            return
        split = self.split
        self.out[r].append(Action(j, Kind.INPUT_GRAD if split else Kind.BACKWARD, u))
        end = self.free[r] = now + self.costs[Kind.INPUT_GRAD if split else Kind.BACKWARD]
        self.next_b[j] += 1
        if split:
            self.queued[r].append(Action(j, Kind.WEIGHT_GRAD, u))
        else:
            self.held[r] -= 1
        if j > 0:
            self.ready[(Kind.BACKWARD, j - 1, u)] = end

    def finish_weight(self, r: int, now: float) -> None:
        self.out[r].append(self.queued[r].popleft())
        self.free[r] = now + self.costs[Kind.WEIGHT_GRAD]
        self.held[r] -= 1
