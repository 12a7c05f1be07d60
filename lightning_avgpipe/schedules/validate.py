"""Plan validation: every unit forwarded then backwarded once, sends matched by receives in order, no deadlock."""

from __future__ import annotations

from lightning_avgpipe.schedules.actions import Kind
from lightning_avgpipe.schedules.generate import Plan
from lightning_avgpipe.schedules.nccl import nccl_deadlock
from lightning_avgpipe.schedules.simulate import DeadlockError, simulate


class PlanError(ValueError):
    """A plan that the executor must not run."""


def plan_errors(plan: Plan, nccl: bool = False) -> list[str]:
    """Everything wrong with ``plan``; an empty list means it is valid.

    With ``nccl=True`` the plan must also finish under NCCL's in-order, rendezvous point-to-point semantics with
    the executor's coalesced batches (:func:`~lightning_avgpipe.schedules.nccl.nccl_deadlock`).
    """
    S = plan.num_stages
    if len(plan.stages) != S:
        return [f"plan has {len(plan.stages)} stage lists for num_stages={S}"]
    errors = [e for s in range(S) for e in _rank_errors(plan, s)] + _channel_errors(plan)
    if not errors:
        try:
            simulate(plan)
        except DeadlockError as err:
            errors.append(str(err))
    if not errors and nccl:
        problem = nccl_deadlock(plan, coalesce=True)
        if problem:
            errors.append(f"{problem}; lower the plan with recv_lookahead=0 for NCCL")
    return errors


# within one stage and one unit, the first action of each pair must come before the second
_ORDER = [
    (Kind.RECV_F, Kind.FORWARD),
    (Kind.FORWARD, Kind.SEND_F),
    (Kind.FORWARD, Kind.BACKWARD),
    (Kind.FORWARD, Kind.RECV_B),
    (Kind.RECV_B, Kind.BACKWARD),
    (Kind.BACKWARD, Kind.SEND_B),
    (Kind.FORWARD, Kind.INPUT_GRAD),
    (Kind.RECV_B, Kind.INPUT_GRAD),
    (Kind.INPUT_GRAD, Kind.SEND_B),
    (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD),
]
_SPLIT = (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)
Seen = dict[tuple[Kind, int, int], int]  # (kind, stage, unit) -> position in the rank's list


def _where(plan: Plan, r: int) -> str:
    return f"rank {r}" if plan.stages_per_rank > 1 else f"stage {r}"


def _wanted(plan: Plan, j: int) -> set[Kind]:
    """The kinds of action stage ``j`` must run once for every unit, besides the backward (``B``, or ``I`` and
    ``W``: :func:`_backward_errors`); what stays on the rank needs no send or receive."""
    layout, training = plan.layout, plan.training
    wanted = {Kind.FORWARD}
    if j > 0 and layout.crosses(j - 1, j):
        wanted |= {Kind.RECV_F, *([Kind.SEND_B] if training else [])}
    if j < layout.num_chunks - 1 and layout.crosses(j, j + 1):
        wanted |= {Kind.SEND_F, *([Kind.RECV_B] if training else [])}
    return wanted


def _rank_errors(plan: Plan, r: int) -> list[str]:
    """Rank ``r``'s own list: its stages' actions, each once, every unit's wanted kinds present and in order."""
    errors: list[str] = []
    where, layout, U = _where(plan, r), plan.layout, plan.num_units
    seen: Seen = {}
    for i, a in enumerate(plan.stages[r]):
        if layout.rank_of(a.stage) != r or a.stage >= layout.num_chunks:
            errors.append(f"{where} holds action {a} of stage {a.stage}")
        if not 0 <= a.unit < U:
            errors.append(f"{where}: {a} names unit {a.unit} outside [0, {U})")
        if (a.kind, a.stage, a.unit) in seen:
            errors.append(f"{where}: {a} appears twice")
        seen[(a.kind, a.stage, a.unit)] = i
    for j in (j for j in range(layout.num_chunks) if layout.rank_of(j) == r):
        wanted = _wanted(plan, j)
        for kind in (k for k in Kind if k is not Kind.BACKWARD and k not in _SPLIT):
            for u in range(U):
                present = (kind, j, u) in seen
                if present != (kind in wanted):
                    errors.append(f"{where}: {'unexpected' if present else 'missing'} {j}{kind.value}{u}")
        errors += _backward_errors(plan, where, j, seen)
        errors += _order_errors(plan, where, j, seen)
    return errors


