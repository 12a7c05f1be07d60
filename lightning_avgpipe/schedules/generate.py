"""Schedule generators: AFAB, 1F1B and advance-forward plans as per-stage action lists, then lowered with comms.

All three schedules are one family. Stage ``s`` of ``S`` first runs ``w`` forwards ("warm-up"), then alternates
one forward and one backward, then drains the remaining backwards::

    w = min(U, S - s - 1 + k)      U units per iteration, k advance forwards (k = 0 on the last stage, s = S - 1)

    k = 0          -> 1F1B (PipeDream-flush / DAPPLE): peak stash min(U, S - s)
    0 < k          -> AvgPipe's advance forward propagation: k extra forwards run early, in bubble time, on every
                      stage but the last; peak stash min(U, S - s + k) there, and 1F1B's (1 unit) on the last stage
    k >= U - 2     -> (S > 1) stages 0 .. S - 2 run AFAB's order (a warm-up of U - 1 forwards already is all
                      forwards, then all backwards) and the last stage 1F1B's; no larger k changes the plan
                      (``max_advance_forwards``)
    AFAB (GPipe)   -> w = U on every stage: peak stash U

The last stage runs no advance forwards (the paper states its Algorithm 1 for the first GPU): its backward needs
only its own forward, so there an early forward fills no bubble and only stashes activations, and it delays the
gradients every stage upstream waits for.

The timelines for S = 4, U = 6 (F = forward of unit, B = backward, costs 1 and 2), 1F1B::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 .  B3 B3 .  B4 B4 .  B5 B5
    stage 1 | .  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 .  B4 B4 .  B5 B5 .  .
    stage 2 | .  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 .  B5 B5 .  .  .  .
    stage 3 | .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 .  .  .  .  .  .

and advance with k = 1: stages 0 to 2 run one more forward early (in what was bubble), stage 3 runs 1F1B's order;
peak stash [5, 4, 3, 1] against 1F1B's [4, 3, 2, 1]::

    stage 0 | F0 F1 F2 F3 F4 .  .  .  .  .  B0 B0 F5 B1 B1 .  B2 B2 .  B3 B3 .  B4 B4 .  B5 B5
    stage 1 | .  F0 F1 F2 F3 .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 .  B3 B3 .  B4 B4 .  B5 B5 .  .
    stage 2 | .  .  F0 F1 F2 .  B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3 .  B4 B4 .  B5 B5 .  .  .  .
    stage 3 | .  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 .  .  .  .  .  .

With uniform costs and no latency every schedule takes the same time; the early forwards pay off when a message
between stages is slow or the stages' costs vary.

(``python -m lightning_avgpipe schedule --stages 4 --microbatches 6 [--schedule advance --advance-forwards 1]``
prints the exact simulated table.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_avgpipe.checks import is_number
from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.chunks import (
    PLACEMENT_COSTS,
    Layout,
    chunked_orders,
    megatron_sequences,
    placement_costs,
)
from lightning_avgpipe.schedules.zerobubble import split_backward

SCHEDULES: tuple[str, ...] = ("afab", "1f1b", "advance", "zbh1", "zbadvance", "interleaved", "zbv")
# the schedules that split the backward into I and W (schedules/zerobubble.py), and the order each splits
SPLIT: dict[str, str] = {"zbh1": "1f1b", "zbadvance": "advance"}
# the schedules with several chunks per rank (schedules/chunks.py): their placement, and whether the backward splits
CHUNKED: dict[str, tuple[str, bool]] = {"interleaved": ("loop", False), "zbv": ("v", True)}


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` runs each backward as an input gradient and a weight gradient (``zbh1``, ``zbadvance``,
    ``zbv``)."""
    name = check_schedule_name(schedule)
    return name in SPLIT or CHUNKED.get(name, ("", False))[1]


def reads_k(schedule: str) -> bool:
    """Whether ``schedule`` runs ``advance_forwards`` early forwards (``advance``, ``zbadvance``)."""
    name = check_schedule_name(schedule)
    return SPLIT.get(name, name) == "advance"


