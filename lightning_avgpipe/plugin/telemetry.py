"""What the strategy logs about its steps: samples/s every step; bubble, waits, memory, divergence and noise scale on
the steps whose logs Lightning writes; timelines of the traced steps (docs/strategy.md#what-is-logged).

Measuring costs a collective over the pipeline (and saved-tensor hooks for the activation peak), so it happens only
where a figure is written: every ``log_every_n_steps``, on traced steps, and while ``advance_forwards="auto"`` still
searches (it needs every step's figures).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from lightning_avgpipe.plugin import compat
from lightning_avgpipe.runtime.pipeline import StagePipeline, StepResult


class Telemetry:
    """The strategy's per-step figures, logged through the LightningModule."""

    def __init__(self) -> None:
        self._step_started: float | None = None

    def pause(self) -> None:
        """An evaluation ran: the next step's samples/s must not include it."""
        self._step_started = None

    def wants_figures(self, trainer: pl.Trainer, pipeline: StagePipeline) -> bool:
        """Whether this step measures its figures (every rank answers alike: it counts steps)."""
        cfg = pipeline.config
        traced = cfg.trace_dir is not None and trainer.global_step in cfg.trace_steps
        return traced or pipeline.measuring_k or pipeline.measuring_memory or compat.writes_logs(trainer)

    def step_started(self, module: pl.LightningModule, samples: int, log: bool) -> None:
        """Time the last iteration (validation in between not counted); with ``log``, log its samples/s."""
        now = time.perf_counter()
        if log and self._step_started is not None and now > self._step_started:
            module.log("avgpipe/samples_per_sec", samples / (now - self._step_started), on_step=True, on_epoch=False)
        self._step_started = now

    def step_finished(
        self, module: pl.LightningModule, pipeline: StagePipeline, result: StepResult, optimizers: list[Optimizer]
    ) -> None:
        """Log the step's figures (collective over the pipeline), write its timeline if traced, advance k's search."""
        if result.divergence is not None:
            module.log("avgpipe/divergence", result.divergence.mean(), on_step=True, on_epoch=False)
            module.log("avgpipe/divergence_max", result.divergence.max(), on_step=True, on_epoch=False)
        noise_scale = pipeline.noise_scale.value
        if result.noise is not None and noise_scale is not None:  # smoothed over the steps that measured it
            module.log("avgpipe/noise_scale", noise_scale, on_step=True, on_epoch=False)
        table = pipeline.figures(result.trace, pipeline.static_bytes(optimizers))  # (S, 6)
        module.log("avgpipe/bubble_fraction", float(table[:, 3].mean()), on_step=True, on_epoch=False)
        module.log("avgpipe/comm_wait_s", float(table[:, 2].max()), on_step=True, on_epoch=False)
        for s in range(pipeline.num_stages):
            module.log(f"avgpipe/peak_memory_mb/stage{s}", float(table[s, 5]) / 2**20, on_step=True, on_epoch=False)
        cfg, step = pipeline.config, module.trainer.global_step
        if cfg.trace_dir is not None and step in cfg.trace_steps:
            written = pipeline.write_trace(
                result.trace, Path(cfg.trace_dir) / f"step{step}.json", f"step {step}: {pipeline.describe()}"
            )
            if written is not None:
                json_path, png_path = written
                also = f" and {png_path}" if png_path else ""
                rank_zero_info(f"AvgPipe: timeline of step {step} written to {json_path}{also}")
        if cfg.schedule == "advance":
            module.log("avgpipe/advance_forwards", float(pipeline.advance_forwards), on_step=True, on_epoch=False)
            reason = pipeline.observe_k(table)
            if reason is not None:
                rank_zero_info(f"AvgPipe: advance_forwards='auto' {reason}.")
        decided = pipeline.observe_memory(table)
        if decided is not None:
            rank_zero_info(f"AvgPipe: activation_checkpointing='auto' {decided}.")

    @staticmethod
    def announce_averaging(pipeline: StagePipeline) -> None:
        """Say how the N batches of a step combine, when there is more than one (rank 0)."""
        cfg, elastic, groups = pipeline.config, pipeline.elastic, pipeline.topology.num_groups
        if cfg.exact and cfg.num_pipelines * groups > 1:
            rank_zero_info(
                f"AvgPipe: averaging='exact': each step trains {cfg.num_pipelines} batches x {groups} groups "
                "as one batch (gradients averaged, one optimizer step)."
            )
        if not elastic.trivial:
            outer = (
                ""
                if elastic.paper_rule
                else f", outer lr {elastic.outer_lr:g} momentum {elastic.outer_momentum:g}, period {elastic.period}"
            )
            sharded = (
                f"; the reference, its update and momentum sharded over the {groups} groups (1/{groups} each during "
                "the step, whole between steps)"
                if elastic.sharded
                else ""
            )
            update = "synchronous" if cfg.synchronous_reference else "overlapped"
            rank_zero_info(
                f"AvgPipe: {cfg.num_pipelines} parallel pipelines x {groups} groups, elastic alpha "
                f"{elastic.alpha:g}{outer}, reference update {update}{sharded}."
            )

    @staticmethod
    def log_loss(module: pl.LightningModule, loss: Any) -> None:
        module.log("avgpipe/loss", loss, on_step=True, on_epoch=False)
