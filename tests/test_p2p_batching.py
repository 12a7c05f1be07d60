"""Batched point-to-point (the NCCL mode) without a process group: what reaches batch_isend_irecv, and waits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_avgpipe.runtime.comms import p2p


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1


@pytest.fixture
def fake_dist(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """Record every batch_isend_irecv call; answer like NCCL: one request for the whole group."""
    calls: list[list[Any]] = []

    class Op:
        def __init__(self, fn: Any, tensor: torch.Tensor, peer: int, group: Any = None) -> None:
            self.fn, self.tensor, self.peer = fn, tensor, peer

    def batch(ops: list[Any]) -> list[_Work]:
        calls.append(ops)
        return [_Work()]

    monkeypatch.setattr(p2p.dist, "P2POp", Op)
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(p2p.dist, "isend", lambda *a, **k: pytest.fail("a single isend in batched mode"))
    monkeypatch.setattr(p2p.dist, "irecv", lambda *a, **k: pytest.fail("a single irecv in batched mode"))
    return calls


def test_one_request_for_a_group_completes_every_operation(fake_dist: list[list[Any]]) -> None:
    link = p2p.Link(None, 1, torch.device("cpu"))
    link.always_batch = True
    link.begin_batch()
    link.send_activations("k", (torch.ones(2), torch.zeros(3)))  # header + 2 tensors
    link.post_grads(0, [torch.ones(2)])
    link.flush_batch()
    assert len(fake_dist) == 1 and len(fake_dist[0]) == 4
    link.wait_grads(0)
    link.wait_sends()  # no AttributeError: every handle got the group's request


def test_operations_outside_a_batch_are_batched_alone(fake_dist: list[list[Any]]) -> None:
    link = p2p.Link(None, 1, torch.device("cpu"))
    link.always_batch = True
    link.send_activations("k", torch.ones(2))  # header and data: each its own single-op batch
    assert [len(c) for c in fake_dist] == [1, 1]
