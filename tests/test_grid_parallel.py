"""2D (SUMMA) and 2.5D tensor parallelism inside one stage (runtime/sharding/grid.py, grid_stage.py; issue 45, part
2): whole blocks converted by ``grid_stage`` give the unsplit blocks' outputs, input gradients and weight gradients on
every rank of a 2 x 2 grid and of a 2 x 2 x 2 one, dropout included, while each rank holds about 1/q² of the weights
and saves about 1/q² of the activations; and the comparisons fail without SUMMA's broadcasts or the gradient sums."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.blocks import Block, GPT2Attention, GPT2Block, LlamaBlock, LlamaRMSNorm, WholeAttentionBlock
from tests.helpers.harness import run_distributed

TOL = {"rtol": 1e-4, "atol": 1e-5}


class Gain(nn.Module):
    """A weight of its own, which the grid cannot cut: the layer runs whole."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Centred(nn.Module):
    """A mean over the hidden dimension outside a norm: wrong on a block, which the trial sees."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x) - x.mean(-1, keepdim=True)


def _gpt2(width: int, heads: int = 4) -> GPT2Block:
    block = GPT2Block(width)
    block.attn = GPT2Attention(width, heads=heads)  # 4: heads over the q² = 4 ranks of a depth layer; 8: over all 8
    return block


def _llama(width: int) -> LlamaBlock:
    """8 heads, 4 for keys and values; torch's RMSNorm, then Hugging Face's (found by its name); the MLP 2x wide."""
    return LlamaBlock(width, heads=8, kv_heads=4, widen=2, second_norm=LlamaRMSNorm)


def _model(kind: str, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module]
    if kind == "2d":
        blocks = [_gpt2(width), _llama(width), Block(width)]
    elif kind == "small":
        blocks = [_llama(width), Block(width)]
    else:  # 2.5D: converted layers around ones that run whole
        # GPT-2's 8 heads over every rank of the grid, the Llama block's 8 (4 for keys and values) over a depth layer
        # nanoGPT's attention with heads that divide over a depth layer's 4 ranks: the trial is what leaves it whole
        blocks = [_gpt2(width, 8), WholeAttentionBlock(width, 4), Gain(width), Centred(width), _llama(width)]
    for b in blocks:  # the norms' weights away from 1, biases away from 0
        for m in b.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm, LlamaRMSNorm)):
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    if getattr(m, "bias", None) is not None:
                        m.bias.uniform_(-0.5, 0.5)
    return nn.Sequential(*blocks)


def _run(model: nn.Module, x: torch.Tensor, target: torch.Tensor, stage: Any = None) -> dict[str, Any]:
    from lightning_avgpipe.runtime.trace import saved_bytes
    from lightning_avgpipe.shards import full, local

    inp = x.clone().requires_grad_(True)

    def forward() -> torch.Tensor:
        torch.manual_seed(7)  # the dropout masks: the same draws in every run
        return model(inp)  # type: ignore[no-any-return]

    saved = saved_bytes(forward, list(model.parameters()))
    y = forward()
    (y * target).sum().backward()
    if stage is not None:
        stage.sum_grads(list(model))
    return {
        "y": y.detach(),
        "x_grad": inp.grad,
        "grads": {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "weights": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
        "weight_bytes": sum(local(p).numel() * p.element_size() for p in model.parameters()),
        "saved": saved,
    }


def _worker(rank: int, world: int, kind: str, q: int, depth: int, width: int, seq: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_avgpipe.runtime.sharding import grid as grid_module
    from lightning_avgpipe.runtime.sharding.grid_stage import grid_stage

    mesh = grid_module.grid_mesh(init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",)), q, depth)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(2, seq, width, generator=g), torch.randn(2, seq, width, generator=g)
    whole = _model("small" if kind == "broken" else kind, width)
    split = copy.deepcopy(whole)
    stage = grid_stage([list(split)], mesh)
    out: dict[str, Any] = {
        "layers": sorted(stage.layers),
        "left": stage.left,
        "attentions": {i: done.attentions for i, done in stage.layers.items()},
        "whole": _run(whole, x, target),
        # how many ranks each attention's heads are split over (its output projection's mesh)
        "spread": {
            n: m.weight.device_mesh.size()
            for n, m in split.named_modules()
            if n.endswith(("c_proj", "o_proj")) and getattr(m.weight, "device_mesh", None) is not None and "attn" in n
        },
    }
    if kind != "broken":
        out["grid"] = _run(split, x, target, stage)
        return out
    # the same conversion with a part taken out: each must change what is compared
    no_sums = copy.deepcopy(split)
    out["no_sums"] = _run(no_sums, x, target)  # sum_grads skipped
    broadcast = grid_module.BROADCAST
    grid_module.BROADCAST = lambda *a, **k: None  # SUMMA's broadcasts skipped: each rank multiplies what it has
    try:
        out["no_broadcast"] = _run(copy.deepcopy(split), x, target, stage)
    finally:
        grid_module.BROADCAST = broadcast
    out["grid"] = _run(split, x, target, stage)
    return out


def _same(got: dict[str, Any], want: dict[str, Any], rank: int) -> None:
    torch.testing.assert_close(got["y"], want["y"], **TOL, msg=lambda m: f"rank {rank} output: {m}")
    torch.testing.assert_close(got["x_grad"], want["x_grad"], **TOL, msg=lambda m: f"rank {rank} input grad: {m}")
    assert got["grads"].keys() == want["grads"].keys()
    for k, v in want["grads"].items():
        torch.testing.assert_close(got["grads"][k], v, **TOL, msg=lambda m, k=k: f"rank {rank} grad {k}: {m}")
    for k, v in want["weights"].items():  # full_tensor() of every block is the unsplit weight
        torch.testing.assert_close(got["weights"][k], v, rtol=0, atol=0)


def test_blocks_on_a_2d_grid_equal_the_unsplit_blocks_with_a_quarter_of_the_memory() -> None:
    """q = 2 (4 ranks): GPT-2's block (Conv1D, fused qkv split by heads), a Llama-like block (RMSNorm by type and
    by name, grouped-query attention called by keyword, dropout drawing the unsplit model's masks) and a residual
    MLP; each rank holds about a quarter of the weights and saves about a quarter of the activations."""
    results = run_distributed(_worker, 4, "2d", 2, 1, 32, 8, timeout=120)
    for rank, out in enumerate(results):
        assert out["layers"] == [0, 1, 2] and out["left"] == {}, (out["layers"], out["left"])
        assert out["attentions"] == {0: {"attn": "heads"}, 1: {"self_attn": "heads"}, 2: {}}, out["attentions"]
        want, got = out["whole"], out["grid"]
        _same(got, want, rank)
        # weights: 1/q² of the matrices (the norms' 1/q); activations: 1/q² (the attention's whole sequence over
        # the heads included), plus the norms' per-token statistics
        assert got["weight_bytes"] < 0.27 * want["weight_bytes"], (got["weight_bytes"], want["weight_bytes"])
        assert got["saved"] < 0.3 * want["saved"], (got["saved"], want["saved"])


def test_blocks_on_a_2_5d_grid_equal_the_unsplit_blocks_around_layers_left_whole() -> None:
    """2.5D, q = 2, depth 2 (8 ranks): converted blocks around layers that run whole (an attention whose heads do
    not split, a weight the grid cannot cut, a mean over the hidden dimension the trial catches): the unsplit
    outputs and gradients on every rank, the weights of the grid summed over depth."""
    results = run_distributed(_worker, 8, "2.5d", 2, 2, 16, 8, timeout=150)
    for rank, out in enumerate(results):
        assert out["layers"] == [0, 1, 4], out["layers"]
        assert out["left"] == {
            2: "its weight 'gain' is a Gain's, which the grid cannot cut",
            3: "converting it changed its output",
        }, out["left"]
        assert out["attentions"][1]["attn"].startswith("its forward failed split"), out["attentions"]
        assert out["attentions"][4] == {"self_attn": "heads"}, out["attentions"]
        # GPT-2's 8 heads over all 8 ranks (each depth layer its own), the Llama's over a depth layer's 4
        assert out["spread"] == {"0.attn.c_proj": 8, "4.self_attn.o_proj": 4}, out["spread"]
        want, got = out["whole"], out["grid"]
        _same(got, want, rank)
        assert got["weight_bytes"] < want["weight_bytes"], (got["weight_bytes"], want["weight_bytes"])


def test_the_comparison_fails_without_summas_broadcasts_or_the_gradient_sums() -> None:
    """Taking out SUMMA's broadcasts changes the output; skipping ``sum_grads`` changes the gradients of the
    weights that saw a block (the norms, the biases); the intact conversion matches on the same run."""
    results = run_distributed(_worker, 4, "broken", 2, 1, 32, 8, timeout=120)
    for rank, out in enumerate(results):
        want = out["whole"]
        _same(out["grid"], want, rank)
        assert not torch.allclose(out["no_broadcast"]["y"], want["y"], **TOL)
        no_sums = out["no_sums"]
        torch.testing.assert_close(no_sums["y"], want["y"], **TOL)  # the forward needs no sums
        wrong = [k for k, v in want["grads"].items() if not torch.allclose(no_sums["grads"][k], v, **TOL)]
        assert "0.input_layernorm.weight" in wrong and "1.norm.bias" in wrong and "1.fc1.bias" in wrong, wrong
        assert "1.fc1.weight" not in wrong, wrong  # SUMMA reduces its weight's gradient inside the backward


def test_a_grid_that_does_not_fit_is_refused_with_the_fix() -> None:
    """A tensor mesh of the wrong size or without a name, and activations that do not cut into the grid's blocks,
    raise errors that name the values and the fix (no process group needed: the checks come first)."""
    import pytest

    from lightning_avgpipe.runtime.sharding.grid import Grid, grid_mesh

    class Mesh:  # a 1D DeviceMesh's shape, as grid_mesh reads it
        ndim, shape, mesh_dim_names = 1, (6,), ("tensor",)

        def size(self) -> int:
            return 6

    with pytest.raises(ValueError, match=r"q=2, depth=1\) needs a 1D tensor mesh of depth \* q \* q = 4 ranks, but it"):
        grid_mesh(Mesh(), 2)
    Mesh.shape, Mesh.mesh_dim_names, Mesh.size = (4,), None, lambda self: 4  # type: ignore[assignment,method-assign]
    with pytest.raises(ValueError, match=r"has no dimension name: make it with init_device_mesh\(\.\.\., mesh_dim"):
        grid_mesh(Mesh(), 2)
    grid = Grid(None, 2, 2, 1, 0, 1, None, None, None, None, None, None)
    uneven = r"into 4 parts and the last \(the hidden one\) into 2, but they have shape \(2, 6, 8\): make the seq"
    with pytest.raises(ValueError, match=uneven):
        grid.block(torch.zeros(2, 6, 8), 1)
    block = grid.block(torch.arange(2 * 8 * 4.0).view(2, 8, 4), 1)  # sequence part k q + i = 2, hidden part 1
    assert block.tolist() == torch.arange(2 * 8 * 4.0).view(2, 8, 4)[:, 4:6, 2:].tolist()


def _norm_worker(rank: int, world: int) -> dict[str, float]:
    """On 8 ranks, one tensor group: each tensor's local squared norm, weighted by ``shards.norm_weight`` and summed
    over the group, against its whole squared norm."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_avgpipe.runtime.sharding.grid import Grid, grid_mesh
    from lightning_avgpipe.shards import norm_weight

    tensor_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    grid = Grid.of(grid_mesh(tensor_mesh, 2, 2))
    whole = torch.arange(24 * 8, dtype=torch.float32).reshape(24, 8) / 100
    cases = {
        "1D column": (tensor_mesh, [Shard(0)]),
        "1D fused qkv by heads": (tensor_mesh, [_StridedShard(0, split_factor=3)]),
        "1D row-wise bias": (tensor_mesh, [Replicate()]),
        "grid weight": (grid.mesh, [Replicate(), Shard(1), Shard(0)]),
        "grid bias": (grid.mesh, [Replicate(), Replicate(), Shard(0)]),
        "heads over the whole grid": (grid.flat, [Shard(0)]),
        "heads over a depth layer": (grid.layer, [Shard(0)]),
    }
    out = {}
    for name, (mesh, placements) in cases.items():
        t = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        total = torch.tensor([t.to_local().pow(2).sum().item() * norm_weight(t, world)])
        dist.all_reduce(total)
        out[name] = float(total) / float(whole.pow(2).sum())
    return out


def test_norms_count_every_part_of_every_split_once() -> None:
    """Clipping's and the probes' squared norms: a 1D shard, a fused qkv's strided shard, a row-wise layer's whole
    bias, a grid's weight and bias (copied over depth) and heads over the whole grid or one depth layer, each summed
    over the 8 ranks of a 2 x 2 x 2 grid, give the whole tensor's squared norm (the strided shard was counted 1/T
    before)."""
    for rank, out in enumerate(run_distributed(_norm_worker, 8, timeout=120)):
        assert out == pytest.approx(dict.fromkeys(out, 1.0), rel=1e-6), (rank, out)
