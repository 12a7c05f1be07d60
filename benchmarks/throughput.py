"""Throughput of this project's pipeline runtime against torch.distributed.pipelining and plain training.

    PYTHONPATH=. python benchmarks/throughput.py                      # defaults: about 1.5 minutes on 2 idle CPU cores
    PYTHONPATH=. python benchmarks/throughput.py --steps 20 --pipelines 1,2 --json runs/throughput.json

One invocation spawns 2 gloo ranks (1 thread each) that train the same character GPT (``examples/char_gpt.py``)
from the same initial weights, on the same batches, split into the same micro-batches, with the same layer
partition and AdamW doing real optimizer steps, with:

- ``ours-1f1b``   this project's ``StageExecutor`` + ``Link`` running ``build_plan("1f1b", ...)``
- ``ours-afab``   the same runtime running ``build_plan("afab", ...)``
- ``ours-zbh1``   the same runtime running ``build_plan("zbh1", ...)``: the backward split, weight gradients deferred
- ``torch-1f1b``  ``torch.distributed.pipelining.Schedule1F1B`` over a hand-built ``PipelineStage`` per rank
- ``torch-gpipe`` ``torch.distributed.pipelining.ScheduleGPipe`` over the same stages
- ``torch-interleaved``, ``torch-interleaved-zb``, ``torch-zbv``: torch's ``ScheduleInterleaved1F1B``,
                  ``ScheduleInterleavedZeroBubble`` (loop) and ``ScheduleZBVZeroBubble`` (V), two stages per rank, over
                  the cut ``ours-interleaved`` and ``ours-zbv`` run
- ``ours-zbv-placed``: ``ours-zbv`` with its plan placed by the measured costs (``schedule_costs``: one unit's F, I
                  and W, summed over the ranks, from three traced steps of a copy before the timed rounds), as
                  ``AvgPipeTuner`` places it from its profile
- ``single``      the whole model in one process (rank 0, 1 thread) with gradient accumulation over the same
                  micro-batches; the other rank idles meanwhile
- ``avgpipe-N``   AvgPipe with N parallel pipelines (``--pipelines``, default 1,2,4): the same executor running
                  ``build_plan("1f1b", 2, N*M)`` over N*M units (replica-major: unit n*M + m is replica n's micro-batch
                  m, run through replica n's layers via ``stage_fn_for``), N replicas per stage tied by
                  ``ElasticAveraging`` (alpha = 1/N; N = 1 is the trivial case, the replica is the reference), one
                  AdamW per replica (``clone_optimizer``); each step consumes N batches of the same size B as the
                  other rows, then ``begin_step()``, the N optimizer steps, ``finish_step()``

Rows are interleaved: every round runs one training step of every row (in a rotating order), so a burst of
background load on a shared machine hits all rows alike (``single`` always runs last among the rows, before the
probes). The first ``--warmup`` rounds are not timed. A step is timed from a barrier to the end of
``optimizer.step()`` (for avgpipe rows: of ``finish_step()``) on each rank; the step time is the slowest rank's.
samples/s = samples per step (B, or N*B for avgpipe-N) / median step time.

Pipeline efficiency = ideal step time / measured step time, where the ideal is the slowest stage's compute alone:
each round also runs a *compute probe* per stage in which that rank alone (the other one idles) runs its own
stage's layers (a private copy, with its own AdamW) forward and backward over all micro-batches and then the
optimizer step, without any communication (stage inputs and output gradients are precomputed). The same probe with
both stages computing at once is reported too (it shows how much the two ranks slow each other down on this
machine). The ideal ignores the pipeline bubble, so even a perfect 1F1B with balanced stages is bounded by
M / (M + S - 1). The single-process row has no pipeline and its efficiency is reported as n/a (``null`` in JSON).
For avgpipe-N the ideal is N times the probe (N*M units' forward+backward and N optimizer steps) plus the elastic
update (``begin_step()`` + ``finish_step()`` on a private N-replica copy of the stage, timed in the same solo slot);
the 1F1B bubble bound becomes N*M / (N*M + S - 1).

Correctness is checked, not assumed: every row's first-step loss (same weights, same data) must match the
single-process loss within float tolerance, and ours-1f1b and torch-1f1b must agree on the first step; the final
losses and the largest weight difference between ours-1f1b and torch-1f1b after all steps are reported. Each
avgpipe-N row's loss (mean over its replicas) over the first ``--check-steps`` steps must match a single-process
AvgPipe (the whole model, N replicas, the same batches, clone optimizers and ``ElasticAveraging``, as in
``tests/helpers/lit.py::reference_elastic``) computed on rank 0 after the timed run; for N = 1 that is plain
training, so avgpipe-N1's first-step loss equals every other row's. Every loss must be finite. The script exits
with status 1 when a check fails (after printing the table).

Absolute times are noise on a shared machine; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.common import apply_layers as _apply  # noqa: E402
from benchmarks.common import lm_loss as _ce  # noqa: E402
from benchmarks.common import make_batches  # noqa: E402
from examples.gpt_args import add_model_args, add_partition_arg, check_model_args, model_sizes, partition_of  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------------------
# arguments and data
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (must divide the batch)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row before the timed ones")
    add_model_args(p, n_layer=4, n_embd=128, n_head=4, block_size=64)
    add_partition_arg(p)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-chars", type=int, default=200_000, help="characters of stdlib docstrings to sample from")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the first-step loss checks")
    p.add_argument("--timeout", type=float, default=900.0, help="kill the ranks after this many seconds")
    p.add_argument(
        "--pipelines",
        default="1,2,4",
        help="N values of the avgpipe-N rows (N parallel pipelines with elastic averaging), "
        "comma-separated; 'none' for no avgpipe rows",
    )
    p.add_argument(
        "--check-steps",
        type=int,
        default=3,
        help="steps of every avgpipe-N row compared with a single-process AvgPipe (at least 1)",
    )
    p.add_argument(
        "--fit-rounds",
        type=int,
        default=3,
        help="rounds of (the runtime row's steps, then a Trainer.fit of as many steps) compared pairwise; 0 to skip",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    text = str(args.pipelines).strip().lower()
    try:
        args.pipelines = [] if text in ("", "none") else sorted({int(v) for v in text.split(",")})
    except ValueError:
        p.error(f"--pipelines must be comma-separated ints, got {args.pipelines!r}")
    if any(n < 1 for n in args.pipelines):
        p.error(f"--pipelines values must be >= 1, got {args.pipelines}")
    if args.check_steps < 1:
        p.error("--check-steps must be >= 1")
    check_model_args(p, args)
    args.partition = partition_of(p, args)
    if args.batch_size % args.microbatches:
        p.error(
            f"--microbatches={args.microbatches} must divide --batch-size={args.batch_size} (torch's schedules "
            "and ours would otherwise weight uneven micro-batches differently)"
        )
    if args.microbatches < WORLD:
        p.error(f"--microbatches must be >= {WORLD} (torch's Schedule1F1B needs at least one per stage)")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def row_names(args: argparse.Namespace) -> list[str]:
    return [*ROWS, *(f"{AVG_PREFIX}{n}" for n in args.pipelines)]


def pipelines_of(name: str) -> int:
    """N for an avgpipe-N row, 1 for every other row (one batch of B samples per step)."""
    return int(name[len(AVG_PREFIX) :]) if name.startswith(AVG_PREFIX) else 1


# ---------------------------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------------------------


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
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.topology import Topology

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


def elastic_reference(
    base: list[nn.Module], n: int, steps: int, args: argparse.Namespace, batches: list[tuple[Tensor, Tensor]]
) -> list[float]:
    """AvgPipe in one process (as ``tests/helpers/lit.py::reference_elastic``): the per-step mean-over-replicas loss.

    The whole model, N replicas each on its own consecutive batch with gradient accumulation over the same
    micro-batches, one AdamW clone per replica, then the elastic update.
    """
    from lightning_avgpipe import microbatch
    from lightning_avgpipe.elastic import ElasticAveraging
    from lightning_avgpipe.optim import clone_optimizer

    elastic = ElasticAveraging(copy.deepcopy(base), n)
    user = _adamw(elastic.reference_params, args)
    opts = [clone_optimizer(user, elastic.replica_params(r), elastic.reference_params) for r in range(n)]
    losses = []
    for i in range(steps):
        total = torch.zeros(())
        for r in range(n):
            x, y = batches[i * n + r]
            opts[r].zero_grad(set_to_none=True)
            for mx, my in microbatch.split((x, y), args.microbatches):
                loss = _ce(_apply(elastic.replicas[r], mx), my) * (len(my) / len(y))
                loss.backward()
                total += loss.detach()
        elastic.begin_step()
        for opt in opts:
            opt.step()
        elastic.finish_step()
        losses.append(float(total) / n)
    return losses


class ElasticProbe:
    """The elastic update alone: ``begin_step()`` + ``finish_step()`` on a private N-replica copy of this stage."""

    def __init__(self, layers: list[nn.Module], n: int) -> None:
        from lightning_avgpipe.elastic import ElasticAveraging

        self.elastic = ElasticAveraging(copy.deepcopy(layers), n)

    def run(self) -> float:
        t0 = time.perf_counter()
        self.elastic.begin_step()
        self.elastic.finish_step()
        return time.perf_counter() - t0


class Probe:
    """This rank's stage compute alone: forward+backward of all micro-batches, then AdamW, no communication."""

    def __init__(
        self,
        layers: list[nn.Module],
        start: int,
        count: int,
        rank: int,
        args: argparse.Namespace,
        batch: tuple[Tensor, Tensor],
    ) -> None:
        self.own = copy.deepcopy(layers[start : start + count])
        self.opt = _adamw([p for layer in self.own for p in layer.parameters()], args)
        self.is_first, self.is_last = rank == 0, rank == WORLD - 1
        x, y = batch
        self.targets = list(torch.tensor_split(y, args.microbatches))
        self.scale = 1.0 / args.microbatches
        with torch.no_grad():  # the stage's real inputs, computed by the upstream layers of the (untrained) model
            self.inputs = [_apply(layers[:start], mx) for mx in torch.tensor_split(x, args.microbatches)]
            outs = [_apply(self.own, inp) for inp in self.inputs]
        g = torch.Generator().manual_seed(args.seed + 7)
        self.out_grads = [torch.randn(o.shape, generator=g) * 1e-3 for o in outs]

    def run(self) -> tuple[float, float]:
        """Seconds of forward+backward over all micro-batches, and of the optimizer step."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        for u, inp in enumerate(self.inputs):
            if not self.is_first:
                inp = inp.detach().requires_grad_(True)  # the pipeline computes the input gradient to send back
            out = _apply(self.own, inp)
            if self.is_last:
                (_ce(out, self.targets[u]) * self.scale).backward()
            else:
                out.backward(self.out_grads[u])
        t1 = time.perf_counter()
        self.opt.step()
        return t1 - t0, time.perf_counter() - t1


def _fit_module(layers: list[nn.Module], args: argparse.Namespace) -> Any:
    """The same model as a user's LightningModule (the pipeline contract, a logged loss, AdamW)."""
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: Tensor) -> Tensor:
            return self.layers(x)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = _ce(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _adamw(list(self.parameters()), args)

    return Net()


def fit_round(
    base: list[nn.Module],
    rank: int,
    args: argparse.Namespace,
    batches: list[tuple[Tensor, Tensor]],
    logdir: Path,
    row: Row,
) -> tuple[list[float], list[float]]:
    """One ``Trainer.fit`` under ``strategy="avgpipe"`` (1F1B, the rows' partition, a CSV logger every 50 steps), with
    one step of the runtime ``row`` run between every two of its iterations (from ``on_train_batch_start``).

    Returns, per iteration after the warm-up, the seconds of Lightning's whole iteration (hooks, the step, the
    optimizer, logging, fetching the next batch) and of the runtime step before it, each from a barrier to a barrier:
    the pair ran at the same moment, so load on a shared machine hits both alike.
    """
    import lightning.pytorch as pl

    from lightning_avgpipe import AvgPipeStrategy

    fit_starts: list[float] = []  # after the runtime step: Lightning's iteration begins
    fit_ends: list[float] = []  # at the next training-batch start: the iteration (and the next batch's fetch) is over
    runtime: list[float] = []

    class Interleave(pl.Callback):
        """At every training-batch start: a barrier (the previous iteration is over on both ranks), one runtime step,
        a barrier (it is over on both ranks). Each segment then costs what its slowest rank took."""

        def on_train_batch_start(self, *_: Any) -> None:
            dist.barrier()
            t0 = time.perf_counter()
            fit_ends.append(t0)
            row.step(len(runtime))
            dist.barrier()
            t1 = time.perf_counter()
            runtime.append(t1 - t0)
            fit_starts.append(t1)

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))  # ranks made by this benchmark
    total = args.warmup + args.steps + 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        max_steps=total,
        logger=pl.loggers.CSVLogger(logdir),
        log_every_n_steps=50,
        strategy=AvgPipeStrategy(num_microbatches=args.microbatches, partition=list(args.partition), schedule="1f1b"),
        callbacks=[Interleave()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(batches[:total], batch_size=None)
    trainer.fit(_fit_module(copy.deepcopy(base), args), loader)
    w = args.warmup
    fit = [end - start for start, end in zip(fit_starts[w:], fit_ends[w + 1 :])]
    return fit, runtime[w : w + len(fit)]


def rank_main(rank: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    from examples.char_gpt import GPTConfig, gpt_layers

    cfg = GPTConfig(vocab_size=vocab_size, **model_sizes(args), dropout=0.0)
    torch.manual_seed(args.seed)
    base = list(gpt_layers(cfg))  # identical on every rank: same seed, same construction order
    total = args.warmup + args.steps
    # batch i is the other rows' step i; avgpipe-N's step i takes batches i*N .. i*N + N-1 (the same first `total`)
    batches = make_batches(
        data, args.block_size, args.batch_size, (total + 1) * max([1, *args.pipelines]), args.seed + 1
    )
    start, count = sum(args.partition[:rank]), args.partition[rank]

    def own_copy() -> list[nn.Module]:
        return copy.deepcopy(base)[start : start + count]

    def chunked(placement: str) -> tuple[list[nn.Module], list[int]]:
        return v_chunks(copy.deepcopy(base), rank, placement)

    v_own, v_sizes = chunked("v")
    loop_own, loop_sizes = chunked("loop")
    costs = measured_costs(v_own, v_sizes, rank, args, batches[0])
    rows: dict[str, Row] = {
        "ours-1f1b": PipeRow("1f1b", 1, own_copy(), rank, args, batches),
        "ours-afab": PipeRow("afab", 1, own_copy(), rank, args, batches),
        "ours-zbh1": PipeRow("zbh1", 1, own_copy(), rank, args, batches),
        "ours-zbv": PipeRow("zbv", 1, v_own, rank, args, batches, v_sizes),
        "ours-zbv-placed": PipeRow("zbv", 1, chunked("v")[0], rank, args, batches, v_sizes, costs),
        "ours-interleaved": PipeRow("interleaved", 1, loop_own, rank, args, batches, loop_sizes),
        "torch-1f1b": TorchRow("1f1b", own_copy(), rank, args, batches),
        "torch-gpipe": TorchRow("gpipe", own_copy(), rank, args, batches),
        "torch-interleaved": TorchChunkRow("interleaved", *chunked("loop"), rank, args, batches),
        "torch-interleaved-zb": TorchChunkRow("interleaved-zb", *chunked("loop"), rank, args, batches),
        "torch-zbv": TorchChunkRow("zbv", *chunked("v"), rank, args, batches),
        "single": SingleRow(copy.deepcopy(base), rank, args, batches),
    }
    for n in args.pipelines:
        rows[f"{AVG_PREFIX}{n}"] = PipeRow("1f1b", n, own_copy(), rank, args, batches)
    probe = Probe(base, start, count, rank, args, batches[0])
    elastic_probes = {n: ElasticProbe(base[start : start + count], n) for n in args.pipelines if n > 1}

    all_rows = row_names(args)
    times: dict[str, list[float]] = {name: [] for name in all_rows}
    probe_times: dict[str, list[tuple[float, float]]] = {"solo": [], "both": []}
    elastic_times: dict[int, list[float]] = {n: [] for n in elastic_probes}
    losses: dict[str, list[float | None]] = {name: [] for name in all_rows}
    # `single` runs last among the rows, followed by the probes: the original rows keep the neighbours they had before
    # the avgpipe rows existed, and no pipeline row starts right after one rank idled through a single-process step
    names = [*(name for name in all_rows if name != "single"), "single", *PROBES]
    for i in range(total):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:  # rotate so no row always runs right after the same one
            dist.barrier()
            t0 = time.perf_counter()
            if name == "probe-both":
                probe_times["both"].append(probe.run())
                continue
            if name.startswith("probe-solo-"):
                if name == f"probe-solo-{rank}":
                    probe_times["solo"].append(probe.run())
                    for n, ep in elastic_probes.items():
                        elastic_times[n].append(ep.run())
                continue
            rows[name].step(i)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(rows[name].loss())
    dist.barrier()
    # Trainer.fit against the runtime it calls, paired step by step: one runtime step between two fit iterations
    fit_times: list[list[float]] = []
    runtime_times: list[list[float]] = []
    if args.fit_rounds:
        import tempfile

        with tempfile.TemporaryDirectory() as logdir:
            for _ in range(args.fit_rounds):
                dist.barrier()
                row = PipeRow("1f1b", 1, own_copy(), rank, args, batches)
                fit_s, runtime_s = fit_round(base, rank, args, batches, Path(logdir), row)
                fit_times.append(fit_s)
                runtime_times.append(runtime_s)
    dist.barrier()

    # ours-1f1b vs torch-1f1b: the same stage, trained by two runtimes from the same weights on the same data
    ours = rows["ours-1f1b"].pipe.reference_params  # type: ignore[attr-defined]
    theirs = list(rows["torch-1f1b"].module.parameters())  # type: ignore[attr-defined]
    with torch.no_grad():
        diff = max((float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)), default=0.0)
    # single-process AvgPipe over the first steps, for the avgpipe rows' loss check (rank 0; the other rank waits)
    check_steps = min(args.check_steps, total)
    reference = {n: elastic_reference(base, n, check_steps, args, batches) for n in args.pipelines} if rank == 0 else {}
    parts = {name: row.parts for name, row in rows.items() if name.startswith(AVG_PREFIX)}  # type: ignore[attr-defined]
    dist.barrier()
    return {
        "rank": rank,
        "times": times,
        "probe": probe_times,
        "losses": losses,
        "param_diff": diff,
        "elastic_probe": elastic_times,
        "avgpipe_parts": parts,
        "elastic_reference": reference,
        "fit_rounds": fit_times,
        "runtime_rounds": runtime_times,
    }


def _rank(rank: int, world: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    return rank_main(rank, args, data, vocab_size)


def launch(args: argparse.Namespace, data: Tensor, vocab_size: int) -> list[dict[str, Any]]:
    """``rank_main`` on WORLD gloo ranks, 1 thread each; every rank is killed after ``--timeout`` seconds."""
    return run_distributed(_rank, WORLD, args, data, vocab_size, timeout=args.timeout, what="throughput benchmark")


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------
def _stage_costs(args: argparse.Namespace, per_rank: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Per stage, the medians of the probe's forward+backward and optimizer times (``kind``: "solo" or "both")."""
    w = args.warmup
    stages = []
    for r in per_rank:
        fb = [t[0] for t in r["probe"][kind][w:]]
        opt = [t[1] for t in r["probe"][kind][w:]]
        total = [a + b for a, b in zip(fb, opt, strict=True)]
        stages.append(
            {
                "stage": r["rank"],
                "layers": args.partition[r["rank"]],
                "fwd_bwd_s": statistics.median(fb),
                "optimizer_s": statistics.median(opt),
                "compute_s": statistics.median(total),
            }
        )
    return stages


def _avg_ideal(
    args: argparse.Namespace,
    per_rank: list[dict[str, Any]],
    n: int,
    stages: list[dict[str, Any]],
    stages_both: list[dict[str, Any]],
) -> dict[str, Any]:
    """avgpipe-N's ideal: N times the probe (N*M units + N optimizer steps) plus the elastic update, per stage."""
    timed = range(args.warmup, args.warmup + args.steps)

    def elastic_s(r: dict[str, Any], i: int) -> float:
        return r["elastic_probe"][n][i] if n > 1 else 0.0

    avg_stages = []
    for st, r in zip(stages, per_rank, strict=True):
        avg_stages.append(
            {
                "stage": st["stage"],
                "layers": st["layers"],
                "fwd_bwd_s": n * st["fwd_bwd_s"],
                "optimizer_s": n * st["optimizer_s"],
                "elastic_s": statistics.median(elastic_s(r, i) for i in timed),
                "compute_s": statistics.median(n * sum(r["probe"]["solo"][i]) + elastic_s(r, i) for i in timed),
            }
        )
    units = n * args.microbatches
    return {
        "step_s": max(st["compute_s"] for st in avg_stages),
        "stages": avg_stages,
        "step_s_both_stages_at_once": max(
            n * sb["compute_s"] + st["elastic_s"] for sb, st in zip(stages_both, avg_stages, strict=True)
        ),
        "bubble_bound_1f1b": units / (units + WORLD - 1),
        "per_round": [max(n * sum(r["probe"]["solo"][i]) + elastic_s(r, i) for r in per_rank) for i in timed],
    }


def summarise(args: argparse.Namespace, per_rank: list[dict[str, Any]], vocab_size: int) -> dict[str, Any]:
    w = args.warmup
    names = row_names(args)
    timed = range(w, w + args.steps)
    # step time of a row = the slowest rank's time for that step
    step_times = {name: [max(r["times"][name][i] for r in per_rank) for i in timed] for name in names}
    samples = {name: pipelines_of(name) * args.batch_size for name in names}

    stages, stages_both = _stage_costs(args, per_rank, "solo"), _stage_costs(args, per_rank, "both")
    ideal = max(s["compute_s"] for s in stages)
    ideal_both = max(s["compute_s"] for s in stages_both)
    # paired estimates: within one round all rows ran back to back, so per-round ratios cancel slow load drifts
    ideal_per_round = [max(sum(r["probe"]["solo"][i]) for r in per_rank) for i in timed]
    avg_ideal = {f"{AVG_PREFIX}{n}": _avg_ideal(args, per_rank, n, stages, stages_both) for n in args.pipelines}

    def row_ideal(name: str) -> float:
        return avg_ideal[name]["step_s"] if name in avg_ideal else ideal

    def row_ideal_round(name: str) -> list[float]:
        return avg_ideal[name]["per_round"] if name in avg_ideal else ideal_per_round

    def loss_of(name: str, i: int) -> float:
        v_rows = ("single", "ours-zbv", "ours-zbv-placed", "torch-zbv")
        owner = 0 if name in v_rows else WORLD - 1  # the rank holding the loss (V: 0)
        value = per_rank[owner]["losses"][name][i]
        assert value is not None, f"{name} has no loss on rank {owner}"
        return float(value)

    medians = {name: statistics.median(ts) for name, ts in step_times.items()}
    sps = {name: samples[name] / medians[name] for name in names}
    rows = []
    for name in names:
        n = pipelines_of(name)
        avg = name.startswith(AVG_PREFIX)
        row: dict[str, Any] = {
            "name": name,
            "label": LABELS.get(name, f"AvgPipe, {n} parallel pipeline(s) with elastic averaging, 1F1B over N*M units"),
            "pipelines": n if avg else None,
            "samples_per_step": samples[name],
            "step_s_median": medians[name],
            "step_s_min": min(step_times[name]),
            "step_s_max": max(step_times[name]),
            "step_s": step_times[name],
            "samples_per_s": sps[name],
            "ratio_to_torch_1f1b": sps[name] / sps["torch-1f1b"],
            "speedup_vs_single": sps[name] / sps["single"],
            # the single process has no pipeline: its efficiency is not defined here (null), not 1.0
            "pipeline_efficiency": None if name == "single" else row_ideal(name) / medians[name],
            # samples/s ratio within each round: (samples / t_row) / (B / t_torch)
            "paired_ratio_to_torch_1f1b": statistics.median(
                (samples[name] / args.batch_size) * t / u
                for t, u in zip(step_times["torch-1f1b"], step_times[name], strict=True)
            ),
            "paired_pipeline_efficiency": None
            if name == "single"
            else statistics.median(a / u for a, u in zip(row_ideal_round(name), step_times[name], strict=True)),
            "pipeline_efficiency_vs_both_stages_at_once": None
            if name == "single"
            else (avg_ideal[name]["step_s_both_stages_at_once"] if avg else ideal_both) / medians[name],
            "first_step_loss": loss_of(name, 0),
            "final_loss": loss_of(name, args.warmup + args.steps - 1),
        }
        if avg:
            # medians per stage of the parts of the step timed inside the row
            row["parts_s"] = [
                {part: statistics.median(r["avgpipe_parts"][name][part][i] for i in timed) for part in AVG_PARTS}
                for r in per_rank
            ]
        rows.append(row)

    first = {row["name"]: row["first_step_loss"] for row in rows}

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=args.rtol, abs_tol=args.rtol)

    mismatches = [name for name in ROWS if not close(first[name], first["single"])]
    if not close(first["ours-1f1b"], first["torch-1f1b"]):
        mismatches.append("ours-1f1b vs torch-1f1b")
    # avgpipe-N: the mean-over-replicas loss of the first steps against a single-process AvgPipe (N = 1: plain
    # training, so avgpipe-N1's first-step loss also equals every other row's)
    reference = per_rank[0]["elastic_reference"]
    check_steps = min(args.check_steps, args.warmup + args.steps)
    avg_checks: dict[str, Any] = {}
    for n in args.pipelines:
        name = f"{AVG_PREFIX}{n}"
        ours = [loss_of(name, i) for i in range(check_steps)]
        ok = all(close(a, b) for a, b in zip(ours, reference[n], strict=True))
        avg_checks[name] = {
            "losses": ours,
            "single_process": reference[n],
            "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(ours, reference[n], strict=True)),
            "ok": ok,
        }
        if not ok:
            mismatches.append(f"{name} vs single-process AvgPipe (first {check_steps} steps)")
        if n == 1 and not close(first[name], first["single"]):
            mismatches.append(name)
    nonfinite = [
        name for name in names if not all(math.isfinite(loss_of(name, i)) for i in range(args.warmup + args.steps))
    ]
    mismatches += [f"{name}: non-finite loss" for name in nonfinite]
    m, s = args.microbatches, WORLD
    fit: dict[str, Any] | None = None
    if args.fit_rounds:
        # per step, the slowest rank's time of each; per round, the median of the per-step ratios fit / runtime
        def per_step(key: str, i: int) -> list[float]:
            return [max(values) for values in zip(*(r[key][i] for r in per_rank))]

        ratios, fit_s, runtime_s = [], [], []
        for i in range(args.fit_rounds):
            f, r = per_step("fit_rounds", i), per_step("runtime_rounds", i)
            ratios.append(statistics.median(a / b for a, b in zip(f, r, strict=True)))
            fit_s.append(statistics.median(f))
            runtime_s.append(statistics.median(r))
        fit = {
            "rounds": args.fit_rounds,
            "fit_step_s": fit_s,
            "runtime_step_s": runtime_s,
            "fit_over_runtime": ratios,
            "fit_over_runtime_median": statistics.median(ratios),
        }
    return {
        "fit_vs_runtime": fit,
        "config": {
            "world_size": WORLD,
            "threads_per_rank": 1,
            "batch_size": args.batch_size,
            "microbatches": m,
            "steps": args.steps,
            "warmup": args.warmup,
            "n_layer": args.n_layer,
            "n_embd": args.n_embd,
            "n_head": args.n_head,
            "block_size": args.block_size,
            "vocab_size": vocab_size,
            "partition": args.partition,
            "optimizer": "AdamW",
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "torch": torch.__version__,
            "pipelines": args.pipelines,
            "check_steps": check_steps,
        },
        "rows": rows,
        "ideal": {
            "step_s": ideal,
            "definition": "max over stages of the median (forward+backward over all micro-batches + optimizer "
            "step) of that stage's layers alone: no communication, the other rank idle",
            "stages": stages,
            "step_s_both_stages_at_once": ideal_both,
            "stages_both_at_once": stages_both,
            "bubble_bound_1f1b": m / (m + s - 1),
            "avgpipe": {k: {kk: vv for kk, vv in v.items() if kk != "per_round"} for k, v in avg_ideal.items()},
            "avgpipe_definition": "per stage: N x (the probe's forward+backward over M micro-batches + optimizer "
            "step) + the elastic update (begin_step + finish_step on a private N-replica "
            "copy, in the same solo slot); max over stages",
        },
        "checks": {
            "first_step_loss": first,
            "rtol": args.rtol,
            "max_param_diff_ours_vs_torch_1f1b": max(r["param_diff"] for r in per_rank),
            "avgpipe_vs_single_process": avg_checks,
            "ok": not mismatches,
            "mismatches": mismatches,
        },
    }


def format_table(summary: dict[str, Any]) -> str:
    c, ideal, checks = summary["config"], summary["ideal"], summary["checks"]
    lines = [
        f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} block_size={c['block_size']} "
        f"vocab={c['vocab_size']} | batch {c['batch_size']} in {c['microbatches']} micro-batches | "
        f"{c['world_size']} gloo ranks x 1 thread, partition {c['partition']} | AdamW | "
        f"{c['steps']} timed steps after {c['warmup']} warm-up, interleaved | torch {c['torch']}",
        "",
        f"{'row':<20} {'samples':>7} {'step ms':>8} {'(min-max)':>11} {'samples/s':>10} {'vs torch 1F1B':>14} "
        f"{'(paired)':>9} {'vs single':>10} {'pipe eff':>9} {'(paired)':>9}",
    ]

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    for r in summary["rows"]:
        spread = f"({r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f})"
        lines.append(
            f"{r['name']:<20} {r['samples_per_step']:7d} {r['step_s_median'] * 1e3:8.1f} {spread:>11} "
            f"{r['samples_per_s']:10.1f} "
            f"{r['ratio_to_torch_1f1b']:13.3f}x {r['paired_ratio_to_torch_1f1b']:8.3f}x "
            f"{r['speedup_vs_single']:9.3f}x {fmt(r['pipeline_efficiency']):>9} "
            f"{fmt(r['paired_pipeline_efficiency']):>9}"
        )

    def stage_txt(stages: list[dict[str, Any]]) -> str:
        return ", ".join(
            f"stage {s['stage']} ({s['layers']} layers) {s['fwd_bwd_s'] * 1e3:.1f} + {s['optimizer_s'] * 1e3:.1f} ms"
            for s in stages
        )

    lines += [
        "",
        f"ideal step = slowest stage's compute alone (fwd+bwd over all micro-batches + AdamW, no communication, "
        f"other rank idle): {ideal['step_s'] * 1e3:.1f} ms  [{stage_txt(ideal['stages'])}]",
        f"  (both stages computing at once, no communication: {ideal['step_s_both_stages_at_once'] * 1e3:.1f} ms  "
        f"[{stage_txt(ideal['stages_both_at_once'])}])",
        f"samples/s, vs torch 1F1B, vs single and pipe eff (= ideal / step) use median step times; (paired) = "
        f"median over rounds of the same ratio within one round. single: pipe eff n/a (no pipeline). 1F1B with "
        f"perfectly balanced stages is bounded by M/(M+S-1) = {ideal['bubble_bound_1f1b']:.2f}.",
    ]
    avg_rows = [r for r in summary["rows"] if r["pipelines"] is not None]
    if avg_rows:
        lines += [
            f"avgpipe-N: N replicas per stage, each step N batches of {c['batch_size']} (samples = N*B), 1F1B over "
            f"N*M units; ideal = N x the probe + the elastic update (begin_step + finish_step alone); 1F1B bubble "
            f"bound N*M/(N*M+S-1): "
            + ", ".join(f"N{r['pipelines']} {ideal['avgpipe'][r['name']]['bubble_bound_1f1b']:.2f}" for r in avg_rows),
        ]
        for r in avg_rows:
            ai = ideal["avgpipe"][r["name"]]
            per_stage = "; ".join(
                f"stage {k}: pipeline {p['pipeline'] * 1e3:.1f} + optimizer step ({r['pipelines']} AdamW steps "
                f"and the elastic update) {p['optimizer_step'] * 1e3:.1f} ms"
                f" (the update alone {ai['stages'][k]['elastic_s'] * 1e3:.2f})"
                for k, p in enumerate(r["parts_s"])
            )
            lines.append(f"  {r['name']} ideal {ai['step_s'] * 1e3:.1f} ms; in-step medians {per_stage}")
    lines += [
        "first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in checks["first_step_loss"].items()),
        "final loss:      " + ", ".join(f"{r['name']} {r['final_loss']:.6f}" for r in summary["rows"]),
        f"max |w_ours-1f1b - w_torch-1f1b| after all steps: {checks['max_param_diff_ours_vs_torch_1f1b']:.2e}",
        *(
            f"{name} mean-over-replicas loss, first {len(v['losses'])} steps: "
            + " ".join(f"{x:.6f}" for x in v["losses"])
            + " | single-process AvgPipe: "
            + " ".join(f"{x:.6f}" for x in v["single_process"])
            + f" (max rel diff {v['max_rel_diff']:.1e})"
            for name, v in checks["avgpipe_vs_single_process"].items()
        ),
        *(
            []
            if summary.get("fit_vs_runtime") is None
            else [
                "Trainer.fit (strategy='avgpipe', 1F1B, CSV logger) vs the same StagePipeline step alone, paired "
                "step by step (one runtime step between two fit iterations), median of fit/runtime per round: "
                + ", ".join(f"{x:.3f}" for x in summary["fit_vs_runtime"]["fit_over_runtime"])
                + f" (median {summary['fit_vs_runtime']['fit_over_runtime_median']:.3f}; runtime "
                + ", ".join(f"{x * 1e3:.1f}" for x in summary["fit_vs_runtime"]["runtime_step_s"])
                + " ms, fit "
                + ", ".join(f"{x * 1e3:.1f}" for x in summary["fit_vs_runtime"]["fit_step_s"])
                + " ms)"
            ]
        ),
        "correctness: "
        + (
            "OK (first-step losses agree, avgpipe rows match single-process AvgPipe, within "
            f"rtol {checks['rtol']:g}; all losses finite)"
            if checks["ok"]
            else f"MISMATCH {checks['mismatches']}"
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    text = stdlib_docstrings(args.corpus_chars)
    data, chars = encode(text)
    if len(data) < args.block_size + 2:
        raise SystemExit(f"the corpus has {len(data)} characters, fewer than block_size + 2")
    started = time.perf_counter()
    per_rank = launch(args, data, len(chars))
    summary = summarise(args, per_rank, len(chars))
    summary["wall_s"] = time.perf_counter() - started
    print(format_table(summary))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if summary["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
