"""StepController: what watches and steers a stage's step (Lightning-free).

:class:`~lightning_avgpipe.runtime.pipeline.StagePipeline` runs a step; the controller decides what each step
measures, measures it, and acts on it: the search for ``advance_forwards="auto"``, the decision of
``activation_checkpointing="auto"``, the smoothed noise scale, the step's figures over the pipeline (bubble, waits,
memory), traces, samples/s, and the variants of the step the tuner profiles. Each step returns a
:class:`StepReport` that a caller only has to log::

    control = StepController(StagePipeline(layers, topology, config))
    opt = control.pipeline.optimizer(torch.optim.AdamW(control.pipeline.reference_params, lr=3e-4))
    for step, batches in enumerate(loader):
        opt.zero_grad()
        report = control.train_step(batches, loss_fn, step=step, optimizers=[opt])
        opt.step()
        for name, value in report.scalars.items(): ...   # what to log
        for note in report.notes: ...                     # what was decided, once per job (rank 0)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.algorithms.advance_k import AdvanceSearch, added_bytes
from lightning_avgpipe.algorithms.noise_scale import NoiseScale
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.cpu import host_memory_bytes
from lightning_avgpipe.runtime.comms import collectives
from lightning_avgpipe.runtime.memory import MemoryBreakdown, process_peak_bytes, stage_breakdown
from lightning_avgpipe.runtime.pipeline import StagePipeline, StepResult
from lightning_avgpipe.runtime.request import StepRequest
from lightning_avgpipe.runtime.trace import StepTrace, write_trace
from lightning_avgpipe.runtime.units import LossFn
from lightning_avgpipe.schedules import max_advance_forwards
from lightning_avgpipe.schedules.generate import reads_k

# the columns of StepController.figures' (S, 6) table
FIGURES = ("step_s", "compute_s", "wait_s", "bubble", "activation_peak_bytes", "device_peak_bytes")


def memory_limit_bytes(limit: float | None, device: torch.device, processes: int = 1) -> float | None:
    """``limit`` in bytes: a number above 1 is bytes already, one at most 1 is a fraction of the device's memory
    (of this machine's memory shared by ``processes`` stage processes on CPU)."""
    if limit is None or limit > 1:
        return limit
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = host_memory_bytes() // max(1, processes)
    return float(limit) * total


def static_bytes(pipeline: StagePipeline, optimizers: Sequence[Optimizer] = ()) -> float:
    """Bytes of a stage's weights (replicas and reference), gradients, optimizer states and averaging buffers."""
    parts = breakdown_of(pipeline, optimizers)
    return float(parts.weights + parts.gradients + parts.optimizer_state + parts.communication)


def breakdown_of(
    pipeline: StagePipeline,
    optimizers: Sequence[Optimizer] = (),
    activations: int = 0,
    in_flight: int = 0,
    peak: int = 0,
) -> MemoryBreakdown:
    """:func:`~lightning_avgpipe.runtime.memory.stage_breakdown` of a stage's tensors (replicas and reference)."""
    elastic = pipeline.replicas.elastic
    params = [*pipeline.replicas.params, *elastic.reference_params]
    return stage_breakdown(
        params, optimizers, elastic.buffers(), activations=activations, in_flight=in_flight, peak=peak
    )


@dataclass
class StepReport:
    """What one step did and what to log about it.

    Attributes:
        result: the step's own result (losses, timeline, divergence, noise).
        figures: ``(S, 6)`` over the pipeline when the step was measured (columns: :data:`FIGURES`), else ``None``.
        scalars: name -> value to log for this step (``avgpipe/...``); the same names on every rank.
        notes: what the controller decided or wrote at this step, one line each (for rank 0's log).
    """

    result: StepResult
    figures: Tensor | None = None
    scalars: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class StepController:
    """Watches and steers one stage's :class:`StagePipeline` (every rank has one; its decisions are collective).

    Args:
        pipeline: the step it steers.
    """

    def __init__(self, pipeline: StagePipeline) -> None:
        self.pipeline = pipeline
        self.noise_scale = NoiseScale()  # B_simple, smoothed over the steps that measure it
        self.noise_every = 0  # measure it also every this many steps (0: only on logged ones): measure_noise_every
        self.k_search: AdvanceSearch | None = None  # advance_forwards="auto", once it has started
        self._recompute_seen = 0  # activation_checkpointing="auto": measured steps seen; -1 once decided
        self._last_start: float | None = None  # when the previous training step started (samples/s)
        # the first training step's activation peak and receive buffers' peak (metered for the memory breakdown)
        self.first_step: tuple[int, int] | None = None

    @property
    def config(self) -> PipelineConfig:
        return self.pipeline.config

    @property
    def memory_limit(self) -> float | None:
        """``memory_limit`` in bytes (a fraction is of this stage's share of the device's memory)."""
        pipe = self.pipeline
        return memory_limit_bytes(self.config.memory_limit, pipe.device, pipe.processes)

    # -- what to measure -----------------------------------------------------------------------------------------
    @property
    def measuring_k(self) -> bool:
        """Whether ``advance_forwards="auto"`` still needs every step's figures."""
        cfg = self.config
        settled = self.k_search is not None and self.k_search.settled
        return reads_k(cfg.schedule) and cfg.advance_forwards == "auto" and not settled

    @property
    def measuring_memory(self) -> bool:
        """Whether ``activation_checkpointing="auto"`` still needs a step's figures to decide."""
        return self.config.activation_checkpointing == "auto" and self._recompute_seen >= 0

    def traced(self, step: int | None) -> bool:
        cfg = self.config
        return cfg.trace_dir is not None and step is not None and step in cfg.trace_steps

    def wants_figures(self, step: int | None, log: bool) -> bool:
        """Whether step ``step`` is measured: its figures are logged (``log``), it is traced, or a search still
        needs it (every rank answers alike)."""
        return log or self.traced(step) or self.measuring_k or self.measuring_memory

    def measure_noise_every(self, steps: int) -> None:
        """Measure the noise scale every ``steps`` training steps besides the logged ones (0: only those); the
        tuner's retune reads it."""
        self.noise_every = int(steps)

    def pause(self) -> None:
        """Something other than training ran (evaluation): the next step's samples/s must not include it."""
        self._last_start = None

    # -- the step ------------------------------------------------------------------------------------------------
    def train_step(self, batches: Sequence[Any], loss_fn: LossFn, *, log: bool = True, **fields: Any) -> StepReport:
        """:meth:`run` of ``StepRequest(batches, loss_fn, log=log, **fields)`` (``runtime/request.py``)."""
        return self.run(StepRequest(batches, loss_fn, log=log, **fields))

    def run(self, request: StepRequest) -> StepReport:
        """Run :meth:`StagePipeline.run_step` and what watches it: measure the step when :meth:`wants_figures`
        (``request.step`` traced, ``request.log``, a search), then log its figures, trace it, advance k's search
        and decide on checkpointing (collectives over the pipeline and the job, taken alike on every rank)."""
        now = time.perf_counter()
        measure = self.wants_figures(request.step, request.log)
        first = self.first_step is None
        report = StepReport(self.pipeline.run_step(request, measure or first))
        result = report.result
        if first:
            links = self.pipeline.executor.all_links
            self.first_step = (result.trace.peak_activation_bytes, sum(ln.peak_in_flight for ln in links))
        if result.noise is not None:
            self.noise_scale.update(result.noise)
        if measure:
            samples = sum(microbatch.batch_size(b) for b in request.batches) * self.pipeline.topology.num_groups
            if self._last_start is not None and now > self._last_start:
                report.scalars["avgpipe/samples_per_sec"] = samples / (now - self._last_start)
            self._observe(report, request.step, request.optimizers)
        self._last_start = now
        return report

    def _observe(self, report: StepReport, step: int | None, optimizers: Sequence[Optimizer]) -> None:
        result, scalars, pipe = report.result, report.scalars, self.pipeline
        if result.divergence is not None:
            scalars["avgpipe/divergence"] = result.divergence.mean()
            scalars["avgpipe/divergence_max"] = result.divergence.max()
        if result.noise is not None and self.noise_scale.value is not None:  # smoothed over the steps measured
            scalars["avgpipe/noise_scale"] = self.noise_scale.value
        table = report.figures = self.figures(result.trace, static_bytes(pipe, optimizers))
        scalars["avgpipe/bubble_fraction"] = float(table[:, 3].mean())
        scalars["avgpipe/comm_wait_s"] = float(table[:, 2].max())
        for s in range(pipe.topology.num_stages):
            scalars[f"avgpipe/peak_memory_mb/stage{s}"] = float(table[s, 5]) / 2**20
        if self.traced(step):
            path = Path(self.config.trace_dir or ".") / f"step{step}.json"
            written = self.write_trace(result.trace, path, f"step {step}: {pipe.describe()}")
            if written is not None:
                also = f" and {written[1]}" if written[1] else ""
                report.notes.append(f"AvgPipe: timeline of step {step} written to {written[0]}{also}")
        if reads_k(self.config.schedule):
            scalars["avgpipe/advance_forwards"] = float(pipe.advance_forwards)
            reason = self.observe_k(table)
            if reason is not None:
                report.notes.append(f"AvgPipe: advance_forwards='auto' {reason}.")
        decided = self.observe_memory(table)
        if decided is not None:
            report.notes.append(f"AvgPipe: activation_checkpointing='auto' {decided}.")

    def figures(self, trace: StepTrace, static: float) -> Tensor:
        """``(S, 6)`` over the pipeline (:data:`FIGURES`): step, compute, wait, bubble, activation peak, device peak.

        The device peak is the allocator's on CUDA (weights and optimizer states included; reset here) and, on CPU,
        ``static`` (what the stage's tensors hold) plus the activation peak.
        """
        pipe = self.pipeline
        row = trace.summary()
        if pipe.device.type == "cuda":
            row.append(float(torch.cuda.max_memory_allocated(pipe.device)))
            torch.cuda.reset_peak_memory_stats(pipe.device)
        else:
            row.append(row[4] + static)
        return collectives.stage_rows(pipe.topology, torch.tensor(row, dtype=torch.float64, device=pipe.device))

    def write_trace(self, trace: StepTrace, path: Path, title: str) -> tuple[Path, Path | None] | None:
        """Gather the step's timelines of every stage and write them (first pipeline's first stage; collective)."""
        top = self.pipeline.topology
        gathered = self.pipeline.gather(trace.spans)
        if gathered is None or top.group_index != 0:
            return None
        names = [f"stage {s} (rank {r})" for s, r in enumerate(top.pipeline_ranks)]
        return write_trace(path, gathered, title, names)

    def memory_breakdown(self, optimizers: Sequence[Optimizer]) -> MemoryBreakdown:
        """What fills this stage now, with the first training step's activations and receive buffers at their peaks
        and the process's peak so far (after the first optimizer step: its state exists)."""
        activations, in_flight = self.first_step or (0, 0)
        peak = process_peak_bytes(self.pipeline.device)
        return breakdown_of(self.pipeline, optimizers, activations, in_flight, peak)

    # -- advance forward: k --------------------------------------------------------------------------------------
    def observe_k(self, table: Tensor) -> str | None:
        """One step's observation for ``advance_forwards="auto"`` (``table`` from :meth:`figures`); the decision is
        global rank 0's, broadcast to every rank. Returns the reason when this observation settled k."""
        if not self.measuring_k:
            return None
        pipe = self.pipeline
        units = pipe.num_microbatches * (1 if pipe.replicas.batched is not None else pipe.config.num_pipelines)
        if self.k_search is None:
            self.k_search = AdvanceSearch(
                max_k=max_advance_forwards(pipe.topology.num_stages, units), memory_limit=self.memory_limit
            )
        search = self.k_search
        peaks = [float(v) for v in table[:, 4]]  # what k + 1 would add follows the peak stash's closed form
        search.observe(
            float(table[:, 0].max()), peaks, added_bytes(peaks, pipe.topology.num_stages, units, pipe.advance_forwards)
        )
        decision = torch.tensor([search.k, int(search.settled)], dtype=torch.int64, device=pipe.device)
        if pipe.topology.world_size > 1:  # global rank 0 decides for the whole job
            dist.broadcast(decision, src=0, group=pipe.topology.job_group)
        search.k, search.settled = int(decision[0]), bool(decision[1])
        pipe.advance_forwards = search.k
        return (search.reason or f"settled on {search.k} (rank 0)") if search.settled else None

    # -- activation checkpointing: "auto" ------------------------------------------------------------------------
    def observe_memory(self, table: Tensor) -> str | None:
        """``activation_checkpointing="auto"``: from the second measured step (the optimizer's state exists by then),
        every stage whose device peak (``table`` column 5; the largest over the stage's groups and tensor shards, and
        the smallest limit: collective over the job) is above ``memory_limit`` checkpoints all its layers, so every
        rank of a stage decides alike; returns what was decided."""
        if not self.measuring_memory:
            return None
        self._recompute_seen += 1
        if self._recompute_seen < 2:
            return None
        self._recompute_seen = -1  # decided
        limit = self.memory_limit
        if limit is None:  # the same configuration on every rank
            return "off: no memory_limit to keep under"
        pipe = self.pipeline
        # the peaks' maximum and the limits' minimum over the job, in one all-reduce
        values = torch.cat([table[:, 5].double(), torch.tensor([-float(limit)], dtype=torch.float64)])
        if pipe.topology.world_size > 1:
            values = values.to(pipe.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pipe.topology.job_group)
        *peak, limit = values.tolist()
        limit = -limit
        over = [s for s, p in enumerate(peak) if p > limit]
        if pipe.topology.stage in over:
            pipe.set_recompute([True] * len(pipe.layers))
        if not over:
            return f"off: every stage's peak is under memory_limit ({limit / 2**20:.1f} MiB)"
        named = ", ".join(f"stage {s} {peak[s] / 2**20:.1f} MiB" for s in over)
        return f"on for every layer of stage(s) {over}: peaks {named} above memory_limit ({limit / 2**20:.1f} MiB)"

    def set_recompute(self, mask: Sequence[bool]) -> None:
        """Checkpoint the layers in ``mask`` from the next step on; under ``activation_checkpointing="auto"`` that
        is the decision, and nothing more is measured for it."""
        self._recompute_seen = -1
        self.pipeline.set_recompute(mask)

    # -- other settings ------------------------------------------------------------------------------------------
    def reconfigure(self, config: PipelineConfig) -> bool:
        """Take a new M, N, k or averaging (:meth:`StagePipeline.reconfigure`: returns whether the replicas were
        made anew); a new k setting starts its search afresh."""
        if config.advance_forwards != self.config.advance_forwards:
            self.k_search = None
        return self.pipeline.reconfigure(config)

    def variant(self, **changes: Any) -> StagePipeline:
        """This stage running replica 0 alone under the config with ``changes`` (same layers, executor and link).

        The tuner profiles the real step this way at other micro-batch counts and schedules: every rank must take
        the same variant. It measures nothing for training: its noise, k and figures are the caller's.
        """
        return self.pipeline.alone(replace(self.config, **changes))
