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
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_layers(
    layers: Sequence[nn.Module], sample: Any, repeats: int = 3, device: torch.device | None = None
) -> list[LayerCost]:
    """Time every layer's forward and backward on the activations that ``sample`` produces, layer by layer.

    Each layer is run ``repeats`` times after one warm-up run and the median is kept. Profiling leaves no
    trace: parameter gradients, buffers (BatchNorm statistics) and the random number generators are restored.
    """
    device = device or torch.device("cpu")
    grads = {p: (None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return [_time_layer(layer, x, repeats, device) for layer, x in _inputs(layers, sample)]
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def _inputs(layers: Sequence[nn.Module], sample: Any) -> Any:
    """Yield (layer, its input), running each layer once more on a detached input to get the next one."""
    x = sample
    for layer in layers:
        yield layer, x
        x = _detach(layer(_detach(x)))


def _time_layer(layer: nn.Module, x: Any, repeats: int, device: torch.device) -> LayerCost:
    fwd_times, bwd_times = [], []
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
        if r > 0:  # the first run is a warm-up
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
    return LayerCost(_median(fwd_times), _median(bwd_times), param_bytes(layer))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
