"""Sequence parallelism inside one stage (runtime/sharding/sequence_parallel.py; issue 45, part 1): blocks split by
the default plan and made to run on each shard's part of the sequence give the unsplit blocks' outputs and
gradients, at T = 2, and save less for the backward than 1D tensor parallelism does."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.helpers.blocks import Block, GPT2Block, LlamaBlock, WholeAttentionBlock
from tests.helpers.harness import run_distributed

WIDTH, SEQ = 16, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Block's MLP pair are its own children: the block is one region, run as under 1D between the others
    blocks = [GPT2Block(WIDTH), Block(WIDTH), LlamaBlock(WIDTH), WholeAttentionBlock(WIDTH)]
    for b in blocks:  # LayerNorm's and RMSNorm's weights away from 1, biases away from 0
        for m in b.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
                    if getattr(m, "bias", None) is not None:
                        m.bias.uniform_(-0.5, 0.5)
    return nn.Sequential(*blocks)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from lightning_avgpipe.shards import full

    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_avgpipe.runtime.sharding import sequence_parallel as sp
    from lightning_avgpipe.runtime.sharding.tensor_parallel import default_plan, parallelize_stage
    from lightning_avgpipe.runtime.trace import saved_bytes

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, SEQ, WIDTH, generator=g)
    target = torch.randn(2, SEQ, WIDTH, generator=g)

    whole = _model()
    split_1d, split_sp = copy.deepcopy(whole), copy.deepcopy(whole)
    named = {f"{i}": b for i, b in enumerate(split_1d)}
    left: list[str] = []
    parallelize_stage(named, default_plan(named), mesh, left)
    named = {f"{i}": b for i, b in enumerate(split_sp)}
    parallelize_stage(named, default_plan(named), mesh, sequence=True)
    stage = sp.sequence_stage([list(split_sp)], group)
    changed = [stage.layers.get(i) for i in range(len(split_sp))]
    out: dict[str, Any] = {
        "left": left,
        "summed": [c.summed if c else None for c in changed],
        "gathered": [c.gathered if c else None for c in changed],
    }
    runs = {}
    for name, model, sequence in (("whole", whole, False), ("1d", split_1d, False), ("sp", split_sp, True)):
        inp = x.clone().requires_grad_(True)

        def forward(model: nn.Module = model, inp: torch.Tensor = inp) -> torch.Tensor:
            torch.manual_seed(7)  # the dropout masks: the same draws in every run
            return model(inp)  # each run of sequence-parallel layers enters and leaves the shard itself

        saved = saved_bytes(forward, list(model.parameters()))
        y = forward()
        (y * target).sum().backward()
        if sequence:  # the weights that saw one shard of the sequence
            stage.sum_grads(list(model))
        runs[name] = {"y": y.detach(), "x_grad": inp.grad, "grads": _grads(model), "saved": saved}
    out["runs"] = runs
    return out


def test_blocks_on_a_shard_of_the_sequence_equal_the_unsplit_blocks() -> None:
    """GPT-2's block (Conv1D, fused qkv), a residual MLP run as under 1D between the others, a Llama-like block
    (RMSNorm, grouped-query attention called by keyword, dropout on the shard drawing the unsplit model's masks) and
    a block whose attention stays whole: outputs, input
    gradients and every weight's gradient (the shards' put together, the shard-run ones summed) equal the unsplit
    model's on both shards, and each shard saves less for the backward than under 1D tensor parallelism."""
    results = run_distributed(_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        runs = out["runs"]
        want = runs["whole"]
        for name in ("1d", "sp"):
            got = runs[name]
            torch.testing.assert_close(got["y"], want["y"], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n} y: {m}")
            torch.testing.assert_close(got["x_grad"], want["x_grad"], rtol=1e-4, atol=1e-5)
            assert got["grads"].keys() == want["grads"].keys()
            for k, v in want["grads"].items():
                torch.testing.assert_close(
                    got["grads"][k],
                    v,
                    rtol=1e-4,
                    atol=1e-5,
                    msg=lambda m, k=k, n=name, r=rank: f"rank {r} {n} {k}: {m}",
                )
        # attentions get the whole sequence; the MLPs gather and scatter it (their trial passed); Block is 1D
        assert out["gathered"] == [["attn"], None, ["self_attn"], ["attn"]], out["gathered"]
        assert out["summed"][0] == ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"], out["summed"]
        assert out["summed"][2] == ["input_layernorm.weight", "post_attention_layernorm.weight"], out["summed"]
        assert out["summed"][3] == ["ln.weight", "ln.bias"], out["summed"]  # not the whole attention's weights
        assert runs["sp"]["saved"] < runs["1d"]["saved"], (runs["sp"]["saved"], runs["1d"]["saved"])


def test_sequence_parallelism_without_tensor_parallelism_or_a_sequence_is_refused_with_the_fix() -> None:
    import pytest

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.sharding.sequence_parallel import enter

    with pytest.raises(ValueError, match=r"tensor_parallel_size=1: set tensor_parallel_size > 1, or sequence_paral"):
        PipelineConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel='yes' must be True or False"):
        PipelineConfig(sequence_parallel="yes", tensor_parallel_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"has shape \(4, 8\): set sequence_parallel=False for a model without"):
        enter(torch.zeros(4, 8), None)
