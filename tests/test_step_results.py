"""The step's loss and logs reach every stage: one tensor broadcast while the logged names stay, an object otherwise."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


class _Pipe:
    """What StepResults uses of a StagePipeline: two stages on the default group, the last one rank 1."""

    topology = SimpleNamespace(num_stages=2)
    device = torch.device("cpu")

    def __init__(self, rank: int) -> None:
        self.executor = SimpleNamespace(is_last=rank == 1)
        self.object_broadcasts = 0

    def share_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=1)
        return tensor

    def share(self, payload: Any) -> Any:
        self.object_broadcasts += 1
        box = [payload]
        dist.broadcast_object_list(box, src=1)
        return box[0]


def _steps() -> list[tuple[torch.Tensor, list[Any]]]:
    value = [("train_loss", "value", torch.tensor(1.25), {"prog_bar": True})]
    again = [("train_loss", "value", torch.tensor(0.3333333), {"prog_bar": True})]
    renamed = [("loss/a", "value", torch.tensor(2.0, dtype=torch.float64), {}), *again]
    metric = [("acc", "metric", ("acc", {"correct": torch.tensor(3)}, {"count": 1, "cache": None}), {})]
    return [
        (torch.tensor(2.5), value),  # first step: the names are new
        (torch.tensor(2.4000001), again),  # the same names: the fast path
        (torch.tensor(2.3), renamed),  # a new name: an object again
        (torch.tensor(2.2), renamed),  # fast again, two values, one float64
        (torch.tensor(2.1), metric),  # a metric's state travels as an object
        (torch.tensor(2.0), []),  # nothing logged: names changed (none)
        (torch.tensor(1.9), []),  # still none: fast
    ]


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_avgpipe.plugin.steps.results import StepResults

    pipe = _Pipe(rank)
    results = StepResults(pipe)
    received = []
    objects = []
    for loss, logs in _steps():
        got = results.exchange(loss, logs) if pipe.executor.is_last else results.exchange(None, None)
        received.append(got)
        objects.append(pipe.object_broadcasts)
    return {"received": received, "objects": objects}


def test_loss_and_logs_arrive_exactly_with_one_tensor_broadcast_while_the_names_stay() -> None:
    first, last = run_distributed(_worker, 2, timeout=120)
    assert first["objects"] == last["objects"] == [1, 1, 2, 2, 3, 4, 4]
    for (loss, logs), (got_loss, got_logs) in zip(_steps(), first["received"]):
        assert got_loss.dtype == torch.float32 and torch.equal(got_loss, loss)
        assert [(n, k, kw) for n, k, _, kw in got_logs] == [(n, k, kw) for n, k, _, kw in logs]
        for (_, kind, got, _), (_, _, sent, _) in zip(got_logs, logs):
            if kind == "value":
                assert got.dtype == sent.dtype and torch.equal(got, sent)
