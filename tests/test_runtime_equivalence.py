"""Pipelined gradients and weights equal plain single-process training with gradient accumulation (no Lightning)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe import microbatch
from lightning_avgpipe.runtime import Link, StageExecutor
from lightning_avgpipe.schedules import build_plan, validate_plan
from tests.helpers.distributed import run_distributed
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


def _worker(
    rank: int, world: int, schedule: str, partition: list[int], m: int, sizes: list[int] | None = None,
    batched: bool = False,
) -> dict:
    layers = make_layers()
    start = sum(partition[:rank])
    own = layers[start : start + partition[rank]]
    params = [p for layer in own for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9) if params else None
    link = Link(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None, torch.device("cpu"))
    executor = StageExecutor(rank, world, lambda x: _apply(own, x), link, coalesce=batched)
    plan = validate_plan(build_plan(schedule, world, m, recv_lookahead=0 if batched else 1), nccl=batched)
    losses = []
    for step in range(len(sizes) if sizes else STEPS):
        x, y = make_batch(step, sizes[step] if sizes else 12)
        mbs = microbatch.split((x, y), m)
        keys = [microbatch.signature(mb) for mb in mbs]

        def head(u: int, out: torch.Tensor, mbs: list = mbs, n: int = len(y)) -> torch.Tensor:
            return F.cross_entropy(out, mbs[u][1]) * (len(mbs[u][1]) / n)

        if opt:
            opt.zero_grad()
        results = executor.run(plan.stages[rank], keys, training=True, inputs=lambda u, mbs=mbs: mbs[u][0],
                               head=head)
        if opt:
            opt.step()
        losses.append(sum(r.item() for r in results.values()))
    return {
        "losses": losses,
        "states": {start + i: layer.state_dict() for i, layer in enumerate(own)},
        "meta_sent": len(link._sent_meta),
        "meta_received": len(link._recv_meta),
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("schedule", "partition", "m"),
    [
        ("1f1b", [3, 3], 4),
        ("afab", [1, 5], 3),
        ("1f1b", [1, 1, 2, 2], 4),
        ("afab", [2, 1, 2, 1], 6),
        ("1f1b", [2, 2, 1, 1], 2),
        ("advance", [2, 1, 1, 2], 4),
        ("1f1b", [3, 3], 1),
    ],
)
def test_pipeline_matches_plain_training(schedule: str, partition: list[int], m: int) -> None:
    world = len(partition)
    outs = run_distributed(_worker, world, schedule, partition, m)
    ref_losses, ref_states = reference(m)
    torch.testing.assert_close(torch.tensor(outs[-1]["losses"]), torch.tensor(ref_losses))
    seen = 0
    for out in outs:
        for index, state in out["states"].items():
            torch.testing.assert_close(state, ref_states[index])
            seen += 1
    assert seen == len(ref_states)


@pytest.mark.timeout(180)
def test_shapes_change_between_steps_and_metadata_is_sent_once_per_shape() -> None:
    """Batches of 12, 12, 7, 12 samples in 3 micro-batches: sizes 4 and 3/2 give 3 distinct shapes."""
    sizes = [12, 12, 7, 12]
    outs = run_distributed(_worker, 2, "1f1b", [3, 3], 3, sizes)
    ref_losses, ref_states = reference(3, len(sizes), sizes)
    torch.testing.assert_close(torch.tensor(outs[-1]["losses"]), torch.tensor(ref_losses))
    for out in outs:
        for index, state in out["states"].items():
            torch.testing.assert_close(state, ref_states[index])
    assert outs[0]["meta_sent"] == 3 and outs[1]["meta_received"] == 3


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("schedule", "partition"), [("1f1b", [1, 2, 2, 1]), ("advance", [3, 3])])
def test_batched_p2p_mode_matches(schedule: str, partition: list[int]) -> None:
    """The NCCL-safe mode (receives just in time, each run of comms one batch_isend_irecv) on gloo."""
    outs = run_distributed(_worker, len(partition), schedule, partition, 4, [12, 12, 7], True)
    ref_losses, ref_states = reference(4, 3, [12, 12, 7])
    torch.testing.assert_close(torch.tensor(outs[-1]["losses"]), torch.tensor(ref_losses))
    for out in outs:
        for index, state in out["states"].items():
            torch.testing.assert_close(state, ref_states[index])