def check_schedule_name(schedule: str) -> str:
    """Return the normalised schedule name or raise a ``ValueError`` that lists the valid ones."""
    name = str(schedule).lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "afab", **{s: s for s in SCHEDULES}}
    if name not in aliases:
        raise ValueError(
            f"schedule={schedule!r} is not a known schedule. Use one of {list(SCHEDULES)} "
            "('afab' = GPipe all-forward-all-backward, '1f1b' = one-forward-one-backward, "
            "'advance' = AvgPipe's advance forward propagation, 'zbh1' = 1F1B with the weight gradients deferred "
            "into its bubbles (zero bubble, H1), 'zbadvance' = the advance forward with them deferred, 'interleaved' = "
            "1F1B over stages_per_rank chunks per rank placed in a loop, 'zbv' = zero bubble over 2 chunks per rank "
            "placed in a V)."
        )
    return aliases[name]


def warmup_forwards(schedule: str, num_stages: int, num_units: int, stage: int, advance_forwards: int = 0) -> int:
    """Number of forwards stage ``stage`` runs before its first backward (see the module docstring)."""
    schedule = SPLIT.get(check_schedule_name(schedule), check_schedule_name(schedule))
    if schedule == "afab":
        return num_units
    extra = advance_forwards if schedule == "advance" and stage < num_stages - 1 else 0  # none on the last stage
    return min(num_units, num_stages - stage - 1 + extra)


def peak_stash(schedule: str, num_stages: int, num_units: int, advance_forwards: int = 0) -> list[int]:
    """Per stage, the most units a training iteration has forwarded and not yet backwarded (closed form).

    AFAB: ``U`` on every stage; 1F1B: ``min(U, S - s)``; advance: ``min(U, S - s + k)`` on stages ``s < S - 1`` and
    1F1B's ``min(U, 1)`` on the last stage. Equal to ``simulate(build_plan(...)).peak_stash`` for every plan.
    """
    _check_sizes(num_stages, num_units, advance_forwards)
    return [
        min(num_units, warmup_forwards(schedule, num_stages, num_units, s, advance_forwards) + 1)
        for s in range(num_stages)
    ]


def max_advance_forwards(num_stages: int, num_units: int) -> int:
    """The largest k that changes an ``advance`` plan: from it on, stages 0 .. S - 2 run AFAB's order.

    A stage that warms up with ``U - 1`` forwards already runs all forwards, then all backwards, so stage ``S - 2``
    gets there at ``k = U - 2``; with one stage (the last) ``advance`` is 1F1B for every k.
    """
    _check_sizes(num_stages, num_units, 0)
    return 0 if num_stages == 1 else max(0, num_units - 2)


def compute_orders(
    schedule: str, num_stages: int, num_units: int, advance_forwards: int = 0, training: bool = True
) -> list[list[Action]]:
    """Every stage's compute actions (forwards and backwards, or input and weight gradients), in execution order."""
    name = check_schedule_name(schedule)
    base = SPLIT.get(name, name)
    orders = [compute_order(base, num_stages, num_units, s, advance_forwards, training) for s in range(num_stages)]
    if name not in SPLIT or not training:
        return orders
    cap = max(peak_stash(base, num_stages, num_units, advance_forwards))  # the unsplit schedule's memory peak
    return split_backward(orders, cap)


def compute_order(
    schedule: str, num_stages: int, num_units: int, stage: int, advance_forwards: int = 0, training: bool = True
) -> list[Action]:
    """The compute actions (forwards and backwards) of one stage, in execution order."""
    _check_sizes(num_stages, num_units, advance_forwards)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} is outside [0, {num_stages}); pass a stage index below num_stages.")
    if check_schedule_name(schedule) in SPLIT:
        return compute_orders(schedule, num_stages, num_units, advance_forwards, training)[stage]
    if not training:
        return [Action(stage, Kind.FORWARD, u) for u in range(num_units)]
    w = warmup_forwards(schedule, num_stages, num_units, stage, advance_forwards)
    order = [Action(stage, Kind.FORWARD, u) for u in range(w)]
    for i in range(num_units - w):  # steady state: one forward, one backward
        order.append(Action(stage, Kind.FORWARD, w + i))
        order.append(Action(stage, Kind.BACKWARD, i))
    order.extend(Action(stage, Kind.BACKWARD, u) for u in range(num_units - w, num_units))  # drain
    return order


