"""What fills a stage's memory (Lightning-free): the breakdown of the first training step.

:func:`stage_breakdown` counts a stage's tensors by storage (each counted once, a tensor-parallel shard by its local
part): the weights (every replica's and the reference's), their gradients, the optimizer states, the averaging's
buffers; the caller adds what the step measured (the activations autograd saved at their peak, the receive buffers
in flight at theirs) and the process's peak (:func:`process_peak_bytes`). What is left of the peak is the rest: the
interpreter, the libraries, the allocators' free memory and any temporaries (an optimizer's, for one).

On CPU the rest also holds what glibc keeps of freed tensors: once a free has raised its mmap threshold (to 32 MiB
at most), a freed gradient or optimizer temporary stays in the heap, and the heap grows over the first steps as small
allocations split its holes (plain training does the same). ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment
fixes the threshold: every large tensor is then mapped and unmapped, the peak stays at what the tensors hold, and
each step pays the page faults of its fresh tensors.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.shards import local

MIB = float(1 << 20)


def process_peak_bytes(device: torch.device) -> int:
    """The process's peak: on CUDA the caching allocator's peak of ``device`` (since its last reset); on CPU the
    peak resident memory (``VmHWM``, what ``ru_maxrss`` reports), interpreter and libraries included."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB elsewhere


def storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (data pointers; updated), non-tensors and empty ones
    skipped; a tensor-parallel shard counts its local part."""
    total = 0
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        t = local(t)
        if t.numel() == 0 or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def optimizer_tensors(optimizers: Sequence[Any]) -> list[Any]:
    """Every value of the state of ``optimizers``: the replicas' clones of an elastic optimizer, a sharded
    optimizer's slices (its ``state``), a plain optimizer's own."""
    inner = [o for opt in optimizers for o in getattr(opt, "replicas", [opt])]
    return [v for opt in inner for st in opt.state.values() for v in st.values()]


@dataclass(frozen=True)
class MemoryBreakdown:
    """One stage's memory at its first training step, in bytes.

    Attributes:
        weights: the parameters (every replica's copy and the averaging's reference).
        gradients: their ``.grad``.
        optimizer_state: the optimizers' state tensors (Adam's moments: twice the weights).
        activations: what autograd saved for backward at its peak over the step's units in flight.
        communication: the point-to-point receive buffers in flight at their peak, and the averaging's buffers.
        peak: the process's peak (:func:`process_peak_bytes`).
    """

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    communication: int
    peak: int

    @property
    def rest(self) -> int:
        """The peak less the five counted parts (the interpreter, libraries, free heap and temporaries on CPU)."""
        return self.peak - self.weights - self.gradients - self.optimizer_state - self.activations - self.communication

    def scalars(self) -> dict[str, float]:
        """``memory/<part>_mib`` for each part, the rest and the peak: what the strategy logs."""
        parts = {**asdict(self), "rest": self.rest}
        return {f"memory/{name}_mib": value / MIB for name, value in parts.items()}

    def describe(self) -> str:
        """``weights 64.0 MiB, gradients ..., rest ... of a peak of ... MiB``."""
        named = [(k.replace("_", " "), v) for k, v in asdict(self).items() if k != "peak"] + [("rest", self.rest)]
        listed = ", ".join(f"{name} {value / MIB:.1f} MiB" for name, value in named)
        return f"{listed} (of a peak of {self.peak / MIB:.1f} MiB)"


def stage_breakdown(
    params: Sequence[Tensor],
    optimizers: Sequence[Any],
    buffers: Sequence[Tensor],
    *,
    activations: int,
    in_flight: int,
    peak: int,
) -> MemoryBreakdown:
    """The breakdown of one stage: ``params`` (every replica's and the reference's), ``optimizers`` (what is stepped),
    ``buffers`` (the averaging's own tensors); ``activations`` and ``in_flight`` (receive buffers) as the step
    measured them, and the process's ``peak``."""
    seen: set[int] = set()
    weights = storage_bytes(params, seen)
    gradients = storage_bytes((p.grad for p in params), seen)
    state = storage_bytes(optimizer_tensors(optimizers), seen)
    averaging = storage_bytes(buffers, seen)
    return MemoryBreakdown(weights, gradients, state, int(activations), averaging + int(in_flight), int(peak))
