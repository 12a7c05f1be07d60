"""The memory breakdown of each stage at the first training step (issue 44, part 2): printed by rank 0 for every rank,
logged as ``memory/<part>_mib``, and its weights, gradients and optimizer state equal what this test counts from the
stage's layers; the counting itself (``runtime/memory.py``) on tensors sharing storage."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_avgpipe.runtime.memory import MIB, MemoryBreakdown, stage_breakdown
from tests.helpers.equivalence import run_lightning
from tests.helpers.models import make_layers

PARTITION = [3, 3]  # PipeNet's six layers: Linear(8, 16), Fork, Join on stage 0; Linear, ReLU, Linear on stage 1


def _stage_bytes(stage: int) -> tuple[int, int]:
    """Bytes of stage ``stage``'s parameters and their number, counted here from the layers the worker builds."""
    start = sum(PARTITION[:stage])
    params = [p for layer in make_layers()[start : start + PARTITION[stage]] for p in layer.parameters()]
    return sum(p.numel() * p.element_size() for p in params), len(params)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_first_step_breakdown_counts_each_stage_s_own_tensors(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 2, "partition": PARTITION}
    results = run_lightning(tmp_path, 2, strategy, steps=2, model={"optimizer": "adam", "lr": 0.01})
    for stage, result in enumerate(results):
        weights, count = _stage_bytes(stage)
        assert weights > 0 and result["parameters"] * 4 == weights  # what the rank holds, as the worker saw it
        got = {k: round(v * MIB) for k, v in result["metrics"].items() if k.startswith("memory/")}
        assert got["memory/weights_mib"] == weights, (stage, got)
        assert got["memory/gradients_mib"] == weights, (stage, got)
        # Adam: two moments of each parameter's size, and its float32 step count per parameter
        assert got["memory/optimizer_state_mib"] == 2 * weights + 4 * count, (stage, got)
        # activations saved, buffers received (activations on stage 1, their gradients on stage 0), the process
        assert got["memory/activations_mib"] > 0 and got["memory/communication_mib"] > 0
        counted = sum(got[f"memory/{k}_mib"] for k in ("weights", "gradients", "optimizer_state", "activations"))
        rest = got["memory/peak_mib"] - counted - got["memory/communication_mib"]
        assert got["memory/rest_mib"] == pytest.approx(rest, abs=256)  # logged as float32 MiB
    # rank 0 prints one line per rank, once
    out = results[0]["output"]
    for rank in range(2):
        lines = re.findall(rf"AvgPipe: rank {rank} \(stage {rank}\) at the first training step: weights .*", out)
        assert len(lines) == 1, out[-3000:]
        assert f"optimizer state {(2 * _stage_bytes(rank)[0] + 4 * _stage_bytes(rank)[1]) / MIB:.1f} MiB" in lines[0]
    assert "at the first training step" not in results[1]["output"]


def test_storage_is_counted_once_and_a_breakdown_reads_back() -> None:
    layer = nn.Linear(32, 64)
    params = list(layer.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt = torch.optim.Adam(params)
    opt.step()
    view = layer.weight.detach()[:4]  # shares the weight's storage: not counted again
    parts = stage_breakdown([*params, view], [opt], [torch.zeros(10)], activations=100, in_flight=60, peak=1 << 30)
    weights = (32 * 64 + 64) * 4
    assert (parts.weights, parts.gradients, parts.optimizer_state) == (weights, weights, 2 * weights + 2 * 4)
    assert (parts.activations, parts.communication) == (100, 60 + 40)
    assert parts.rest == (1 << 30) - 4 * weights - 8 - 100 - 100
    scalars = parts.scalars()
    assert scalars["memory/weights_mib"] == weights / MIB and scalars["memory/peak_mib"] == 1024.0
    assert set(scalars) == {f"memory/{k}_mib" for k in [*MemoryBreakdown.__dataclass_fields__, "rest"]}
    assert parts.describe().startswith(f"weights {weights / MIB:.1f} MiB, gradients")


def _average_worker(rank: int, world: int) -> list[list[torch.Tensor]]:
    """Rank d's gradients averaged over the 2 ranks, in one flat buffer and in buckets of 64 bytes."""
    import torch.distributed as dist

    from lightning_avgpipe.algorithms.elastic import average_gradients

    out = []
    for bucket_bytes in (1 << 30, 64):
        torch.manual_seed(rank)
        params = [nn.Parameter(torch.zeros(n)) for n in (5, 40, 3, 20)]
        for p in params:
            p.grad = torch.randn(p.shape) * (rank + 1)
        average_gradients(params, dist.group.WORLD, world, bucket_bytes=bucket_bytes)
        out.append([p.grad for p in params])
    return out


def test_exact_averaging_in_buckets_equals_one_flat_buffer() -> None:
    """``average_gradients`` all-reduces buckets of gradients, not one flat copy of all of them: the same means."""
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_average_worker, 2, timeout=120)
    grads = []
    for rank in range(2):  # what each rank's gradients were
        torch.manual_seed(rank)
        grads.append([torch.randn(n) * (rank + 1) for n in (5, 40, 3, 20)])
    mean = [(a + b) / 2 for a, b in zip(*grads)]
    for whole, buckets in results:
        for a, b, m in zip(whole, buckets, mean):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, m)


