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


def nccl_deadlock(plan: Plan, coalesce: bool = True) -> str | None:
    """``None`` if ``plan`` finishes under the NCCL model, else a message saying where each stage is stuck."""
    model = _NcclModel(plan, coalesce)
    while model.progress():
        pass
    return model.stuck()


class _NcclModel:
    """Each stage's computes in order, each waiting for its receive; each pair of ranks' groups on one stream."""

    def __init__(self, plan: Plan, coalesce: bool) -> None:
        S, layout = plan.num_stages, plan.layout
        self.layout = layout
        self.computes: list[list[Action]] = [[a for a in acts if a.kind.is_compute] for acts in plan.stages]
        self.streams: dict[tuple[int, int], list[_Group]] = {}  # (rank, peer) -> groups in posting order
        self.needs: list[list[_Op | None]] = []  # stage -> compute -> the receive it waits for
        for s, acts in enumerate(plan.stages):
            recv_ops = self._post(s, acts, coalesce)
            need: list[_Op | None] = []
            for c in self.computes[s]:  # what stays on the rank is ready in the rank's own order
                j = c.stage
                if c.kind is Kind.FORWARD and j > 0 and layout.crosses(j - 1, j):
                    need.append(recv_ops.get(("F", j - 1, c.unit)))
                elif c.kind.sends_grads and j < layout.num_chunks - 1 and layout.crosses(j, j + 1):
                    need.append(recv_ops.get(("B", j + 1, c.unit)))
                else:
                    need.append(None)
            self.needs.append(need)
        self.finished = [0] * S  # computes completed per stage, in order

    def _post(self, s: int, acts: tuple[Action, ...], coalesce: bool) -> dict[tuple[str, int, int], _Op]:
        """Put stage ``s``'s communications on its streams, grouped as the executor batches them; returns its
        receives by message."""
        batches = comm_groups(acts) if coalesce else [[a] for a in acts if not a.kind.is_compute]
        batch_of = {id(a): i for i, b in enumerate(batches) for a in b}
        by_batch: dict[tuple[int, int], _Group] = {}
        compute_index = -1
        recv_ops: dict[tuple[str, int, int], _Op] = {}
        for a in acts:
            if a.kind.is_compute:
                compute_index += 1
                continue
            msg, other = a.message, a.peer_stage
            assert msg is not None and other is not None
            send = a.kind in (Kind.SEND_F, Kind.SEND_B)
            peer = self.layout.rank_of(other)
            op = _Op(send, msg, compute_index if send else None)
            key = (batch_of[id(a)], peer)
            if key not in by_batch:
                by_batch[key] = _Group()
                self.streams.setdefault((s, peer), []).append(by_batch[key])
            by_batch[key].ops.append(op)
            if not send:
                recv_ops[msg] = op
        return recv_ops

    def progress(self) -> bool:
        """One round: computes whose receives are done run, stream heads match sends with receives, finished heads
        leave their streams; whether anything moved."""
        moved = self._compute()
        for (a, b), groups in self.streams.items():
            other = self.streams.get((b, a), [])
            if a < b and groups and other:
                moved |= self._match(a, groups[0], b, other[0])
        for groups in self.streams.values():
            while groups and all(op.done for op in groups[0].ops):
                groups.pop(0)
                moved = True
        return moved

    def _compute(self) -> bool:
        moved = False
        for s, computes in enumerate(self.computes):
            while self.finished[s] < len(computes):
                need = self.needs[s][self.finished[s]]
                if need is not None and not need.done:
                    break
                self.finished[s] += 1
                moved = True
        return moved

    def _match(self, a: int, ga: _Group, b: int, gb: _Group) -> bool:
        """Rendezvous between the heads of the streams a->b and b->a: a send whose data is computed meets its
        receive."""
        moved = False
        for sender, x, y in ((a, ga, gb), (b, gb, ga)):
            for op in x.ops:
                if op.done or not op.send or (op.source is not None and self.finished[sender] <= op.source):
                    continue  # done, a receive, or the data is not computed yet
                match = next((r for r in y.ops if not r.done and not r.send and r.message == op.message), None)
                if match is not None:
                    op.done = match.done = True
                    moved = True
        return moved

    def stuck(self) -> str | None:
        """``None`` when every compute ran, else where each stage is stuck and the streams' heads."""
        stuck = [
            f"stage {s} at {computes[self.finished[s]]}"
            for s, computes in enumerate(self.computes)
            if self.finished[s] < len(computes)
        ]
        if not stuck:
            return None
        heads = [
            f"{a}->{b}: " + ", ".join(f"{'send' if o.send else 'recv'} {o.message[0]}{o.message[2]}" for o in g[0].ops)
            for (a, b), g in sorted(self.streams.items())
            if g
        ]
        return "NCCL deadlock: " + "; ".join(stuck) + " (stream heads " + " | ".join(heads) + ")"
