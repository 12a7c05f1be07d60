"""ZeRO-1's flat slices are views of the weights (runtime/sharding/zero.py): the step writes the weights in place,
the slices are shared in place, and a gradient nothing reads after the step is freed once its slice is taken."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.helpers.harness import run_distributed


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 42 + 24 = 66 elements: slices of 33


def _grads(step: int, params: list[nn.Parameter]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_avgpipe.runtime.sharding import zero

    out: dict[str, Any] = {}
    for gather in ("broadcasts", "all-gather"):
        zero.IN_PLACE_ALL_GATHER = {"nccl"} if gather == "broadcasts" else {"nccl", "gloo"}
        plain_model, model = _layers(), _layers()
        plain = torch.optim.Adam(plain_model.parameters(), lr=0.1)
        params = list(model.parameters())
        opt = zero.ShardedOptimizer(torch.optim.Adam(params, lr=0.1), params, dist.group.WORLD, [0, 1], rank)
        (bucket,) = opt.buckets
        assert bucket.flat is not None
        storages = {p.untyped_storage().data_ptr() for p in params}
        out[f"{gather}: one storage"] = storages == {bucket.flat.untyped_storage().data_ptr()}
        out[f"{gather}: slice is a view"] = (
            bucket.param.data_ptr() == bucket.flat.data_ptr() + rank * bucket.slice * bucket.flat.element_size()
        )
        freed = []
        for step in range(4):
            if step == 2:  # a load that gives a weight new storage (`.data =`): taken back into the flat buffer
                for m in (plain_model, model):
                    m[0].bias.data = torch.full_like(m[0].bias, 0.5)
            for ps, grads in ((list(plain_model.parameters()), _grads(step, params)), (params, _grads(step, params))):
                for p, g in zip(ps, grads):
                    p.grad = g
            opt.unread_after_step = {id(p) for p in params} if step % 2 else ()
            plain.step()
            opt.step()
            freed.append([p.grad is None for p in params])
            for a, b in zip(plain_model.parameters(), params):
                if not torch.equal(a.detach(), b.detach()):
                    out[f"{gather}: step {step} differs"] = (a - b).abs().max().item()
        out[f"{gather}: freed"] = freed
        out[f"{gather}: bound at the end"] = bucket.bound()
        out[f"{gather}: state"] = {k: v.numel() for k, v in opt.inner.state[bucket.param].items() if v.dim()}
    return out


def test_flat_slices_are_views_shared_in_place_and_free_unread_gradients() -> None:
    """Two ranks: the weights are views of one flat buffer and each rank's optimizer parameter a view of its slice;
    four Adam steps give plain Adam's weights bit for bit, shared by broadcasts (gloo) or by the in-place all-gather
    (NCCL's way, run on gloo here), also after a weight was given new storage; the gradients are freed at the steps
    that say nothing reads them after, and kept at the others."""
    results = run_distributed(_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        for gather in ("broadcasts", "all-gather"):
            assert out[f"{gather}: one storage"] and out[f"{gather}: slice is a view"], (rank, out)
            assert not [k for k in out if "differs" in k], (rank, out)
            assert out[f"{gather}: freed"] == [[False] * 4, [True] * 4, [False] * 4, [True] * 4]
            assert out[f"{gather}: bound at the end"]
            assert out[f"{gather}: state"] == {"exp_avg": 33, "exp_avg_sq": 33}
