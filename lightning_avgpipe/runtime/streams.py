"""Random draws inside the pipelined layers that do not depend on the layout (docs/strategy.md#random-draws).

One process training the model draws its dropout masks from one generator, layer after layer, micro-batch after
micro-batch; a pipeline draws from one generator per process, in the order its schedule runs, so the masks would
change with the number of stages, the schedule or the chunks per rank. Here each layer's forward on a micro-batch
seeds the generator of its device from ``(seed, step, batch index, unit, layer)`` (the layer's index in the unsplit
model) and puts the generator back after it: the same masks for every S, v, T and schedule under the same seed, and
the same in a recomputation (activation checkpointing, which replays the layer with the seed it was given). Pure
PyTorch: no Lightning import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

_UNIT: ContextVar[int | None] = ContextVar("avgpipe_unit", default=None)
_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed from ``values`` (splitmix64 over each in turn): nearby keys give unrelated streams."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 31
    return h >> 1


class RandomStreams:
    """Where each layer's draws come from: ``seed`` (the run's, the same on every rank), ``offsets[j]`` the index in
    the unsplit model of stage ``j``'s first layer, and ``step`` the training step running (set before each one:
    ``(optimizer step, batch index)``)."""

    def __init__(self, seed: int, offsets: Sequence[int]) -> None:
        self.seed = int(seed)
        self.offsets = list(offsets)
        self.step: tuple[int, int] | None = None

    def seed_of(self, stage: int, index: int) -> int | None:
        """The seed of the ``index``-th layer of ``stage`` on the unit being run forward, or ``None`` outside a
        training step's forward (evaluation draws from the process's generator)."""
        unit = _UNIT.get()
        if unit is None or self.step is None:
            return None
        return _mix(self.seed, *self.step, unit, self.offsets[stage] + index)


@contextlib.contextmanager
def unit(u: int) -> Iterator[None]:
    """Around a training forward of unit ``u`` (replica-major (replica, micro-batch) index)."""
    token = _UNIT.set(u)
    try:
        yield
    finally:
        _UNIT.reset(token)


def save(device: torch.device) -> tuple[Tensor, Tensor | None, torch.device]:
    """The CPU generator's state and ``device``'s (CUDA), to :func:`restore` later."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None, device


def restore(state: tuple[Tensor, Tensor | None, torch.device]) -> None:
    cpu, accel, device = state
    torch.set_rng_state(cpu)
    if accel is not None:
        torch.cuda.set_rng_state(accel, device)


def reseed(seed: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s with ``seed``."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU generator and ``device``'s seeded with ``seed``; both put back afterwards."""
    state = save(device)
    reseed(seed, device)
    try:
        yield
    finally:
        restore(state)


def device_of(x: Any) -> torch.device:
    """The device of the first tensor in a layer's input (the CPU when there is none)."""
    for t in x if isinstance(x, (tuple, list)) else (x,):
        if isinstance(t, Tensor):
            return t.device
    return torch.device("cpu")
