"""Can a plan deadlock under NCCL's point-to-point semantics? A progress-only model, no processes needed.

NCCL differs from gloo in two ways that matter to a pipeline schedule:

- the operations between two ranks run in posting order on one stream (per pair of ranks), so an operation
  cannot start before the previous one on that stream has finished;
- a send finishes only together with its matching receive on the peer (a rendezvous).

Operations issued together in one ``batch_isend_irecv`` (an NCCL group) progress together. The executor
coalesces each run of communication actions between two computes into one such group; this module models
that and reports a deadlock, for example 1F1B lowered with receives posted one compute ahead and not coalesced:
stage 0 posts ``recv grad 0`` before ``send act 1`` while stage 1 posts ``recv act 1`` before ``send grad 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.generate import Plan


def comm_groups(actions: tuple[Action, ...] | list[Action]) -> list[list[Action]]:
    """The executor's batches: maximal runs of communication actions with no compute between them."""
    groups: list[list[Action]] = []
    current: list[Action] = []
    for a in actions:
        if a.kind.is_compute:
            if current:
                groups.append(current)
                current = []
        else:
            current.append(a)
    if current:
        groups.append(current)
    return groups


@dataclass
class _Op:
    send: bool
    message: tuple[str, int, int]  # (kind "F"/"B", sender stage, unit)
    source: int | None  # index of the compute that produces the data (sends)
    done: bool = False


@dataclass
class _Group:
    ops: list[_Op] = field(default_factory=list)


def _message(a: Action) -> tuple[str, int, int] | None:
    if a.kind is Kind.SEND_F:
        return ("F", a.stage, a.unit)
    if a.kind is Kind.RECV_F:
        return ("F", a.stage - 1, a.unit)
    if a.kind is Kind.SEND_B:
        return ("B", a.stage, a.unit)
    if a.kind is Kind.RECV_B:
        return ("B", a.stage + 1, a.unit)
    return None


def nccl_deadlock(plan: Plan, coalesce: bool = True) -> str | None:
    """``None`` if ``plan`` finishes under the NCCL model, else a message saying where each stage is stuck."""
    S = plan.num_stages
    computes: list[list[Action]] = [[a for a in acts if a.kind.is_compute] for acts in plan.stages]
    streams: dict[tuple[int, int], list[_Group]] = {}  # (rank, peer) -> groups in posting order
    needs: list[list[_Op | None]] = [[None] * len(c) for c in computes]  # compute -> the receive it waits for
    for s, acts in enumerate(plan.stages):
        batches = comm_groups(acts) if coalesce else [[a] for a in acts if not a.kind.is_compute]
        batch_of = {id(a): i for i, b in enumerate(batches) for a in b}
        by_batch: dict[tuple[int, int], _Group] = {}
        compute_index = -1
        recv_ops: dict[tuple[str, int, int], _Op] = {}
        for a in acts:
            if a.kind.is_compute:
                compute_index += 1
                continue
            msg = _message(a)
            assert msg is not None
            send = a.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = s + 1 if a.kind in (Kind.SEND_F, Kind.RECV_B) else s - 1
            op = _Op(send, msg, compute_index if send else None)
            key = (batch_of[id(a)], peer)
            if key not in by_batch:
                by_batch[key] = _Group()
                streams.setdefault((s, peer), []).append(by_batch[key])
            by_batch[key].ops.append(op)
            if not send:
                recv_ops[msg] = op
        for i, c in enumerate(computes[s]):
            if c.kind is Kind.FORWARD and s > 0:
                needs[s][i] = recv_ops.get(("F", s - 1, c.unit))
            elif c.kind is Kind.BACKWARD and s < S - 1:
                needs[s][i] = recv_ops.get(("B", s + 1, c.unit))
    finished = [0] * S  # computes completed per stage, in order

    def progress() -> bool:
        moved = False
        for s in range(S):
            while finished[s] < len(computes[s]):
                need = needs[s][finished[s]]
                if need is not None and not need.done:
                    break
                finished[s] += 1
                moved = True
        for (a, b), groups in streams.items():
            if a > b or not groups:
                continue
            other = streams.get((b, a), [])
            if not other:
                continue
            ga, gb = groups[0], other[0]
            for x, y in ((ga, gb), (gb, ga)):
                for op in x.ops:
                    if op.done or not op.send:
                        continue
                    sender = a if x is ga else b
                    if op.source is not None and finished[sender] <= op.source:
                        continue  # the data is not computed yet
                    match = next((r for r in y.ops if not r.done and not r.send and r.message == op.message), None)
                    if match is not None:
                        op.done = match.done = True
                        moved = True
        for groups in streams.values():
            while groups and all(op.done for op in groups[0].ops):
                groups.pop(0)
                moved = True
        return moved

    while progress():
        pass
    if all(finished[s] == len(computes[s]) for s in range(S)):
        return None
    stuck = []
    for s in range(S):
        if finished[s] < len(computes[s]):
            stuck.append(f"stage {s} at {computes[s][finished[s]]}")
    heads = [
        f"{a}->{b}: " + ", ".join(f"{'send' if o.send else 'recv'} {o.message[0]}{o.message[2]}" for o in g[0].ops)
        for (a, b), g in sorted(streams.items())
        if g
    ]
    return "NCCL deadlock: " + "; ".join(stuck) + " (stream heads " + " | ".join(heads) + ")"
