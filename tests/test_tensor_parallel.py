"""Tensor parallelism inside a stage (runtime/tensor_parallel.py): a D x S x T mesh on gloo matches one process.

Each launch runs several configurations in the same processes (the mesh is built once): N = 1 and N = 2 replicas,
activation checkpointing on and off. The reference is one process training the unsplit layers: N x D replicas,
each on its own batch with its own optimizer, tied by the same elastic rule (N x D = 1: plain training).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe import microbatch
from lightning_avgpipe.runtime.tensor_parallel import check_plan, default_plan
from lightning_avgpipe.runtime.topology import Topology
from tests.helpers.distributed import run_distributed

STEPS = 3
M = 2
BATCH = 8
# (N, activation checkpointing[, schedule]): the backward split (zbh1) defers the sharded weights' gradients too
CONFIGS = [(1, False), (2, True), (1, True), (2, False), (1, False, "zbh1"), (2, True, "zbh1")]


class Block(nn.Module):
    """A pre-norm residual MLP: the default plan splits fc1 column-wise and fc2 row-wise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def make_model(seed: int = 0, width: int = 8, inputs: int = 6, classes: int = 4) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(inputs, width), Block(width), Block(width), Block(width), Block(width), nn.Linear(width, classes)]


def batch(step: int, replica: int, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def reference(replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: ``replicas`` = N x D copies of the unsplit model, each its own SGD, tied by the elastic rule."""
    from lightning_avgpipe.elastic import ElasticAveraging

    layers = make_model()
    elastic = ElasticAveraging(layers, num_replicas=replicas)
    opts = [torch.optim.SGD(elastic.replica_params(r), lr=0.1, momentum=0.9) for r in range(replicas)]
    losses = []
    for step in range(STEPS):
        elastic.begin_step()
        total = 0.0
        for r in range(replicas):
            x, y = batch(step, r, replicas)
            opts[r].zero_grad()
            net = nn.Sequential(*elastic.replicas[r])
            for mx, my in zip(microbatch.split(x, M), microbatch.split(y, M)):
                loss = F.cross_entropy(net(mx), my) * (len(my) / len(y))
                loss.backward()
                total += loss.item() / replicas
            opts[r].step()
        elastic.finish_step()
        losses.append(total)
    state = {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    return losses, state


def _worker(rank: int, world: int, stages: int, tp: int, configs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.tensor_parallel import parallelize_stage
    from lightning_avgpipe.shards import full

    top = Topology.build(rank, world, stages, tensor_parallel_size=tp)
    sizes = [3, 3] if stages == 2 else [6]
    start = sum(sizes[: top.stage])
    out = []
    for n, ac, *schedule in configs:
        layers = make_model()
        own = {str(i): layers[i] for i in range(start, start + sizes[top.stage])}
        split = parallelize_stage(own, default_plan(own), top.tensor_mesh)
        cfg = PipelineConfig(
            num_stages=stages,
            num_microbatches=M,
            num_pipelines=n,
            activation_checkpointing=ac,
            schedule=schedule[0] if schedule else "1f1b",
        )
        pipe = StagePipeline(list(own.values()), top, cfg)
        opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1, momentum=0.9))
        losses = []
        for step in range(STEPS):
            batches = [batch(step, top.group_index * n + r, n * top.num_groups) for r in range(n)]
            opt.zero_grad()
            result = pipe.train_step(batches, lambda out, b, share: F.cross_entropy(out, b[1]), measure=True)
            opt.step()
            losses.append(float(result.loss) if result.loss is not None else None)
        pipe.elastic.wait()
        state = {f"{i}.{k}": full(v).detach().clone() for i, m in own.items() for k, v in m.state_dict().items()}
        peak = result.trace.peak_activation_bytes
        link = pipe.link  # only shard 0 of a stage talks to the neighbouring stages: one copy crosses a boundary
        talks = getattr(link, "inner", None) is not None
        out.append({"losses": losses, "state": state, "split": split, "shard": top.tensor_rank, "peak": peak})
        out[-1]["talks"] = talks
    return out


def _check(results: list[list[dict[str, Any]]], configs: list[tuple[Any, ...]], groups: int) -> None:
    for c, (n, *_) in enumerate(configs):
        want_losses, want = reference(n * groups)
        for rank_results in results:
            got = rank_results[c]
            for key, value in got["state"].items():
                torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
            if got["losses"][0] is not None and groups == 1:  # the last stage's loss: its group's N replicas
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses))
    assert [r[0]["talks"] for r in results] == [r[0]["shard"] == 0 for r in results]
    split = {name for r in results for name in r[0]["split"]}
    assert split == {f"{i}.{fc}" for i in range(1, 5) for fc in ("fc1", "fc2")}


@pytest.mark.slow
def test_two_stages_of_two_shards_match_one_process() -> None:
    """T = 2, S = 2 (4 ranks): N = 1 and N = 2, activation checkpointing on and off, 1F1B and ZB-H1 (the backward
    split), equal the unsplit model."""
    results = run_distributed(_worker, 4, 2, 2, CONFIGS, timeout=240, what="T=2 S=2")
    _check(results, CONFIGS, groups=1)
    # checkpointing kept only the checkpointed layers' inputs: the stash is smaller on every rank (N = 1 runs)
    for rank_results in results:
        assert rank_results[2]["peak"] < rank_results[0]["peak"]


@pytest.mark.slow
def test_two_groups_of_two_stages_of_two_shards_match_one_process() -> None:
    """D = 2, S = 2, T = 2 (8 ranks, a tiny model): the data dimension averages each (stage, shard) over D."""
    configs = [(1, True), (2, False)]
    results = run_distributed(_worker, 8, 2, 2, configs, timeout=300, what="D=2 S=2 T=2")
    _check(results, configs, groups=2)


def test_rank_layout_keeps_shards_of_a_stage_together() -> None:
    """T innermost: ranks 0-1 are stage 0's shards, 2-3 stage 1's, then the second group."""
    tops = [Topology(r, 8, 2, tensor_parallel_size=2) for r in range(8)]
    assert [(t.group_index, t.stage, t.tensor_rank) for t in tops] == [
        (d, s, t) for d in range(2) for s in range(2) for t in range(2)
    ]
    assert tops[5].tensor_ranks == [4, 5]
    assert tops[5].pipeline_ranks == [5, 7]
    assert Topology(3, 4, 4).pipeline_ranks == [0, 1, 2, 3]  # T = 1 keeps the old layout


@pytest.mark.parametrize(
    ("world", "stages", "tp", "match"),
    [(6, 2, 4, "tensor_parallel_size=4"), (8, 3, 2, "num_stages x tensor_parallel_size"), (4, 2, 0, "tensor_p")],
)
def test_a_mesh_that_does_not_fit_the_world_is_refused(world: int, stages: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(0, world, stages, tensor_parallel_size=tp)


def test_default_plan_pairs_linears_and_a_wrong_name_is_refused() -> None:
    layers = make_model()
    named = {str(i): layer for i, layer in enumerate(layers)}
    plan = default_plan(named)
    assert sorted(plan) == sorted(f"{i}.{fc}" for i in range(1, 5) for fc in ("fc1", "fc2"))
    assert [type(plan["1.fc1"]).__name__, type(plan["1.fc2"]).__name__] == ["ColwiseParallel", "RowwiseParallel"]
    # siblings only: attention's output projection and the next MLP's first Linear (widths d -> d) are not a pair
    gpt_like = nn.ModuleDict(
        {
            "qkv": nn.Linear(8, 24),
            "proj": nn.Linear(8, 8),
            "mlp": nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)),
        }
    )
    assert sorted(default_plan({"h.0": gpt_like})) == ["h.0.mlp.0", "h.0.mlp.2"]
    # LLaMA-style attention (q, k, v, o all d -> d) and a gated MLP (gate, up, down) stay whole
    attention = nn.ModuleDict({n: nn.Linear(8, 8) for n in ("q", "k", "v", "o")})
    gated = nn.ModuleDict({"gate": nn.Linear(8, 32), "up": nn.Linear(8, 32), "down": nn.Linear(32, 8)})
    assert default_plan({"attn": attention, "mlp": gated}) == {}
    # a nanoGPT-style block whose attention and MLP Linear layers are siblings: the MLP pair is found among them
    flat = nn.ModuleDict(
        {"qkv": nn.Linear(8, 24), "proj": nn.Linear(8, 8), "fc1": nn.Linear(8, 32), "fc2": nn.Linear(32, 8)}
    )
    assert sorted(default_plan({"b": flat})) == ["b.fc1", "b.fc2"]
    flat_gated = nn.ModuleDict({**dict(flat.items()), "gate": nn.Linear(8, 32)})  # another sibling makes h: whole
    assert default_plan({"b": flat_gated}) == {}
    names = [n for n, _ in nn.Sequential(*copy.deepcopy(layers)).named_modules()]
    check_plan({"*.fc1": None, "2.fc2": None}, names)
    with pytest.raises(ValueError, match=r"'3\.fc3'.*no module of the model"):
        check_plan({"3.fc3": None}, names)


def _split_output_worker(rank: int, world: int) -> str:
    import torch.distributed as dist

    from lightning_avgpipe.runtime.p2p import StageOutputError
    from lightning_avgpipe.runtime.tensor_parallel import whole_outputs

    same = whole_outputs(lambda x: x * 2, dist.group.WORLD, "stage 0")
    assert torch.equal(same(torch.ones(2, 3)), torch.full((2, 3), 2.0))
    # a last stage's dict with a None, and a diverged (non-finite) output: not taken for a split output
    last = whole_outputs(lambda x: {"logits": x, "aux": None}, dist.group.WORLD, "stage 1")
    assert last(torch.ones(2))["aux"] is None
    diverged = whole_outputs(lambda x: x * float("nan") + rank, dist.group.WORLD, "stage 0")
    assert torch.isnan(diverged(torch.ones(2))).all()
    split = whole_outputs(lambda x: x + rank, dist.group.WORLD, "stage 0 (rank 0)")
    try:
        split(torch.ones(2, 3))
    except StageOutputError as err:
        return str(err)
    return "no error"


def test_a_plan_that_leaves_a_stage_output_split_is_named() -> None:
    """Shards whose stage outputs differ (a column-wise layer ending a stage) fail on both ranks with the fix."""
    for message in run_distributed(_split_output_worker, 2, timeout=120):
        assert "computed different outputs" in message and "RowwiseParallel" in message


def test_strategy_arguments_for_tensor_parallelism_are_checked() -> None:
    """T that does not divide a node's devices, plans that are not name -> style, a plan with T = 1, and the
    combinations not supported yet: each named with its fix."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_avgpipe import AvgPipeStrategy
    from lightning_avgpipe.plugin.tensor import check_combinations, check_tensor_parallel_args

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the 3 devices of a node"):
        check_tensor_parallel_args(2, None, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_plan=\['fc1'\] must map module names"):
        check_tensor_parallel_args(2, ["fc1"], 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['fc1'\]='sideways' is not a ParallelStyle"):
        check_tensor_parallel_args(2, {"fc1": "sideways"}, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=1; set tensor_parallel_size=2"):
        AvgPipeStrategy(tensor_parallel_plan={"fc1": "colwise"})
    plan = check_tensor_parallel_args(2, {"a": "colwise", "b": ColwiseParallel()}, 4)
    assert plan is not None and all(type(s).__name__ == "ColwiseParallel" for s in plan.values())
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be an int >= 1"):
        AvgPipeStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tied embedding and head"):
        check_combinations(2, {(0, 1): []})
    check_combinations(1, {(0, 1): []})  # T = 1: ties are fine
    check_combinations(2, {})
