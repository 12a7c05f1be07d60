"""The strategy's training and evaluation steps: Lightning's step hooks mapped onto the stage pipeline's steps, with
the step's loss and logs shared by every stage (docs/how-it-works.md#a-training-step).

:class:`PipelineSteps` holds what a step needs (the module, the controller, the bridge to the user's hooks) and knows
nothing of the strategy: the strategy makes one in ``setup`` and calls it from its hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.contract import pipeline_inputs
from lightning_avgpipe.plugin.steps.bridge import StepBridge, replay_logs
from lightning_avgpipe.plugin.steps.gradients import GradStash, discarded_by_zero_grad, free_after_slicing
from lightning_avgpipe.plugin.steps.memory import report_after_first_step
from lightning_avgpipe.plugin.steps.precision import loss_scale_of
from lightning_avgpipe.plugin.steps.results import StepResults
from lightning_avgpipe.runtime.comms import collectives
from lightning_avgpipe.runtime.controller import StepController, StepReport
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.request import StepRequest
from lightning_avgpipe.runtime.sharding.grid_stage import GridStage
from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer
from lightning_avgpipe.shards import local

# the precision plugin's context around each evaluation hook's forwards
EVAL_CONTEXTS = {
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class PipelineSteps:
    """Lightning's step hooks on one rank, run through the stage's controller.

    Args:
        module: the user's LightningModule.
        controller: the stage's step and what steers it.
        bridge: runs the user's step hooks on the last stage.
        param_names: ``id(parameter) -> name`` in the module, for errors about non-finite gradients.
    """

    def __init__(
        self, module: pl.LightningModule, controller: StepController, bridge: StepBridge, param_names: Mapping[int, str]
    ) -> None:
        self.module = module
        self.controller = controller
        self.bridge = bridge
        self.param_names = param_names
        self.results = StepResults(controller.pipeline)  # the step's loss and logs to every stage
        self.stash = GradStash()  # the step's gradients, between training_step and backward
        self.memory_reported = False  # the first step's memory breakdown (plugin/steps/memory.py)

    def training_step(self, batch: Any, rest: tuple[Any, ...], precision: Precision, num_pipelines: int) -> Tensor:
        """One training iteration: the pipeline's step over the N batches, the user's ``training_step`` as the loss
        on the last stage; returns the loss every stage reports (the last stage's, shared). The noise scale is
        measured on the logged steps and every ``controller.noise_every`` steps."""
        module, control, bridge = self.module, self.controller, self.bridge
        pipeline, trainer = control.pipeline, module.trainer
        for n, one in enumerate(batch if num_pipelines > 1 else [batch]):
            where = f" (pipeline {n}'s of {num_pipelines})" if num_pipelines > 1 else ""
            check_not_empty(one, f"training batch {rest[0] if rest else '?'}{where} of epoch {trainer.current_epoch}")
        writes_logs = compat.writes_logs(trainer)
        if not self.memory_reported:  # printed and logged once the first optimizer step has run
            self.memory_reported = True
            report_after_first_step(precision, module, control)
        request = StepRequest(  # the whole step's request, passed unchanged down to the executor
            batch if num_pipelines > 1 else [batch],
            lambda output, micro, share: bridge.call_step("training_step", output, micro, share, *rest),
            step=trainer.global_step,
            batch_index=int(rest[0]) if rest else 0,  # with the step: each layer's random stream (a resume too)
            log=writes_logs,
            optimizers=trainer.strategy.optimizers,
            inputs=lambda micro: pipeline_inputs(module, micro),
            accumulate=trainer.accumulate_grad_batches,
            forward_context=precision.train_step_context,
            divergence=not pipeline.replicas.elastic.trivial and writes_logs,
            noise=writes_logs or compat.every(trainer.global_step, control.noise_every),
            param_names=self.param_names,
            loss_scale=loss_scale_of(precision),
        )
        # Lightning zeroes gradients between training_step and backward
        discarded = discarded_by_zero_grad(trainer, int(rest[0]) if rest else None)
        free_after_slicing(trainer, int(rest[0]) if rest else None)
        with self.stash.apart(pipeline.replicas.params, discarded):
            report = control.run(request)
        result = report.result
        if result.loss is not None:  # the last stage
            loss, logs = self.results.exchange(result.loss.cpu(), bridge.take_logs())
        else:
            loss, logs = self.results.exchange(None, None)
        device = pipeline.device
        log_report(module, report)
        replay_logs(module, logs, device)
        loss = loss.to(device)
        if not pipeline.replicas.elastic.trivial:  # the mean over replicas, whatever the user logs
            module.log("avgpipe/loss", loss, on_step=True, on_epoch=False)
        return loss

    def eval_step(self, hook: str, args: tuple[Any, ...], precision: Precision, share_output: bool) -> Any:
        """``validation_step``/``test_step``/``predict_step`` through the pipeline's forwards; the last stage's logs
        reach every stage, and with ``share_output`` (predict) its output too."""
        module, pipeline, bridge = self.module, self.controller.pipeline, self.bridge
        check_not_empty(args[0], f"{hook.split('_')[0]} batch {args[1] if len(args) > 1 else '?'}")
        self.controller.pause()
        results = pipeline.eval_step(
            args[0],
            lambda output, micro, share: bridge.call_step(hook, output, micro, share, *args[1:]),
            inputs=lambda micro: pipeline_inputs(module, micro),
            forward_context=getattr(precision, EVAL_CONTEXTS[hook]),
            key=hook,
        )
        payload = output = None
        if pipeline.executor.is_last:
            output = microbatch.merge([results[u] for u in sorted(results)])
            payload = (microbatch.to_cpu(output) if share_output else None, bridge.take_logs())
        shared, logs = pipeline.share(payload)
        replay_logs(module, logs, pipeline.device)
        return shared if share_output and output is None else output

    def land_gradients(self) -> None:
        """Put the step's gradients on the parameters (in ``backward``, after Lightning zeroed them)."""
        self.stash.land(self.controller.pipeline.replicas.params)


def log_report(module: pl.LightningModule, report: StepReport) -> None:
    """Log what the controller measured at this step (every rank alike) and say what it decided (rank 0)."""
    for name, value in report.scalars.items():
        module.log(name, value, on_step=True, on_epoch=False)
    for note in report.notes:
        rank_zero_info(note)


def announce_averaging(pipeline: StagePipeline) -> None:
    """Say how the N batches of a step combine, when there is more than one (rank 0)."""
    cfg, elastic, groups = pipeline.config, pipeline.replicas.elastic, pipeline.topology.num_groups
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


def announce_sequence(pipeline: StagePipeline) -> None:
    """Say which layers of each stage run on a shard of the sequence (``sequence_parallel=True``) or on blocks of
    the grid (``tensor_parallel_mode`` ``"2d"``/``"2.5d"``), and in them which parts get the whole sequence; and,
    for the grid, which layers run whole and why (collective over the pipeline: every rank calls it at setup; rank 0
    prints)."""
    split = pipeline.sequence
    if split is None:
        return
    if isinstance(split, GridStage):
        layers = [
            (i, [f"{n} {'by heads' if how == 'heads' else 'whole'}" for n, how in done.attentions.items()])
            for i, done in sorted(split.layers.items())
        ]
        mine: Any = (layers, split.count, split.carried[0][1], sorted(split.left.items()))
    else:
        mine = (
            [(i, [f"{g} whole" for g in done.gathered]) for i, done in sorted(split.layers.items())],
            split.count,
            split.carried[0][1],
            [],
        )
    every = collectives.gather(pipeline.topology, mine)
    if every is None or pipeline.topology.rank != 0:
        return
    T = pipeline.topology.tensor_parallel_size
    parts = []
    for s, (layers, count, carried, left) in enumerate(every):
        names = ", ".join(f"{i}" + (f" ({' and '.join(g)})" if g else "") for i, g in layers) or "none"
        parts.append(
            f"stage {s}: {names} of its {count}"
            + (", its output sent as each shard's part" if carried else "")
            + "".join(f"; its layer {i} whole: {why}" for i, why in left)
        )
    if isinstance(split, GridStage):
        d, q = split.grid.d, split.grid.q
        rank_zero_info(
            f"AvgPipe: tensor_parallel_mode={pipeline.config.tensor_parallel_mode!r}: layers on {d} x {q} x {q} "
            f"blocks, 1/{T} of their activations and 1/{q * q} of their weights (by index in the stage; an attention "
            "gets its input whole, split by heads): " + " | ".join(parts) + "."
        )
        return
    rank_zero_info(
        f"AvgPipe: sequence_parallel=True: layers on 1/{T} of the sequence (by index in the stage; an attention or "
        "other part the trial does not pass gets the whole sequence): " + "; ".join(parts) + "."
    )


def announce_sharding(pipeline: StagePipeline, optimizer: Any) -> None:
    """Say how ``shard_optimizer_state`` splits each stage's optimizer state over the D groups: every group's share
    of every stage (collective over the job: every rank calls it at setup; rank 0 prints); or, under FSDP
    (``sharding_strategy`` ZeRO-2/3), rank 0's share and when weights are gathered and gradients reduced."""
    top = pipeline.topology
    sharding = pipeline.sharding
    if sharding is not None:
        mine = sum(local(p).numel() for p in pipeline.reference_params)
        whole = sum(p.numel() for p in pipeline.reference_params)
        how = "gathered for each use" if sharding.level == "FULL_SHARD" and not sharding.per_step else "gathered once"
        reduced = "each micro-batch" if sharding.sync_each_microbatch else "once at the end of the step"
        rank_zero_info(
            f"AvgPipe: sharding_strategy={sharding.level!r} over {top.num_groups} groups (FSDP2): rank 0 keeps "
            f"{mine / max(whole, 1):.1%} of its stage's weights, gradients and optimizer state; weights {how} in "
            f"a step, gradients reduce-scattered {reduced}."
        )
        if pipeline.device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            rank_zero_warn(
                "AvgPipe: on CPU, glibc's heap keeps the buffers FSDP frees each micro-batch, so a rank's resident "
                "memory can exceed the unsharded run's. Set MALLOC_MMAP_THRESHOLD_=1048576 in the environment of "
                "every process for a peak near what its tensors hold; it costs step time "
                "(docs/parallelism.md#sharded-stages)."
            )
        return
    if not isinstance(optimizer, ShardedOptimizer):
        return
    mine, whole, how = optimizer.share()
    rows: list[Any] | None = [None] * top.world_size if top.rank == 0 else None
    dist.gather_object((top.stage, top.group_index, top.tensor_rank, mine, whole, how), rows, dst=0)
    if rows is None:
        return
    stages: dict[int, list[str]] = {}
    for stage, group, shard, part, total, _ in sorted(rows):
        if shard == 0:  # a stage's tensor shards split alike
            stages.setdefault(stage, []).append(f"group {group} {part / max(total, 1):.1%}")
    listed = "; ".join(f"stage {s}: {', '.join(shares)}" for s, shares in sorted(stages.items()))
    rank_zero_info(
        f"AvgPipe: shard_optimizer_state splits the optimizer state over {top.num_groups} groups by {rows[0][5]}; "
        f"each group keeps, of a stage's: {listed}."
    )


def announce_checkpointing(pipeline: StagePipeline, names: Sequence[str]) -> None:
    """Say which layers each stage recomputes under ``activation_checkpointing`` (``names``: this rank's layers' names
    in the module, in the pipeline's order). Collective over the pipeline (every rank calls it); rank 0 prints."""
    spec = pipeline.config.activation_checkpointing
    if not spec:
        return
    if spec == "auto":
        rank_zero_info(
            "AvgPipe: activation_checkpointing='auto': a stage checkpoints its layers once its measured peak exceeds "
            "memory_limit (decided after the first step, and logged then)."
        )
        return
    every = pipeline.gather([n for n, on in zip(names, pipeline.recompute) if on])
    if every is None:
        return
    where = "rank" if pipeline.chunks.v > 1 else "stage"  # several stages per rank: by the rank that holds them
    parts = [f"{where} {s}: {_listed(chosen)}" for s, chosen in enumerate(every)]
    rank_zero_info(f"AvgPipe: activation checkpointing recomputes, per {where}, " + "; ".join(parts) + ".")


def _listed(names: Sequence[str]) -> str:
    """``a, b, c``, or ``a ... z (12 layers)`` for a long list; ``no layer`` for none."""
    if not names:
        return "no layer"
    if len(names) <= 4:
        return ", ".join(names)
    return f"{names[0]} ... {names[-1]} ({len(names)} layers)"


def check_not_empty(batch: Any, what: str) -> None:
    """A batch of 0 samples is refused on every stage alike (each reads the same batch), naming where it came from."""
    if microbatch.batch_size(batch) == 0:
        raise ValueError(
            f"The {what} is empty: its tensors have 0 samples on dim 0, so it cannot be split into micro-batches. It "
            "came from your DataLoader: a sampler, batch_sampler or collate_fn that yields an empty batch (filtered "
            "samples, or a dataset shorter than expected). Drop empty batches in the sampler or the collate_fn."
        )
