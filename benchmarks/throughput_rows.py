"""The throughput benchmark's rows (``benchmarks/throughput.py``): the names, and each way of training one step on
one rank: this project's ``StagePipeline``, torch.distributed.pipelining's schedules, and the single process."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.common import lm_loss as _ce

WORLD = 2


ROWS = (
    "ours-1f1b",
    "ours-afab",
    "ours-zbh1",
    "ours-interleaved",
    "ours-zbv",
    "ours-zbv-placed",
    "torch-1f1b",
    "torch-gpipe",
    "torch-interleaved",
    "torch-interleaved-zb",
    "torch-zbv",
    "single",
)


LABELS = {
    "ours-1f1b": "lightning_avgpipe 1F1B (StagePipeline)",
    "ours-afab": "lightning_avgpipe AFAB (StagePipeline)",
    "ours-zbh1": "lightning_avgpipe ZB-H1 (StagePipeline, weight gradients deferred)",
    "ours-zbv": "lightning_avgpipe ZB-V (StagePipeline, 2 chunks per rank in a V, weight gradients deferred)",
    "ours-zbv-placed": "lightning_avgpipe ZB-V placed by the measured F, I, W (schedule_costs)",
    "torch-1f1b": "torch.distributed.pipelining Schedule1F1B",
    "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe",
    "ours-interleaved": "lightning_avgpipe interleaved 1F1B (StagePipeline, 2 chunks per rank in a loop)",
    "torch-interleaved": "torch.distributed.pipelining ScheduleInterleaved1F1B (2 stages per rank, loop)",
    "torch-interleaved-zb": "torch.distributed.pipelining ScheduleInterleavedZeroBubble (2 stages per rank, loop)",
    "torch-zbv": "torch.distributed.pipelining ScheduleZBVZeroBubble (2 stages per rank, V)",
    "single": "single process, grad accumulation",
}


AVG_PREFIX = "avgpipe-N"


# parts of an avgpipe step timed inside the row (per rank): the pipeline (zero_grad + StagePipeline.train_step over
# N*M units) and the optimizer step (the N replica optimizers and the elastic update; the update alone is probed)
AVG_PARTS = ("pipeline", "optimizer_step")


# the per-stage compute-only measurements behind the ideal step time: each stage alone (the other rank idles),
# and both stages at once (as in the pipeline, sharing the machine)
PROBES = tuple(f"probe-solo-{r}" for r in range(WORLD)) + ("probe-both",)


def row_names(args: argparse.Namespace) -> list[str]:
    return [*ROWS, *(f"{AVG_PREFIX}{n}" for n in args.pipelines)]


def pipelines_of(name: str) -> int:
    """N for an avgpipe-N row, 1 for every other row (one batch of B samples per step)."""
    return int(name[len(AVG_PREFIX) :]) if name.startswith(AVG_PREFIX) else 1


def _adamw(params: list[nn.Parameter], args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


class Row:
    """One way of training: ``step(i)`` runs optimizer step ``i`` (batch ``i``) on this rank."""

    def step(self, i: int) -> None:
        raise NotImplementedError

    def loss(self) -> float | None:
        """The last step's loss where this rank knows it (the last stage; rank 0 for ``single``)."""
        return None


def _pipeline(
    schedule: str,
    own: list[nn.Module],
    rank: int,
    args: argparse.Namespace,
    n: int = 1,
    chunks: Any = None,
    costs: tuple[float, float, float] | None = None,
) -> Any:
    """This rank's :class:`StagePipeline`, the step the strategy runs (D = 1, alpha = 1/N, synchronous reference)."""
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    cfg = PipelineConfig(
        num_stages=WORLD,
        num_microbatches=args.microbatches,
        schedule=schedule,
        num_pipelines=n,
        sync_reference=True,
        partition=list(args.partition) if chunks is None else "balanced",  # chunks: this rank's counts, passed below
        schedule_costs=costs,
    )
    return StagePipeline(own, Topology(rank, WORLD, WORLD), cfg, chunks=chunks)