def _recv_for(action: Action, layout: Layout) -> Action | None:
    j = action.stage
    if action.kind is Kind.FORWARD and j > 0 and layout.crosses(j - 1, j):
        return Action(j, Kind.RECV_F, action.unit)
    if action.kind.sends_grads and j < layout.num_chunks - 1 and layout.crosses(j, j + 1):
        return Action(j, Kind.RECV_B, action.unit)
    return None


def _send_for(action: Action, layout: Layout) -> Action | None:
    j = action.stage
    if action.kind is Kind.FORWARD and j < layout.num_chunks - 1 and layout.crosses(j, j + 1):
        return Action(j, Kind.SEND_F, action.unit)
    if action.kind.sends_grads and j > 0 and layout.crosses(j - 1, j):
        return Action(j, Kind.SEND_B, action.unit)
    return None


def _forwarded_before(upstream: Sequence[Action]) -> dict[int, list[int]]:
    """Unit j -> the units ``upstream`` (a stage's compute order) forwards before its backward of j."""
    done: list[int] = []
    before: dict[int, list[int]] = {}
    for a in upstream:
        if a.kind is Kind.FORWARD:
            done.append(a.unit)
        elif a.kind.sends_grads:
            before[a.unit] = list(done)
    return before


def lower(
    compute: Sequence[Action],
    num_stages: int,
    recv_lookahead: int = 1,
    upstream: Sequence[Action] | None = None,
    layout: Layout | None = None,
) -> list[Action]:
    """Add sends and receives to a stage's compute order.

    With ``recv_lookahead=1`` the receive a compute action needs is posted one compute action ahead (before the
    *previous* compute runs), so the transfer overlaps that compute; the send goes out right after the compute
    that produced it and never blocks (the executor waits on sends only when it must free their buffers). That
    suits gloo, whose operations progress independently.

    With ``recv_lookahead=0`` a receive is posted right before the compute that needs it, so every stretch of
    communication between two computes is "send what I just made, receive what I need next". NCCL runs the
    point-to-point operations between two ranks in order on one stream and a send waits for its receive; the
    executor then issues each such stretch as one ``batch_isend_irecv`` group, and both neighbours' groups
    match (the validator's NCCL check proves it for a plan). For that the messages between two neighbours must
    come in the same order on both: ``upstream``, the previous stage's compute order, makes this stage receive,
    before it sends the gradient of unit j, every activation the previous stage sends before it receives that
    gradient (in the same batch as the send). Under ``advance`` the stage before the last runs up to k + 1 more
    forwards ahead than the last stage (which runs 1F1B's order), so the last stage posts those receives early;
    where neighbours' warm-ups differ by at most one (1F1B, AFAB) nothing changes.
    """
    if recv_lookahead not in (0, 1):
        raise ValueError(f"recv_lookahead={recv_lookahead!r} must be 0 (just in time, NCCL) or 1 (one ahead, gloo).")
    layout = layout or Layout(num_stages)  # several chunks per rank: only what crosses ranks is sent
    out: list[Action] = []
    posted: set[Action] = set()
    forwarded: set[tuple[int, int]] = set()  # (stage, unit)
    # unit j -> the units the previous stage forwards before its backward of j
    sent_before = _forwarded_before(upstream) if recv_lookahead == 0 and upstream is not None else {}

    def post(action: Action) -> None:
        recv = _recv_for(action, layout)
        if recv is None or recv in posted:
            return
        if recv.kind is Kind.RECV_B and (recv.stage, recv.unit) not in forwarded:
            return  # a gradient buffer is shaped like the unit's output: post it after that forward
        posted.add(recv)
        out.append(recv)

    for i, action in enumerate(compute):
        post(action)
        if recv_lookahead and i + 1 < len(compute):
            post(compute[i + 1])
        out.append(action)
        if action.kind is Kind.FORWARD:
            forwarded.add((action.stage, action.unit))
        send = _send_for(action, layout)
        if send is not None:
            out.append(send)
            if send.kind is Kind.SEND_B:  # receive what the previous stage sends before it takes this gradient
                early = [Action(action.stage, Kind.RECV_F, u) for u in sent_before.get(send.unit, ())]
                out += [recv for recv in early if recv not in posted]
                posted.update(early)
        if recv_lookahead and i + 1 < len(compute):
            post(compute[i + 1])  # the next backward's receive, once its forward has run
    return out