def test_only_gradients_zero_grad_drops_unread_are_freed_before_the_step() -> None:
    """The stash frees a stage's earlier gradients before the pipeline's step (not a second copy at its peak) only
    where Lightning's ``zero_grad`` would drop them with nothing reading them first; elsewhere they are kept."""
    from types import SimpleNamespace as Ns

    import lightning.pytorch as pl

    from lightning_avgpipe.plugin.steps.gradients import discarded_by_zero_grad

    class Plain(pl.LightningModule):
        pass

    class Reads(pl.LightningModule):
        def on_before_zero_grad(self, optimizer: Any) -> None:
            pass

    class Keeps(pl.LightningModule):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass

    class Hook(pl.Callback):
        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            pass

    class OwnZeroGrad(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    w = nn.Parameter(torch.zeros(2))

    def trainer(module: Any, accumulate: int = 1, skip: bool = False, callbacks: Any = (), opt: Any = None) -> Any:
        loop = Ns(epoch_loop=Ns(automatic_optimization=Ns(**{"_skip_backward": skip})))
        optimizers = [opt if opt is not None else torch.optim.SGD([w], lr=0.1)]
        return Ns(
            lightning_module=module,
            accumulate_grad_batches=accumulate,
            fit_loop=loop,
            callbacks=list(callbacks),
            strategy=Ns(optimizers=optimizers),
        )

    assert discarded_by_zero_grad(trainer(Plain()), 0) == {id(w)}
    assert discarded_by_zero_grad(trainer(Plain()), None) == {id(w)}
    assert discarded_by_zero_grad(trainer(Plain(), accumulate=2), 2) == {id(w)}  # a window starts
    assert discarded_by_zero_grad(trainer(Plain(), accumulate=2), 1) == set()  # inside one: they add up
    assert discarded_by_zero_grad(trainer(Plain(), accumulate=2), None) == set()  # unknown batch index
    assert discarded_by_zero_grad(trainer(Plain(), skip=True), 0) == set()  # StochasticWeightAveraging's steps
    assert discarded_by_zero_grad(trainer(Reads()), 0) == set()
    assert discarded_by_zero_grad(trainer(Keeps()), 0) == set()
    assert discarded_by_zero_grad(trainer(Plain(), callbacks=[Hook()]), 0) == set()
    assert discarded_by_zero_grad(trainer(Plain(), opt=OwnZeroGrad([w], lr=0.1)), 0) == set()
    manual = Plain()
    manual.automatic_optimization = False
    assert discarded_by_zero_grad(trainer(manual), 0) == set()

    # ZeRO-1 frees the gradients at its step, once its slice is taken, where the next batch's zero_grad drops them
    from lightning_avgpipe.plugin.steps.gradients import free_after_slicing
    from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer

    v = nn.Parameter(torch.zeros(4))
    sharded = ShardedOptimizer(torch.optim.Adam([v]), [v], None, [0, 1], 0)
    free_after_slicing(trainer(Plain(), accumulate=2, opt=sharded), 1)  # the step ends a window: the next starts one
    assert sharded.unread_after_step == {id(v)}
    free_after_slicing(trainer(Plain(), accumulate=3, opt=sharded), 0)  # no step here, nor a window's start next
    assert sharded.unread_after_step == set()
    free_after_slicing(trainer(Reads(), opt=sharded), 0)
    assert sharded.unread_after_step == set()


def test_the_activation_meter_counts_no_weight_however_it_is_held() -> None:
    """What autograd saves of the weights is not an activation: a weight moved into one flat buffer after the meter
    was made (ZeRO-1's views) nor a gathered weight the meter was never given (FSDP's unsharded parameters)."""
    from lightning_avgpipe.runtime.trace import ActivationMeter

    torch.manual_seed(0)
    layer = nn.Linear(16, 16, bias=False)
    meter = ActivationMeter(list(layer.parameters()))
    flat = torch.zeros(16 * 16 + 8)
    flat[:256].copy_(layer.weight.detach().reshape(-1))
    layer.weight.data = flat[:256].view(16, 16)
    gathered = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    meter.reset()
    with meter.unit(0):
        hidden = layer(x).tanh()
        out = torch.nn.functional.linear(hidden, gathered)
    # saved: the input x and tanh's output (which the second linear saves too); 4 x 16 float32 each
    assert meter.peak == 2 * 4 * 16 * 4
    out.sum().backward()
    assert layer.weight.grad is not None and gathered.grad is not None
