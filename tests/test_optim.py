"""The optimizer Lightning sees with N replicas: clones per replica, schedulers reach them all, state round-trips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_avgpipe.algorithms.elastic import ElasticAveraging
from lightning_avgpipe.algorithms.optim import ElasticOptimizer, clone_optimizer


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


def test_groups_empty_on_this_stage_do_not_shift_the_hyperparameters() -> None:
    """Per-layer learning rates: the first group's layer lives on another stage, so its group is empty here; the
    clones' groups must still get the lr of the user's group they came from."""
    torch.manual_seed(0)
    here = [nn.Linear(3, 4), nn.Linear(4, 2)]
    elsewhere = nn.Linear(2, 2)  # on another stage: not among this stage's (reference) parameters
    elastic = ElasticAveraging(here, num_replicas=2)
    user = torch.optim.SGD(
        [
            {"params": list(elsewhere.parameters()), "lr": 1e-4},
            {"params": list(here[0].parameters()), "lr": 0.1},
            {"params": list(here[1].parameters()), "lr": 1.0},
        ],
        lr=0.5,
    )
    clones = [clone_optimizer(user, elastic.replica_params(i), elastic.reference_params) for i in range(2)]
    opt = ElasticOptimizer(user, clones, elastic)
    for p in elastic.all_replica_params():
        p.grad = torch.ones_like(p)
    opt.step()
    for clone in opt.replicas:
        assert [g["lr"] for g in clone.param_groups] == [0.1, 1.0]
    user.param_groups[2]["lr"] = 2.0  # a scheduler changing the head's group reaches the head only
    opt.step()
    assert all([g["lr"] for g in clone.param_groups] == [0.1, 2.0] for clone in opt.replicas)


def test_add_param_group_reaches_every_replica() -> None:
    """BaseFinetuning unfreezes a layer by adding its parameters as a new group: every replica's clone gets it."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.Linear(4, 2)]
    for p in layers[0].parameters():
        p.requires_grad_(False)
    elastic = ElasticAveraging(layers, num_replicas=2)
    user = torch.optim.SGD([p for p in layers[1].parameters()], lr=0.1)
    clones = [clone_optimizer(user, elastic.replica_params(i), elastic.reference_params) for i in range(2)]
    opt = ElasticOptimizer(user, clones, elastic)
    for p in layers[0].parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(layers[0].parameters()), "lr": 0.01})
    elastic.follow_reference()
    assert len(user.param_groups) == 2
    for n, clone in enumerate(opt.replicas):
        assert [g["lr"] for g in clone.param_groups] == [0.1, 0.01]
        assert clone.param_groups[1]["params"] == elastic.replica_params(n)[:2]
        assert all(p.requires_grad for p in elastic.replica_params(n))
    before = [p.detach().clone() for p in elastic.replica_params(0)[:2]]
    for p in elastic.all_replica_params():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(not torch.equal(a, p.detach()) for a, p in zip(before, elastic.replica_params(0)[:2]))  # it trains