def lower_in_one_order(
    computes: Sequence[Sequence[Action]], layout: Layout, costs: dict[Kind, float] | None = None
) -> list[list[Action]]:
    """The NCCL form (``recv_lookahead=0``) of any ranks' compute orders: two ranks post what passes between them
    in one order, the order in which an eager run of the plan produces it.

    Every rank's computes are first timed as if run eagerly (each at its placement cost, ``costs`` or
    ``PLACEMENT_COSTS``, as soon as its input is there); the messages between two ranks, sorted by when they are
    produced, are then the order both post. A send goes out right after the compute that makes it, a receive right
    before the compute that needs it, or earlier where the pair's order puts it before a send of this rank. That
    every earlier message is produced before a later one is what keeps the in-order streams moving
    (``schedules/nccl.py`` checks each plan).
    """
    finish = _eager_finish(computes, layout, PLACEMENT_COSTS if costs is None else costs)
    made = sorted(
        (finish[send.message], layout.rank_of(a.stage), send)
        for ranked in computes
        for a in ranked
        if (send := _send_for(a, layout)) is not None
    )
    pair_order: dict[tuple[int, int], list[Action]] = {}  # (rank, peer) -> this rank's ops with the peer, in order
    for _, sender, send in made:
        recv = _matching_recv(send)
        peer = layout.rank_of(recv.stage)
        pair_order.setdefault((sender, peer), []).append(send)
        pair_order.setdefault((peer, sender), []).append(recv)
    index = {(pair, op): i for pair, ops in pair_order.items() for i, op in enumerate(ops)}
    out: list[list[Action]] = []
    for r, ranked in enumerate(computes):
        actions: list[Action] = []
        posted: dict[int, int] = {}  # peer -> how many of the pair's ops this rank has posted
        for a in ranked:
            needed = _recv_for(a, layout)
            if needed is not None:
                _post_through(needed, r, layout, pair_order, index, posted, actions)
            actions.append(a)
            made_here = _send_for(a, layout)
            if made_here is not None:
                _post_through(made_here, r, layout, pair_order, index, posted, actions)
        out.append(actions)
    return out


def _post_through(
    op: Action,
    rank: int,
    layout: Layout,
    pair_order: dict[tuple[int, int], list[Action]],
    index: dict[tuple[tuple[int, int], Action], int],
    posted: dict[int, int],
    actions: list[Action],
) -> None:
    """Append to ``actions`` ``op`` and the receives its pair's order puts before it, not yet posted."""
    assert op.peer_stage is not None
    peer = layout.rank_of(op.peer_stage)
    end = index[((rank, peer), op)] + 1
    for earlier in pair_order[(rank, peer)][posted.get(peer, 0) : end]:
        assert earlier == op or earlier.kind in (Kind.RECV_F, Kind.RECV_B), (earlier, op)  # earlier sends: made
        actions.append(earlier)
    posted[peer] = max(posted.get(peer, 0), end)


def _matching_recv(send: Action) -> Action:
    if send.kind is Kind.SEND_F:
        return Action(send.stage + 1, Kind.RECV_F, send.unit)
    return Action(send.stage - 1, Kind.RECV_B, send.unit)