def _order_errors(plan: Plan, where: str, j: int, seen: Seen) -> list[str]:
    """Each unit's actions of stage ``j`` in order, after (forward) or before (backward) the neighbouring stage's
    on the same rank."""
    errors = []

    def before(first: tuple[Kind, int, int], then: tuple[Kind, int, int]) -> None:
        if first in seen and then in seen and seen[first] > seen[then]:
            errors.append(
                f"{where}: {then[1]}{then[0].value}{then[2]} comes before {first[1]}{first[0].value}{first[2]}"
            )

    local_before = j > 0 and not plan.layout.crosses(j - 1, j)
    for u in range(plan.num_units):
        for first, then in _ORDER:
            before((first, j, u), (then, j, u))
        if local_before:  # stage j - 1 on this rank: its forward first, its backward after
            before((Kind.FORWARD, j - 1, u), (Kind.FORWARD, j, u))
            for kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
                for other in (Kind.BACKWARD, Kind.INPUT_GRAD):
                    before((kind, j, u), (other, j - 1, u))
    return errors


def _backward_errors(plan: Plan, where: str, j: int, seen: Seen) -> list[str]:
    """In training, each unit's backward once: whole (``B``) or split (``I`` and ``W``), not both; none otherwise."""
    errors = []
    for u in range(plan.num_units):
        whole = (Kind.BACKWARD, j, u) in seen
        parts = [(k, j, u) in seen for k in _SPLIT]
        if not plan.training:
            kinds = (Kind.BACKWARD, *_SPLIT)
            errors += [f"{where}: unexpected {j}{k.value}{u}" for k in kinds if (k, j, u) in seen]
        elif whole and any(parts):
            errors.append(f"{where}: unit {u} has both {j}B{u} and a split backward")
        elif not whole and not all(parts):
            missing = [f"{j}{k.value}{u}" for k, there in zip(_SPLIT, parts) if not there]
            errors.append(f"{where}: missing {', '.join(missing) if any(parts) else f'{j}B{u}'}")
    return errors


def _channel_errors(plan: Plan) -> list[str]:
    """Point-to-point channels are FIFO (NCCL matches by order): both ends must agree on the unit order."""
    layout, errors = plan.layout, []
    chunked = plan.stages_per_rank > 1

    def order(r: int, kind: Kind, step: int, peer: int) -> list[object]:
        """What rank ``r`` sends to (receives from) ``peer``: the message's stage and unit, in its list's order."""
        out: list[object] = []
        for a in plan.stages[r]:
            if a.kind is kind and 0 <= a.stage + step < layout.num_chunks and layout.rank_of(a.stage + step) == peer:
                sender = a.stage if kind in (Kind.SEND_F, Kind.SEND_B) else a.stage + step
                out.append(f"{sender}:{a.unit}" if chunked else a.unit)
        return out

    for a in range(plan.num_stages):
        for b in range(plan.num_stages):
            if a == b:
                continue
            sends, recvs = order(a, Kind.SEND_F, 1, b), order(b, Kind.RECV_F, -1, a)
            if sends != recvs:
                errors.append(f"activations {a}->{b}: sent in order {sends}, received in order {recvs}")
            if plan.training:
                gsends, grecvs = order(a, Kind.SEND_B, -1, b), order(b, Kind.RECV_B, 1, a)
                if gsends != grecvs:
                    errors.append(f"gradients {a}->{b}: sent in order {gsends}, received in order {grecvs}")
    return errors


def validate_plan(plan: Plan, nccl: bool = False) -> Plan:
    """Return ``plan`` unchanged if it is valid, else raise :class:`PlanError` listing every problem."""
    errors = plan_errors(plan, nccl)
    if errors:
        raise PlanError(f"Invalid {plan.schedule} plan ({len(errors)} problems):\n  " + "\n  ".join(errors))
    return plan
