"""Random draws inside the pipelined layers (runtime/streams.py): with each layer seeded from
(seed, step, micro-batch, layer), dropout gives the same masks, and training the same result, for S = 1, 2 and 4,
zbv and interleaved (two stages per rank), 1F1B and activation checkpointing; without it, S = 2 differs from S = 1."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe.runtime.recompute import stage_function
from lightning_avgpipe.runtime.streams import RandomStreams, seeded, unit
from tests.helpers.distributed import run_distributed

STEPS, M, SEED = 3, 3, 7
SIZES = {1: [8], 2: [4, 4], 4: [2, 2, 2, 2]}  # layers per model stage (S x v stages)


def make_layers() -> list[nn.Module]:
    """Eight layers, three of them dropout (p = 0.3)."""
    torch.manual_seed(0)
    return [
        nn.Linear(8, 16),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.Dropout(0.3),
        nn.Linear(16, 4),
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 8, generator=g), torch.randint(0, 4, (12,), generator=g)


def train(rank: int, world: int, schedule: str, v: int, checkpointing: bool, streams: bool) -> dict[str, Any]:
    """One layout: this rank's stages of the model trained ``STEPS`` steps with SGD; its losses and weights."""
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.schedules.chunks import stages_of
    from lightning_avgpipe.schedules.generate import schedule_layout

    layers = make_layers()
    sizes = SIZES[world * v]
    first = list(itertools.accumulate([0, *sizes[:-1]]))
    top = Topology.build(rank, world, world) if world > 1 else Topology(0, 1, 1)
    layout = schedule_layout(schedule, world, v if v > 1 else None)
    mine = stages_of(rank, world, v, layout.placement)
    index = [i for j in mine for i in range(first[j], first[j] + sizes[j])]
    cfg = PipelineConfig(
        num_stages=world,
        num_microbatches=M,
        schedule=schedule,
        stages_per_rank=v if v > 1 else None,
        activation_checkpointing=checkpointing,
    )
    pipe = StagePipeline([layers[i] for i in index], top, cfg, chunks=[sizes[j] for j in mine])
    if streams:
        pipe.streams = RandomStreams(SEED, first)
    opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1))
    torch.manual_seed(1000 + rank)  # each process's own generator differs: only the streams can make masks agree
    losses = []
    for step in range(STEPS):
        if pipe.streams is not None:
            pipe.streams.step = (step, 0)
        opt.zero_grad()
        result = pipe.train_step([batch(step)], lambda out, b, share: F.cross_entropy(out, b[1]))
        opt.step()
        losses.append(float(result.loss) if result.loss is not None else None)
    state = {f"{i}.{k}": v.detach().clone() for i in index for k, v in layers[i].state_dict().items()}
    return {"losses": losses, "state": state}


def _worker(rank: int, world: int, cases: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [train(rank, world, *case) for case in cases]


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return train(0, 1, "1f1b", 1, False, True)


def _merged(results: list[dict[str, Any]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = next(r["losses"] for r in results if r["losses"][0] is not None)
    return losses, {k: v for r in results for k, v in r["state"].items()}


CASES2 = [("1f1b", 1, False, True), ("1f1b", 1, True, True), ("zbv", 2, False, True), ("interleaved", 2, True, True)]


@pytest.mark.slow
def test_dropout_gives_the_same_training_for_every_layout(one_process: dict[str, Any]) -> None:
    """S = 2 (1F1B, with activation checkpointing, zbv and interleaved at two stages per rank) and S = 4 equal S = 1
    to float tolerance; with the streams off, S = 2 draws other masks and differs."""
    want_losses, want = _merged([one_process])
    two = run_distributed(_worker, 2, [*CASES2, ("1f1b", 1, False, False)], timeout=300, what="streams S=2")
    four = run_distributed(_worker, 4, [("1f1b", 1, False, True)], timeout=300, what="streams S=4")
    layouts = [[r[c] for r in two] for c in range(len(CASES2))] + [[r[0] for r in four]]
    for case, results in zip([*CASES2, "S=4"], layouts):
        losses, state = _merged(results)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), msg=lambda m, c=case: f"{c}: {m}")
        assert state.keys() == want.keys()
        for key, value in state.items():
            says = f"{case} {key}"
            torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=lambda m, s=says: f"{s}: {m}")
    off_losses, _ = _merged([r[len(CASES2)] for r in two])
    assert abs(off_losses[0] - want_losses[0]) > 1e-3, (off_losses, want_losses)


def test_a_layer_draws_the_same_mask_wherever_it_runs_and_the_generator_is_put_back() -> None:
    """The same layer index of the unsplit model gives the same mask in one stage of 4 layers and in the second of
    two stages of 2; the process's generator is where it was; without a training unit nothing is seeded."""
    layers = [nn.Dropout(0.5) for _ in range(4)]
    x = torch.ones(6, 10)
    streams = RandomStreams(3, [0, 2])
    streams.step = (5, 0)
    whole = stage_function(layers, None, lambda i: streams.seed_of(0, i))
    second = stage_function(layers[2:], None, lambda i: streams.seed_of(1, i))
    before = torch.get_rng_state()
    with unit(1):
        a = whole(x)
        b = second(stage_function(layers[:2], None, lambda i: streams.seed_of(0, i))(x))
    assert torch.equal(a, b) and not torch.equal(a, x)
    assert torch.equal(torch.get_rng_state(), before)
    with unit(2):  # another micro-batch: other masks
        assert not torch.equal(whole(x), a)
    assert streams.seed_of(0, 0) is None  # outside a training forward: the process's generator
    with seeded(11, torch.device("cpu")):
        r1 = torch.rand(3)
    with seeded(11, torch.device("cpu")):
        assert torch.equal(torch.rand(3), r1)


@pytest.mark.slow
def test_dropout_under_lightning_is_the_same_on_one_device_and_on_two_stages(tmp_path: Any) -> None:
    """PipeNet with dropout and BatchNorm (``noisy``) under the strategy, ``seed_everything(5)``: S = 1 on one device
    and S = 2 give the same losses and weights (the streams follow Lightning's step and batch index)."""
    from tests.helpers.equivalence import run_lightning

    noisy = {"noisy": True, "optimizer": "adam", "lr": 0.01}
    one = run_lightning(tmp_path / "one", 1, {"num_stages": 1, "num_microbatches": 3}, model=noisy, seed=5)
    two = run_lightning(tmp_path / "two", 2, {"num_microbatches": 3}, model=noisy, seed=5)
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one[0]["losses"]))
    a = torch.load(tmp_path / "one" / "final.ckpt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "two" / "final.ckpt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], msg=lambda m, k=key: f"{k}: {m}")
