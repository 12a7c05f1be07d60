"""The optimizer Lightning sees with N replicas: clones per replica, schedulers reach them all, state round-trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_avgpipe.elastic import ElasticAveraging
from lightning_avgpipe.plugin.optim import ElasticOptimizer, clone_optimizer


def _setup(n: int = 2) -> tuple[ElasticAveraging, ElasticOptimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.Linear(4, 2)]
    elastic = ElasticAveraging(layers, num_replicas=n)
    user = torch.optim.AdamW([p for m in layers for p in m.parameters()], lr=0.1, weight_decay=0.05)
    clones = [clone_optimizer(user, elastic.replica_params(i), elastic.reference_params) for i in range(n)]
    return elastic, ElasticOptimizer(user, clones, elastic), user


def test_clones_keep_class_hyperparameters_and_own_parameters() -> None:
    elastic, opt, user = _setup()
    for i, clone in enumerate(opt.replicas):
        assert type(clone) is torch.optim.AdamW
        assert clone.param_groups[0]["weight_decay"] == 0.05
        assert clone.param_groups[0]["params"] == elastic.replica_params(i)


def test_lr_scheduler_on_the_user_optimizer_reaches_every_replica() -> None:
    elastic, opt, user = _setup()
    sched = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.5)
    for p in elastic.all_replica_params():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    opt.step()
    assert all(clone.param_groups[0]["lr"] == pytest.approx(0.05) for clone in opt.replicas)


def test_state_dict_round_trip_and_zero_grad() -> None:
    elastic, opt, _ = _setup()
    for p in elastic.all_replica_params():
        p.grad = torch.ones_like(p)
    opt.step()
    state = opt.state_dict()
    assert len(state["replicas"]) == 2 and all(s["state"] for s in state["replicas"])
    _, other, _ = _setup()
    other.load_state_dict(state)
    for a, b in zip(opt.replicas, other.replicas):
        for (ka, va), (kb, vb) in zip(a.state_dict()["state"].items(), b.state_dict()["state"].items()):
            assert ka == kb and torch.equal(va["exp_avg"], vb["exp_avg"])
    opt.zero_grad()
    assert all(p.grad is None for p in elastic.all_replica_params())


def test_an_optimizer_that_cannot_be_cloned_says_how_to_fix_it() -> None:
    class Odd(torch.optim.SGD):
        def __init__(self, params: object, secret: int) -> None:  # a required argument not in defaults
            super().__init__(params, lr=0.1)

    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="one copy of your Odd per parallel pipeline"):
        clone_optimizer(Odd(layer.parameters(), 1), list(layer.parameters()), list(layer.parameters()))
