"""A busy machine, for the tuner's profile: how much of a core the profiling processes get, what to tell the user, and
whether to time the stages by CPU time, which other processes' load does not stretch (docs/tuning.md)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lightning_avgpipe.runtime.trace import COMPUTE
from lightning_avgpipe.tuning.profiler import BUSY_BELOW, cpu_share, took

BUSY_ROUNDS = 2  # on a busy machine the profile runs this many times its rounds


def busy_machine(share: float, clock: str = "wall", rounds: int = 0, steps: int = 0) -> str:
    """What to tell the user when the profile's processes got less than ``BUSY_BELOW`` of a core ("" otherwise);
    ``rounds`` the profile ran of the ``steps`` asked (more: the first probe found the machine busy)."""
    if share >= BUSY_BELOW:
        return ""
    said = f"AvgPipeTuner: this machine is busy: a profiling process got {share:.0%} of a core (other processes "
    said += "compete for the CPUs)"
    if rounds > steps:
        said += f"; the profile ran {rounds} rounds instead of {steps} (each timing is noisier)"
    if clock == "cpu":
        return said + (
            ". The stages were timed by their CPU time, which the load does not stretch, so the "
            "predictions are a quiet machine's; training on this busy machine will run slower than predicted."
        )
    return said + (
        ", and the predicted times are a busy machine's: slower and less steady than a quiet "
        "one's. Tune again on a quiet machine for figures to plan with."
    )


def charged(span: Any) -> bool:
    """Whether a span's time is charged to a unit's compute (``unit_times``): compute, and the sends after it."""
    return span.kind in (*COMPUTE, "send")


def cpu_clock(device: torch.device, share: float, work: float, group: Any) -> bool:
    """Whether the profile times by the stage thread's CPU time: on a busy machine (``share`` below ``BUSY_BELOW``), on
    CPU devices where torch computes on one thread per process on every rank (the stage's own: its CPU time is the
    compute's, and the load does not stretch it), and where the compute is that thread's CPU work: its CPU time over its
    wall time (``work``) at least
    half the share of a core it got (a layer that waits, for I/O or another device, takes wall time only).
    Elsewhere (a GPU's kernels, several threads) wall time, busy or not."""
    alone = device.type == "cpu" and torch.get_num_threads() == 1 and work >= share / 2
    flag = torch.tensor([0.0 if alone else 1.0], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # every rank of the pipeline alike
    return share < BUSY_BELOW and float(flag[0]) == 0.0


def rounds(
    turns: list[Any], steps: int, shares: list[float], group: Any, busy_steps: int = 0, device: Any = "cpu"
) -> Iterator[Any]:
    """``turns``, ``steps`` times over; before each round, the share of a core this process gets (into ``shares``),
    every rank of ``group`` probing at once, none stepping meanwhile (a step beside a probe would be timed busy).

    ``busy_steps``: how many rounds to run instead when the first probe finds the machine busy (the least share over
    every rank of the job below ``BUSY_BELOW``). Load makes each timing noisier; more rounds give the medians back
    their steadiness. Every rank of the job decides alike, not only ``group``'s: a tensor-parallel shard or another
    pipeline group running a different number of rounds would wait in a collective its peer never calls."""
    total, i = steps, 0
    while i < total:
        shares.append(probe_together(group))
        if i == 0 and busy_steps > steps and least_share(shares[0], None, device) < BUSY_BELOW:
            total = busy_steps
        yield from turns
        i += 1


def least_share(share: float, group: Any, device: Any = "cpu") -> float:
    """The least of ``share`` over the ranks of ``group`` (``None``: every rank; ``share`` itself without a process
    group)."""
    if not dist.is_initialized():
        return share
    t = torch.tensor([share], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return float(t[0])


def probe_together(group: Any) -> float:
    """:func:`cpu_share` on every rank of ``group`` at once, between two barriers."""
    if dist.is_initialized():
        dist.barrier(group=group)
    share = cpu_share()
    if dist.is_initialized():
        dist.barrier(group=group)
    return share


def timing_noise(per_size: list[list[Any]], cpu: bool = False) -> float:
    """How far a profile's timings can be trusted: for each micro-batch size (its timed steps' spans, one list per
    step), the relative standard error of a step's compute (the charged spans, by wall or CPU time) over the steps;
    the median over the sizes (0 where no size has two steps). Two predictions closer than about twice this are one
    measurement's noise apart."""
    errors = []
    for steps in per_size:
        totals = [sum(took(s, cpu) for s in step if charged(s)) for step in steps]
        if len(totals) >= 2 and statistics.fmean(totals) > 0:
            errors.append(statistics.stdev(totals) / statistics.fmean(totals) / len(totals) ** 0.5)
    return statistics.median(errors) if errors else 0.0
