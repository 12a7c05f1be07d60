"""Measuring layers: per-layer forward+backward time on a sample input, and per-layer parameter bytes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs: the median forward and backward time (seconds) and its parameter bytes."""

    forward: float
    backward: float
    param_bytes: int

    @property
    def compute(self) -> float:
        return self.forward + self.backward


def param_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _detach(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        out = obj.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(o) for o in obj)
    return obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(
    layers: Sequence[nn.Module], sample: Any, repeats: int = 3, device: torch.device | None = None
) -> list[LayerCost]:
    """Time every layer's forward and backward on the activations that ``sample`` produces, layer by layer.

    Each layer is run ``repeats`` times after one warm-up run and the median is kept. Gradients the profile
    accumulates into parameters are restored to what they were before, so profiling leaves no trace.
    """
    device = device or torch.device("cpu")
    saved = {p: (None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    costs: list[LayerCost] = []
    x = sample
    try:
        for layer in layers:
            fwd_times, bwd_times = [], []
            out: Any = None
            for r in range(repeats + 1):
                inp = _detach(x)
                _sync(device)
                t0 = time.perf_counter()
                out = layer(inp)
                _sync(device)
                t1 = time.perf_counter()
                outs = [t for t in _tensors(out) if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                _sync(device)
                t2 = time.perf_counter()
                if r > 0:
                    fwd_times.append(t1 - t0)
                    bwd_times.append(t2 - t1)
            costs.append(LayerCost(_median(fwd_times), _median(bwd_times), param_bytes(layer)))
            x = _detach(out)
    finally:
        for p, g in saved.items():
            p.grad = g
    return costs


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
