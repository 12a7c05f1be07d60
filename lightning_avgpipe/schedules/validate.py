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
    errors = [e for s in range(S) for e in _stage_errors(plan, s)] + _channel_errors(plan)
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


def _wanted(plan: Plan, s: int) -> set[Kind]:
    """The kinds of action stage ``s`` must run once for every unit, besides the backward (``B``, or ``I`` and
    ``W``: :func:`_backward_errors`)."""
    first, last, training = s == 0, s == plan.num_stages - 1, plan.training
    wanted = {Kind.FORWARD}
    if not first:
        wanted |= {Kind.RECV_F, *([Kind.SEND_B] if training else [])}
    if not last:
        wanted |= {Kind.SEND_F, *([Kind.RECV_B] if training else [])}
    return wanted


def _stage_errors(plan: Plan, s: int) -> list[str]:
    """Stage ``s``'s own list: its actions, each once, every unit's wanted kinds present and in order."""
    errors: list[str] = []
    U = plan.num_units
    seen: dict[tuple[Kind, int], int] = {}
    for i, a in enumerate(plan.stages[s]):
        if a.stage != s:
            errors.append(f"stage {s} holds action {a} of stage {a.stage}")
        if not 0 <= a.unit < U:
            errors.append(f"stage {s}: {a} names unit {a.unit} outside [0, {U})")
        if (a.kind, a.unit) in seen:
            errors.append(f"stage {s}: {a} appears twice")
        seen[(a.kind, a.unit)] = i
    wanted = _wanted(plan, s)
    for kind in (k for k in Kind if k is not Kind.BACKWARD and k not in _SPLIT):
        for u in range(U):
            present = (kind, u) in seen
            if present != (kind in wanted):
                errors.append(f"stage {s}: {'unexpected' if present else 'missing'} {s}{kind.value}{u}")
    errors += _backward_errors(plan, s, seen)
    for u in range(U):
        for first, then in _ORDER:
            if (first, u) in seen and (then, u) in seen and seen[(first, u)] > seen[(then, u)]:
                errors.append(f"stage {s}: {s}{then.value}{u} comes before {s}{first.value}{u}")
    return errors


def _backward_errors(plan: Plan, s: int, seen: dict[tuple[Kind, int], int]) -> list[str]:
    """In training, each unit's backward once: whole (``B``) or split (``I`` and ``W``), not both; none otherwise."""
    errors = []
    for u in range(plan.num_units):
        whole = (Kind.BACKWARD, u) in seen
        parts = [(k, u) in seen for k in _SPLIT]
        if not plan.training:
            errors += [f"stage {s}: unexpected {s}{k.value}{u}" for k in (Kind.BACKWARD, *_SPLIT) if (k, u) in seen]
        elif whole and any(parts):
            errors.append(f"stage {s}: unit {u} has both {s}B{u} and a split backward")
        elif not whole and not all(parts):
            missing = (
                [f"{s}{k.value}{u}" for k, there in zip(_SPLIT, parts) if not there] if any(parts) else [f"{s}B{u}"]
            )
            errors.append(f"stage {s}: missing {', '.join(missing)}")
    return errors


def _channel_errors(plan: Plan) -> list[str]:
    """Point-to-point channels are FIFO (NCCL matches by order): both ends must agree on the unit order."""
    errors = []
    for s in range(plan.num_stages - 1):
        sends = [a.unit for a in plan.stages[s] if a.kind is Kind.SEND_F]
        recvs = [a.unit for a in plan.stages[s + 1] if a.kind is Kind.RECV_F]
        if sends != recvs:
            errors.append(f"activations {s}->{s + 1}: sent in order {sends}, received in order {recvs}")
        if plan.training:
            gsends = [a.unit for a in plan.stages[s + 1] if a.kind is Kind.SEND_B]
            grecvs = [a.unit for a in plan.stages[s] if a.kind is Kind.RECV_B]
            if gsends != grecvs:
                errors.append(f"gradients {s + 1}->{s}: sent in order {gsends}, received in order {grecvs}")
    return errors


def validate_plan(plan: Plan, nccl: bool = False) -> Plan:
    """Return ``plan`` unchanged if it is valid, else raise :class:`PlanError` listing every problem."""
    errors = plan_errors(plan, nccl)
    if errors:
        raise PlanError(f"Invalid {plan.schedule} plan ({len(errors)} problems):\n  " + "\n  ".join(errors))
    return plan