def _eager_finish(computes: Sequence[Sequence[Action]], layout: Layout, costs: dict[Kind, float]) -> dict[Any, float]:
    """When each message between ranks is made when every rank runs its order eagerly, at ``costs``."""
    made: dict[Any, float] = {}  # Action.message -> when it is made
    free, at = [0.0] * len(computes), [0] * len(computes)
    moved = True
    while moved:
        moved = False
        for r, ranked in enumerate(computes):
            while at[r] < len(ranked):
                a = ranked[at[r]]
                recv = _recv_for(a, layout)
                if recv is not None and recv.message not in made:
                    break  # its input is not made yet
                ready = made[recv.message] if recv is not None else 0.0
                free[r] = max(free[r], ready) + costs[a.kind]
                send = _send_for(a, layout)
                if send is not None:
                    made[send.message] = free[r]
                at[r] += 1
                moved = True
    stuck = [str(ranked[at[r]]) for r, ranked in enumerate(computes) if at[r] < len(ranked)]
    if stuck:
        raise ValueError(f"the compute orders wait on each other (stuck at {stuck}); no order of messages exists")
    return made


@dataclass(frozen=True)
class Plan:
    """Every stage's lowered action list for one iteration: a value that can be printed, compared and simulated."""

    schedule: str
    num_stages: int
    num_units: int
    advance_forwards: int
    training: bool
    stages: tuple[tuple[Action, ...], ...]  # per rank (with one chunk per rank, per stage)
    recv_lookahead: int = 1
    stages_per_rank: int = 1  # v: the model has num_stages x v stages, v on every rank (schedules/chunks.py)
    placement: str = "loop"
    costs: tuple[float, float, float] | None = None  # the (F, I, W) a chunked plan was placed by; None: unit costs

    @property
    def layout(self) -> Layout:
        return Layout(self.num_stages, self.stages_per_rank, self.placement)

    def compute(self, stage: int) -> list[Action]:
        """Rank ``stage``'s compute actions only."""
        return [a for a in self.stages[stage] if a.kind.is_compute]

    def __str__(self) -> str:
        chunks = f", stages_per_rank={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        if self.costs is not None:
            chunks += ", placed by F:I:W = " + ":".join(f"{c / self.costs[0]:.3g}" for c in self.costs)
        lines = [
            f"Plan(schedule={self.schedule}, stages={self.num_stages}{chunks}, units={self.num_units}, "
            f"advance_forwards={self.advance_forwards}, training={self.training})"
        ]
        name = "rank" if self.stages_per_rank > 1 else "stage"
        lines += [f"  {name} {s}: " + " ".join(str(a) for a in acts) for s, acts in enumerate(self.stages)]
        return "\n".join(lines)


def build_plan(
    schedule: str,
    num_stages: int,
    num_units: int,
    advance_forwards: int = 0,
    training: bool = True,
    recv_lookahead: int = 1,
    stages_per_rank: int | None = None,
    costs: tuple[float, float, float] | None = None,
) -> Plan:
    """Build the lowered plan of every stage for ``num_units`` units (micro-batches times replicas); with
    ``stages_per_rank`` v (``interleaved``, ``zbv``) the model has ``num_stages x v`` stages and the plan one action
    list per rank, its actions placed by ``costs``: one unit's measured (forward, input gradient, weight gradient)
    times (``None``: unit costs). The other schedules have fixed orders, and refuse ``costs``."""
    name = check_schedule_name(schedule)
    _check_sizes(num_stages, num_units, advance_forwards)
    v = check_stages_per_rank(name, stages_per_rank)
    costs = check_schedule_costs(name, costs)
    if name in CHUNKED:
        return _chunked_plan(name, num_stages, num_units, v, training, recv_lookahead, costs)
    computes = compute_orders(name, num_stages, num_units, advance_forwards, training)
    stages = tuple(
        tuple(lower(computes[s], num_stages, recv_lookahead, computes[s - 1] if s > 0 else None))
        for s in range(num_stages)
    )
    k = advance_forwards if SPLIT.get(name, name) == "advance" else 0
    return Plan(name, num_stages, num_units, k, training, stages, recv_lookahead)