def v_chunks(base: list[nn.Module], rank: int, placement: str = "v") -> tuple[list[nn.Module], list[int]]:
    """A cut of the model into 2 x WORLD stages placed ``placement`` (``"v"``: rank r runs stages r and 2 WORLD - 1 - r,
    ZB-V's; ``"loop"``: r and WORLD + r, interleaved 1F1B's), cut so that the ranks' parameter counts are as even as
    can be; returns this rank's layers (its stages' in order) and their counts. Ours and torch's chunked rows share
    it."""
    import itertools

    from lightning_avgpipe.schedules.chunks import rank_of, stages_of

    weights = [sum(p.numel() for p in layer.parameters()) for layer in base]
    best: tuple[float, float, list[int]] | None = None  # the ranks' largest total, then the stages' largest
    for cuts in itertools.combinations(range(1, len(base)), 2 * WORLD - 1):
        bounds = [0, *cuts, len(base)]
        per_stage = [float(sum(weights[bounds[j] : bounds[j + 1]])) for j in range(2 * WORLD)]
        per_rank = [0.0] * WORLD
        for j, w in enumerate(per_stage):
            per_rank[rank_of(j, WORLD, placement)] += w
        score = (max(per_rank), max(per_stage), [bounds[j + 1] - bounds[j] for j in range(2 * WORLD)])
        if best is None or score[:2] < best[:2]:
            best = score
    assert best is not None
    sizes = best[2]
    bounds = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
    mine = stages_of(rank, WORLD, 2, placement)
    return [layer for j in mine for layer in base[bounds[j] : bounds[j + 1]]], [sizes[j] for j in mine]


def measured_costs(
    own: list[nn.Module], sizes: list[int], rank: int, args: argparse.Namespace, batch: tuple[Tensor, Tensor]
) -> tuple[float, float, float]:
    """One unit's (F, I, W) in seconds, summed over the ranks: the medians of three traced ZB-V steps of a copy of
    ``own`` (after one untimed) on ``batch``, what the tuner's profile would give ``schedule_costs``."""
    row = PipeRow("zbv", 1, copy.deepcopy(own), rank, args, [batch], sizes)
    seen: dict[str, list[float]] = {kind: [] for kind in ("F", "I", "W")}
    for i in range(4):
        trace = row.pipe.train_step([batch], _lm_loss, measure=True).trace
        row.opt.zero_grad(set_to_none=True)
        for kind in seen if i else ():
            seen[kind].append(sum(s.end - s.start for s in trace.spans if s.kind == kind) / args.microbatches)
    mine = torch.tensor([statistics.median(seen[k]) for k in ("F", "I", "W")], dtype=torch.float64)
    dist.all_reduce(mine)
    f, i, w = (float(v) for v in mine)
    return f, i, w


def _lm_loss(out: Tensor, batch: tuple[Tensor, Tensor], share: float) -> Tensor:
    return _ce(out, batch[1])


