"""Batched replica execution (torch.func.vmap over stacked weights) equals running each replica on its own."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_avgpipe.algorithms.replicas import BatchedReplicas, select, stack
from tests.helpers.models import make_layers


def test_batched_forward_and_gradients_equal_sequential() -> None:
    base = make_layers()  # includes a tuple boundary with an integer tensor
    replicas = [[copy.deepcopy(m) for m in base] for _ in range(3)]
    with torch.no_grad():
        for n, layers in enumerate(replicas):
            for p in (p for m in layers for p in m.parameters()):
                p.add_(0.01 * n)  # distinct replicas
    xs = [torch.randn(5, 8, generator=torch.Generator().manual_seed(n)) for n in range(3)]
    expected_out, expected_grads = [], []
    for layers, x in zip(replicas, xs):
        out = nn.Sequential(*layers)(x)
        out.square().sum().backward()
        expected_out.append(out.detach())
        expected_grads.append([p.grad.clone() for m in layers for p in m.parameters()])
        for p in (p for m in layers for p in m.parameters()):
            p.grad = None
    batched = BatchedReplicas(replicas)
    batched.begin()
    out = batched(stack(xs))
    out.square().sum().backward()
    batched.finish()
    for n in range(3):
        torch.testing.assert_close(select(out, n).detach(), expected_out[n])
        grads = [p.grad for m in replicas[n] for p in m.parameters()]
        for got, want in zip(grads, expected_grads[n]):
            torch.testing.assert_close(got, want)
    assert batched.stacked == {}


def test_layers_with_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="replica_execution='batched' needs layers without buffers"):
        BatchedReplicas([[nn.BatchNorm1d(4)], [nn.BatchNorm1d(4)]])
