"""Deferred weight gradients (runtime/deferred.py): I then W gives plain autograd's gradients, nothing done twice."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_avgpipe.runtime.deferred import WeightGradQueue
from tests.helpers import blocks


class Conv1D(blocks.Conv1D):
    """Hugging Face's Conv1D as transformers writes it (``tests/helpers/blocks.py``), its weights drawn small."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__(nf, nx, scale=0.1)


class Block(nn.Module):
    """A GPT block: LayerNorm, fused qkv, causal attention by plain ops, proj, MLP fc1/GELU/fc2."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, dim=-1))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Linear(32, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 4))


def conv1d_mlp() -> nn.Module:
    return nn.Sequential(Conv1D(16, 8), nn.GELU(), Conv1D(4, 16))


def floats(*shape: int) -> Callable[[int], Tensor]:
    return lambda seed: torch.randn(*shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def indices(seed: int) -> Tensor:
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(seed))


MODELS = {
    "mlp": (mlp, floats(5, 8)),
    "gpt_block": (Block, floats(2, 6, 32)),
    "tied_embedding": (Tied, indices),
    "conv1d": (conv1d_mlp, floats(2, 3, 8)),
    "checkpointed": (Checkpointed, floats(2, 6, 32)),
}


def loss_of(out: Tensor) -> Tensor:
    return (out.float() ** 2).mean()


def deferred_weights(model: nn.Module) -> list[Tensor]:
    kinds = (nn.Linear, nn.Embedding, Conv1D)
    return [m.weight for m in model.modules() if isinstance(m, kinds) and m.weight.requires_grad]


def copy_inputs(xs: list[Tensor]) -> list[Tensor]:
    return [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]


def reference(model: nn.Module, xs: list[Tensor]) -> tuple[list[Tensor], list[Tensor | None], list[Tensor | None]]:
    """Outputs, parameter gradients and input gradients of plain autograd on the summed losses."""
    outs = [model(x) for x in xs]
    sum(loss_of(o) for o in outs).backward()  # type: ignore[union-attr]
    return outs, [p.grad for p in model.parameters()], [x.grad for x in xs]


def split(model: nn.Module, xs: list[Tensor], queue: WeightGradQueue) -> list[Tensor]:
    """Forward of both units, then I0, I1 (deferring under 0 and 1); W is left to the caller."""
    outs = [model(x) for x in xs]
    for key, out in enumerate(outs):
        with queue.deferring(key):
            torch.autograd.backward(loss_of(out))
    return outs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_i_then_w_out_of_order_equals_plain_autograd(name: str) -> None:
    make, make_input = MODELS[name]
    torch.manual_seed(0)
    plain = make()
    model = copy.deepcopy(plain)
    xs = [make_input(0), make_input(1)]
    _, ref_grads, ref_input_grads = reference(plain, copy_inputs(xs))

    queue = WeightGradQueue([model])
    split(model, xs, queue)
    for x, ref in zip(xs, ref_input_grads):  # I alone gives the input gradients
        torch.testing.assert_close(x.grad, ref)
    weights = deferred_weights(model)
    assert weights and all(w.grad is None for w in weights)
    others = [p for p in model.parameters() if all(p is not w for w in weights)]
    assert all(p.grad is not None for p in others)  # biases and LayerNorm take theirs in I
    assert queue.pending(0) > 0 and queue.pending(1) == queue.pending(0) and queue.pending_bytes() > 0

    queue.run(1)
    assert queue.pending(1) == 0 and queue.pending(0) > 0
    queue.run(0)
    queue.run(0)  # nothing left: a no-op
    assert queue.pending_bytes() == 0
    for p, ref in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, ref)


def test_without_deferring_the_backward_is_whole() -> None:
    torch.manual_seed(0)
    plain = Block()
    model = copy.deepcopy(plain)
    xs = [floats(2, 6, 32)(0)]
    _, ref_grads, _ = reference(plain, copy_inputs(xs))
    queue = WeightGradQueue([model])
    loss_of(model(xs[0])).backward()
    assert queue.pending_bytes() == 0
    for p, ref in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, ref)


def test_tied_weight_sums_both_uses_and_counts_each_storage_once() -> None:
    torch.manual_seed(0)
    model = Tied()
    queue = WeightGradQueue([model])
    with queue.deferring("u"):
        loss_of(model(indices(0))).backward()
    assert queue.pending("u") == 3  # embedding, mid, head (the head's weight is the embedding's)
    assert model.emb.weight.grad is None and model.mid.bias.grad is not None
    assert queue.pending_bytes() > 0


def test_autocast_bfloat16_matches_plain_autocast() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(Block(), Conv1D(8, 32))
    model = copy.deepcopy(plain)
    xs = [floats(2, 6, 32)(0), floats(2, 6, 32)(1)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_outs, ref_grads, ref_input_grads = reference(plain, copy_inputs(xs))
        queue = WeightGradQueue([model])
        outs = split(model, xs, queue)
    assert queue.pending(0) == 5 and model[0].qkv.weight.grad is None
    queue.run(0)
    queue.run(1)
    for out, ref in zip(outs, ref_outs):
        assert out.dtype == ref.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for x, ref in zip(xs, ref_input_grads):
        torch.testing.assert_close(x.grad, ref, rtol=1.6e-2, atol=1e-5)
    for p, ref in zip(model.parameters(), ref_grads):
        assert p.grad is not None and p.grad.dtype == p.dtype == torch.float32
        torch.testing.assert_close(p.grad, ref, rtol=1.6e-2, atol=1e-5)


def test_checkpointed_block_recomputes_once_per_unit_in_i_and_never_in_w() -> None:
    torch.manual_seed(0)
    model = Checkpointed()
    queue = WeightGradQueue([model])
    outs = [model(floats(2, 6, 32)(seed)) for seed in (0, 1)]
    assert model.block.calls == 2
    for key, out in enumerate(outs):
        with queue.deferring(key):
            loss_of(out).backward()
        assert model.block.calls == 3 + key  # one recompute in this unit's I
    assert model.block.qkv.weight.grad is None and queue.pending(0) == 5
    queue.run(0)
    queue.run(1)
    assert model.block.calls == 4 and model.block.qkv.weight.grad is not None


def test_frozen_weight_and_input_without_grad() -> None:
    torch.manual_seed(0)
    plain = mlp()
    plain[2].weight.requires_grad_(False)
    model = copy.deepcopy(plain)
    xs = [torch.randn(5, 8), torch.randn(5, 8)]  # the first layer's input needs no gradient
    _, ref_grads, _ = reference(plain, copy_inputs(xs))
    queue = WeightGradQueue([model])
    split(model, xs, queue)
    assert queue.pending(0) == 2  # layers 0 and 4: the frozen one queues nothing
    assert model[0].weight.grad is None and model[0].bias.grad is not None
    queue.run(0)
    queue.run(1)
    assert model[2].weight.grad is None
    for p, ref in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, ref)


def test_weight_with_hook_takes_the_whole_backward() -> None:
    model = mlp()
    seen: list[Tensor] = []
    model[0].weight.register_hook(lambda g: seen.append(g))
    queue = WeightGradQueue([model])
    with queue.deferring(0):
        loss_of(model(torch.randn(5, 8))).backward()
    assert len(seen) == 1 and model[0].weight.grad is not None and queue.pending(0) == 2


def test_weight_that_is_not_a_leaf_takes_the_whole_backward() -> None:
    torch.manual_seed(0)
    plain = mlp()
    nn.utils.parametrizations.weight_norm(plain[2])  # its weight is computed from two leaves at each forward
    model = copy.deepcopy(plain)
    xs = [floats(5, 8)(0), floats(5, 8)(1)]
    _, ref_grads, _ = reference(plain, copy_inputs(xs))
    queue = WeightGradQueue([model])
    split(model, xs, queue)
    assert queue.pending(0) == 2 and model[0].weight.grad is None
    assert all(p.grad is not None for p in model[2].parameters())
    queue.run(0)
    queue.run(1)
    for p, ref in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, ref)


def test_vmap_and_overridden_forward_use_the_original() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(8, 4), Scaled(4, 4))
    queue = WeightGradQueue([model])
    assert queue.patched == [model[0]]
    xs = torch.randn(3, 5, 8)
    expected = torch.stack([model(x) for x in xs])
    torch.testing.assert_close(torch.func.vmap(model)(xs), expected)


def test_remove_restores_the_original_forwards() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Tied().emb, conv1d_mlp())
    modules = list(model.modules())
    queue = WeightGradQueue([model, model[0]])  # a module met twice is patched once
    assert len(queue.patched) == 4 + 1 + 2
    assert all("forward" in vars(m) for m in queue.patched)
    queue.remove()
    assert queue.patched == [] and all("forward" not in vars(m) for m in modules)
    block = model[0]
    with queue.deferring(0):
        loss_of(block(torch.randn(2, 6, 32))).backward()
    assert queue.pending(0) == 0 and block.qkv.weight.grad is not None


def test_a_deep_copy_of_a_served_layer_runs_its_own_weights_through_the_same_queue() -> None:
    """Replicas are deep copies of the reference's layers: a copy made while served must compute with its own
    weights (a forward bound to the original would train the original), and defer into the same queue."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    queue = WeightGradQueue([layer])
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(2.0)
    x = torch.randn(4, 3)
    torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias))
    with queue.deferring(0):
        twin(x).sum().backward()
    assert twin.weight.grad is None and layer.weight.grad is None and queue.pending(0) == 1
    queue.run(0)
    torch.testing.assert_close(twin.weight.grad, torch.ones(2, 4) @ x)
    assert layer.weight.grad is None
    queue.install([twin])  # already served: left as it is
    assert twin not in queue.patched