def check_schedule_costs(schedule: str, costs: Any) -> tuple[float, float, float] | None:
    """``schedule_costs`` as three floats (``None`` stays): one unit's measured (forward, input gradient, weight
    gradient) times, which only the chunked schedules place their actions by."""
    if costs is None:
        return None
    three = isinstance(costs, (list, tuple)) and len(costs) == 3
    if not three or not all(is_number(c) and 0 < c < float("inf") for c in costs):
        raise ValueError(
            f"schedule_costs={costs!r} must be one unit's measured (forward, input_grad, weight_grad) times, "
            "three positive numbers in any unit, for example (1.0, 1.1, 0.6)."
        )
    if schedule not in CHUNKED:
        raise ValueError(
            f"schedule_costs={costs!r} with schedule={schedule!r}: only 'interleaved' and 'zbv' place their actions "
            "by costs; the other schedules have fixed orders. Drop schedule_costs, or use one of those two."
        )
    return float(costs[0]), float(costs[1]), float(costs[2])


def check_stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """The v ``schedule`` runs: ``stages_per_rank``, or its default (2 for ``interleaved`` and ``zbv``, else 1)."""
    name = check_schedule_name(schedule)
    v = stages_per_rank if stages_per_rank is not None else (2 if name in CHUNKED else 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank!r} must be an int >= 1 (model chunks per rank).")
    if name == "zbv" and v != 2:
        raise ValueError(f"stages_per_rank={v} with schedule='zbv': ZB-V places exactly 2 chunks per rank (a V).")
    if name not in CHUNKED and v != 1:
        raise ValueError(
            f"stages_per_rank={v} with schedule={name!r}: only 'interleaved' and 'zbv' run several chunks per rank; "
            "use one of them, or stages_per_rank=1."
        )
    return v


def schedule_layout(schedule: str, num_ranks: int, stages_per_rank: int | None = None) -> Layout:
    """Which rank runs which model stage under ``schedule``: ``num_ranks x v`` stages, placed as it places them."""
    v = check_stages_per_rank(schedule, stages_per_rank)
    return Layout(num_ranks, v, CHUNKED[schedule][0] if schedule in CHUNKED else "loop")


def _chunked_plan(
    name: str, S: int, U: int, v: int, training: bool, recv_lookahead: int, costs: tuple[float, float, float] | None
) -> Plan:
    """``interleaved`` (loop placement, whole backward) or ``zbv`` (V placement, backward split)."""
    placement, split = CHUNKED[name]
    layout = Layout(S, v, placement)
    timed = None if costs is None else placement_costs(*costs)
    if name == "interleaved":  # Megatron's orders; held chunk units: its warm-up, at least unit 0's way to the loss
        sequences = [megatron_sequences(S, U, v, r) for r in range(S)]
        caps = [max(2 * (S - r - 1) + (v - 1) * S, (v - 1) * min(S, U)) + 1 for r in range(S)]
        computes = chunked_orders(S, U, v, placement, split, caps, training, sequences, timed)
    else:  # ZB-V holds 1F1B's peak memory: S stage-sized units, v S chunks
        computes = chunked_orders(S, U, v, placement, split, [v * S] * S, training, costs=timed)
    if recv_lookahead == 0:  # NCCL: every pair of ranks posts its messages in one order
        stages = tuple(tuple(ranked) for ranked in lower_in_one_order(computes, layout, timed))
    else:
        stages = tuple(tuple(lower(computes[r], S, recv_lookahead, None, layout)) for r in range(S))
    return Plan(name, S, U, 0, training, stages, recv_lookahead, v, placement, costs)


def _check_sizes(num_stages: int, num_units: int, advance_forwards: int) -> None:
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1.")
    if not isinstance(num_units, int) or num_units < 1:
        raise ValueError(f"num_units={num_units!r} must be an int >= 1 (micro-batches times replicas).")
    if not isinstance(advance_forwards, int) or advance_forwards < 0:
        raise ValueError(f"advance_forwards={advance_forwards!r} must be an int >= 0 (0 gives 1F1B).")


def placed_by(costs: tuple[float, float, float]) -> str:
    """``placed by F:I:W = 1:1.12:0.63``: the measured costs a chunked plan was placed by, scaled to F = 1."""
    f = costs[0]
    return "placed by F:I:W = " + ":".join(f"{c / f:.3g}" for c in costs)
