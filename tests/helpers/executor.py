"""Pipelined runs of ``StageExecutor`` (no Lightning) on gloo ranks, and the plain single-process training with
gradient accumulation they must equal, over the layers of ``tests/helpers/models.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.runtime import Link, StageExecutor
from lightning_avgpipe.runtime.recompute import layer_mask, stage_function
from lightning_avgpipe.schedules import build_plan, validate_plan
from tests.helpers.models import make_batch, make_layers

STEPS = 3


def _apply(layers: list[nn.Module], x: object) -> object:
    for layer in layers:
        x = layer(x)
    return x


def reference(
    schedule_m: int, steps: int = STEPS, sizes: list[int] | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    layers = make_layers()
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = make_batch(step, sizes[step] if sizes else 12)
        opt.zero_grad()
        total = 0.0
        for mx, my in zip(microbatch.split(x, schedule_m), microbatch.split(y, schedule_m)):
            loss = F.cross_entropy(_apply(layers, mx), my) * (len(mx) / len(x))
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]


def stage_worker(
    rank: int,
    world: int,
    schedule: str,
    partition: list[int],
    m: int,
    sizes: list[int] | None = None,
    batched: bool = False,
    k: int = 0,
    checkpointing: Any = False,
) -> dict:
    layers = make_layers()
    start = sum(partition[:rank])
    own = layers[start : start + partition[rank]]
    params = [p for layer in own for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
    link = Link(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None, torch.device("cpu"))
    # the stage's layers in order, those ``checkpointing`` names recomputed in the backward (runtime/recompute.py)
    executor = StageExecutor(rank, world, stage_function(own, layer_mask(own, checkpointing)), link, coalesce=batched)
    plan = validate_plan(build_plan(schedule, world, m, k, recv_lookahead=0 if batched else 1), nccl=batched)
    losses = []
    for step in range(len(sizes) if sizes else STEPS):
        x, y = make_batch(step, sizes[step] if sizes else 12)
        mbs = microbatch.split((x, y), m)
        keys = [microbatch.signature(mb) for mb in mbs]

        def head(u: int, out: torch.Tensor, mbs: list = mbs, n: int = len(y)) -> torch.Tensor:
            return F.cross_entropy(out, mbs[u][1]) * (len(mbs[u][1]) / n)

        if opt:
            opt.zero_grad()
        results = executor.run(plan.stages[rank], keys, training=True, inputs=lambda u, mbs=mbs: mbs[u][0], head=head)
        if opt:
            opt.step()
        losses.append(sum(r.item() for r in results.values()))
    return {
        "losses": losses,
        "states": {start + i: layer.state_dict() for i, layer in enumerate(own)},
        "meta_sent": len(link._sent_meta),
        "meta_received": len(link._recv_meta),
    }


def cases_worker(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """Run several cases in the same processes (starting ranks dominates the cost of these tests)."""
    return [stage_worker(rank, world, *case) for case in cases]