class TorchRow(Row):
    def __init__(
        self,
        schedule: str,
        own: list[nn.Module],
        rank: int,
        args: argparse.Namespace,
        batches: list[tuple[Tensor, Tensor]],
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.batches, self.rank = batches, rank
        self.module = nn.Sequential(*own)
        self.opt = _adamw(list(self.module.parameters()), args)
        stage = PipelineStage(self.module, rank, WORLD, torch.device("cpu"))
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        # loss_fn averages over a micro-batch; scale_grads=True divides the summed gradients by M: the batch mean.
        self.schedule = cls(stage, n_microbatches=args.microbatches, loss_fn=_ce, scale_grads=True)
        self._losses: list[Tensor] = []

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(x, return_outputs=False)
        elif self.rank == WORLD - 1:
            self._losses = []
            self.schedule.step(target=y, losses=self._losses, return_outputs=False)
        else:  # pragma: no cover - WORLD == 2
            self.schedule.step(return_outputs=False)
        self.opt.step()

    def loss(self) -> float | None:
        return float(torch.stack([v.detach() for v in self._losses]).mean()) if self._losses else None


class TorchChunkRow(Row):
    """torch.distributed.pipelining's schedules with two stages per rank: ``ScheduleInterleaved1F1B`` and
    ``ScheduleInterleavedZeroBubble`` (loop placement), ``ScheduleZBVZeroBubble`` (V placement), over the same cut
    as our chunked rows (:func:`v_chunks`)."""

    def __init__(
        self,
        schedule: str,
        own: list[nn.Module],
        sizes: list[int],
        rank: int,
        args: argparse.Namespace,
        batches: list[tuple[Tensor, Tensor]],
    ) -> None:
        from torch.distributed import pipelining as pp

        from lightning_avgpipe.schedules.chunks import stages_of

        placement = "v" if schedule == "zbv" else "loop"
        cls = {
            "interleaved": pp.ScheduleInterleaved1F1B,
            "interleaved-zb": pp.ScheduleInterleavedZeroBubble,
            "zbv": pp.ScheduleZBVZeroBubble,
        }[schedule]
        self.batches, self.rank = batches, rank
        self.mine = stages_of(rank, WORLD, 2, placement)
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.modules = [nn.Sequential(*own[bounds[i] : bounds[i + 1]]) for i in range(len(sizes))]
        self.opt = _adamw([p for m in self.modules for p in m.parameters()], args)
        device = torch.device("cpu")
        stages = [pp.PipelineStage(m, j, 2 * WORLD, device) for m, j in zip(self.modules, self.mine)]
        self.schedule = cls(stages, n_microbatches=args.microbatches, loss_fn=_ce, scale_grads=True)
        self._losses: list[Tensor] = []

    def step(self, i: int) -> None:
        x, y = self.batches[i]
        self.opt.zero_grad(set_to_none=True)
        first, last = 0 in self.mine, 2 * WORLD - 1 in self.mine
        self._losses = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if last:
            kwargs.update(target=y, losses=self._losses)
        self.schedule.step(*([x] if first else []), **kwargs)
        self.opt.step()

    def loss(self) -> float | None:
        return float(torch.stack([v.detach() for v in self._losses]).mean()) if self._losses else None


class SingleRow(Row):
    """Plain training of the whole model with gradient accumulation; only rank 0 works."""

    def __init__(
        self, layers: list[nn.Module], rank: int, args: argparse.Namespace, batches: list[tuple[Tensor, Tensor]]
    ) -> None:
        self.active = rank == 0
        self.model = nn.Sequential(*layers)
        self.opt = _adamw(list(self.model.parameters()), args)
        self.batches, self.m = batches, args.microbatches
        self._loss: float | None = None

    def step(self, i: int) -> None:
        if not self.active:
            return
        x, y = self.batches[i]
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mx, my in zip(torch.tensor_split(x, self.m), torch.tensor_split(y, self.m), strict=True):
            loss = _ce(self.model(mx), my) * (len(my) / len(y))
            loss.backward()
            total += loss.detach()
        self.opt.step()
        self._loss = float(total)

    def loss(self) -> float | None:
        return self._loss


class PipeRow(Row):
    """This project's step: :meth:`StagePipeline.train_step` over N*M units, then the optimizer the pipeline wraps
    (the user's AdamW; with N > 1 one per replica and the elastic update), as the strategy runs them.

    Step ``i`` consumes batches ``i*N .. i*N + N-1`` (replica n takes batch ``i*N + n``, as ``GroupedBatches`` and
    ``reference_elastic`` do), so N = 1 sees exactly the other rows' batches. The ``ours-*`` rows are N = 1.
    """

    def __init__(
        self,
        schedule: str,
        n: int,
        own: list[nn.Module],
        rank: int,
        args: argparse.Namespace,
        batches: list[tuple[Tensor, Tensor]],
        chunks: Any = None,
        costs: tuple[float, float, float] | None = None,
    ) -> None:
        self.n, self.batches, self.rank = n, batches, rank
        self.pipe = _pipeline(schedule, own, rank, args, n, chunks, costs)
        self.opt = self.pipe.optimizer(_adamw(self.pipe.reference_params, args))
        self._loss: Tensor | None = None
        self.parts: dict[str, list[float]] = {part: [] for part in AVG_PARTS}

    def step(self, i: int) -> None:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        batches = [self.batches[i * self.n + r] for r in range(self.n)]
        self._loss = self.pipe.train_step(batches, _lm_loss).loss
        t1 = time.perf_counter()
        self.opt.step()
        self.parts["pipeline"].append(t1 - t0)
        self.parts["optimizer_step"].append(time.perf_counter() - t1)

    def loss(self) -> float | None:
        """The mean over replicas of each replica's batch loss (what the strategy logs)."""
        return float(self._loss) if self._loss is not None else None
