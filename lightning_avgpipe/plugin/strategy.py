"""AvgPipeStrategy: Lightning hook glue over the partitioner, the schedules and the stage executor."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_avgpipe import microbatch
from lightning_avgpipe.autotune import AdvanceSearch
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.cpu import host_memory_bytes
from lightning_avgpipe.elastic import ElasticAveraging
from lightning_avgpipe.partition import partition_layers
from lightning_avgpipe.plugin.bridge import Anchor, Elsewhere, Guard, StepBridge, guard_layers, replay_logs
from lightning_avgpipe.plugin.contract import PipelineContractError, locate, pipeline_inputs, pipeline_layers
from lightning_avgpipe.plugin.data import GroupedBatches
from lightning_avgpipe.plugin.gradients import clip_grad_norm_across
from lightning_avgpipe.plugin.optim import ElasticOptimizer, clone_optimizer
from lightning_avgpipe.plugin.resume import checkpoint_layout, resuming_from
from lightning_avgpipe.replicas import BatchedReplicas, select, stack
from lightning_avgpipe.runtime import Link, StageExecutor
from lightning_avgpipe.runtime.p2p import PeerFailureError, first_failure, report_failure
from lightning_avgpipe.runtime.trace import ActivationMeter, StepTrace, write_trace
from lightning_avgpipe.runtime.watchdog import Watchdog
from lightning_avgpipe.schedules import Plan, build_plan, validate_plan

log = logging.getLogger(__name__)


class AvgPipeStrategy(ParallelStrategy):
    """Pipeline-parallel training: the model's layers split over ``num_stages`` processes, micro-batches in flight.

    The result equals plain training with gradient accumulation over the same micro-batches: the schedule and
    the partition change speed and memory, never the arithmetic.

    Args:
        num_stages: processes per pipeline. ``None`` uses every device of the job. Raise it when the model does not
            fit one device; lower it when stages are too short to hide communication.
        num_microbatches: micro-batches per batch (``None``: 2 x stages). More micro-batches shrink the idle
            bubble, ``(S - 1) / (M + S - 1)`` of each step, but each one is smaller and runs less efficiently; the
            DataLoader's batch size must be at least this.
        schedule: ``"1f1b"`` keeps at most ``S - s`` micro-batches of activations on stage ``s`` (the default);
            ``"afab"`` (GPipe) runs all forwards first, which keeps all ``M`` and communicates less often;
            ``"advance"`` sits between them with ``advance_forwards`` extra early forwards.
        advance_forwards: early forwards per stage for ``schedule="advance"``; 0 is 1F1B, ``units - 1`` is AFAB.
            ``"auto"`` (the default) starts at 0 and raises k by one every few iterations while iterations get
            faster beyond noise and ``memory_limit`` holds, then keeps it (the choice and why are logged).
        memory_limit: the peak memory a stage may use when ``advance_forwards="auto"`` raises k: bytes, or a
            fraction (<= 1) of the device's memory (of RAM on CPU, where activation bytes are what is measured).
        partition: ``"balanced"`` profiles each layer on ``LightningModule.example_input_array`` and splits to
            even out forward+backward time (falls back to ``"parameters"`` without an example input);
            ``"parameters"`` evens out parameter bytes; ``"uniform"`` layer counts; or a list of layer counts per
            stage, e.g. ``[3, 5]``.
        num_pipelines: N parallel pipelines: every stage process holds its stage of N replicas, each training on
            its own batch of the DataLoader's size B, tied to a reference model by elastic averaging. One
            iteration then carries N x M micro-batches (bubble (S-1)/(N·M+S-1)) without a bigger batch for any
            replica, at the cost of N weight copies and optimizer states per stage. 1 is plain pipeline training.
        elastic_alpha: how far each replica moves toward the reference per step; ``None`` is 1/(N x groups).
            Lower it if replicas should explore more, raise it (at most 1) to keep them closer.
        sync_reference: finish the reference update across pipeline groups inside the step; by default the
            all-reduce overlaps the next iteration (the reference is at most one iteration stale).
        replica_execution: ``"sequential"`` runs N x M units through the schedule, one replica's micro-batch
            each (the smallest bubble); ``"batched"`` runs M units, each stacking micro-batch m of all N replicas
            into one ``torch.func.vmap`` call over stacked weights: fewer, larger operations, for micro-batches
            too small to keep a device busy (layers must have no buffers).
        p2p: ``"eager"`` posts each receive one compute early as its own operation (overlaps transfers, best on
            gloo); ``"batched"`` posts receives just in time and issues each run of communication as one
            ``batch_isend_irecv`` group, which NCCL needs to avoid deadlock; ``"auto"`` picks by backend.
        trace_dir: a folder for timelines of the steps in ``trace_steps``: ``step<N>.json`` (Chrome trace, opens
            in Perfetto; a track per rank with compute by unit, waits and sends) and ``step<N>.png`` (a Gantt chart).
        trace_steps: the training steps (``global_step``) to trace.
        p2p_timeout: seconds a stage waits, after the first training step, for a neighbour's activations or
            gradients before the job fails naming that neighbour. Raise it if one step of a stage legitimately
            takes longer (very large models); lower it to fail faster.
        timeout: seconds a collective (and a point-to-point wait in the first step) may block before failing.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks by device.
    """

    strategy_name = "avgpipe"

    def __init__(
        self,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        schedule: str = "1f1b",
        advance_forwards: int | str = "auto",
        memory_limit: float | None = None,
        partition: str | list[int] = "balanced",
        num_pipelines: int = 1,
        elastic_alpha: float | None = None,
        sync_reference: bool = False,
        replica_execution: str = "sequential",
        p2p: str = "auto",
        trace_dir: str | None = None,
        trace_steps: list[int] | None = None,
        p2p_timeout: float = 30.0,
        timeout: float = 1800.0,
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = PipelineConfig(
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            advance_forwards=advance_forwards,
            memory_limit=memory_limit,
            partition=partition,
            num_pipelines=num_pipelines,
            elastic_alpha=elastic_alpha,
            sync_reference=sync_reference,
            replica_execution=replica_execution,
            p2p=p2p,
            trace_dir=trace_dir,
            trace_steps=tuple(trace_steps) if trace_steps is not None else (2,),
            p2p_timeout=p2p_timeout,
            timeout=timeout,
        )
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._num_stages: int | None = None
        self._pipeline_group: Any = None
        self._pipeline_ranks: list[int] = []
        self._partition: list[int] | None = None
        self._executor: StageExecutor | None = None
        self._bridge: StepBridge | None = None
        self._guard = Guard()
        self._hook_handles: list[Any] = []
        self._plans: dict[tuple[bool, int, int], Plan] = {}
        self._stage_params: list[nn.Parameter] = []
        self._grad_stash: list[Tensor | None] | None = None
        self._full_keys: list[str] = []
        self._full_batch: int | None = None
        self._example_input: Any = None
        self._owned: list[nn.Module] = []
        self._replica_fns: list[Any] = []
        self._batched: BatchedReplicas | None = None
        self._meter: ActivationMeter | None = None
        k = self.config.advance_forwards
        self._k: int = 0 if k == "auto" else int(k)
        self._search: AdvanceSearch | None = None
        self._trace: StepTrace | None = None
        self._stage_group: Any = None
        self._topology_of: Any = None  # the default process group the pipeline and stage groups were made in
        self._elastic: ElasticAveraging | None = None
        self._step_started: float | None = None
        self._watchdog: Watchdog | None = None

    # -- topology ------------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's accelerator connector (hasattr): samplers and sync_dist logging need it.
        return True

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("AvgPipeStrategy has no LightningModule yet; the Trainer attaches it in fit/validate.")
        return module

    @property
    def num_stages(self) -> int:
        """Stages per pipeline (known once processes are up)."""
        if self._num_stages is None:
            raise RuntimeError("AvgPipeStrategy.num_stages is known once the trainer has set up its processes.")
        return self._num_stages

    @property
    def stage(self) -> int:
        """This rank's stage index."""
        return self.global_rank % self.num_stages

    @property
    def group_index(self) -> int:
        """This rank's pipeline group (data-parallel index)."""
        return self.global_rank // self.num_stages

    @property
    def partition(self) -> list[int]:
        """Layers per stage, once decided at setup."""
        if self._partition is None:
            raise RuntimeError("The partition is decided in AvgPipeStrategy.setup(); it is not known yet.")
        return list(self._partition)

    @property
    def _batched_p2p(self) -> bool:
        mode = self.config.p2p
        return mode == "batched" or (mode == "auto" and self._process_group_backend == "nccl")

    @property
    def num_groups(self) -> int:
        """D, the pipeline groups (data-parallel degree): world size / stages."""
        return self.world_size // self.num_stages

    @property
    def num_pipelines(self) -> int:
        return self.config.num_pipelines

    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches_for(self.num_stages)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of a pipeline group read the same batches; only groups get distinct shards.
        return {"num_replicas": self.num_groups, "rank": self.group_index}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=timedelta(seconds=self.config.timeout))
        self._setup_topology()
        if self.world_size > 1 and self._watchdog is None:
            self._watchdog = Watchdog(
                f"rank {self.global_rank} (stage {self.stage})", grace=self.config.p2p_timeout
            ).start()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _setup_topology(self) -> None:
        world = self.world_size
        default = dist.group.WORLD if world > 1 else None
        if self._num_stages is not None and default is not None and self._topology_of is default:
            return  # setup_environment runs on every fit/validate/test/predict: make the groups once per process group
        self._topology_of = default
        stages = self.config.num_stages or world
        if world % stages != 0:
            raise ValueError(
                f"devices x num_nodes = {world} is not a multiple of num_stages={stages}; use a number of devices that "
                f"num_stages divides (for example {stages * max(1, world // stages)}), or change num_stages."
            )
        groups = world // stages
        self._num_stages = stages
        timeout = timedelta(seconds=self.config.timeout)
        # Every rank must create every group, in the same order. Pipeline group d: the S ranks of group d (p2p and
        # the loss broadcast); stage group s: the D ranks holding stage s (averaging reference updates).
        for d in range(groups):
            ranks = list(range(d * stages, (d + 1) * stages))
            group = dist.new_group(ranks, timeout=timeout) if world > 1 else None
            if d == self.group_index:
                self._pipeline_group, self._pipeline_ranks = group, ranks
        for s in range(stages):
            ranks = [d * stages + s for d in range(groups)]
            group = dist.new_group(ranks, timeout=timeout) if world > 1 else None
            if s == self.stage:
                self._stage_group = group

    # -- setup ---------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None and self.model is not None
        self._check_support(module, trainer)
        if self._executor is None:
            self._split(module)
        else:  # a second fit/validate with this strategy: hide the example input and guard the layers again
            module.example_input_array = None
            if not self._hook_handles:
                names = {id(m): n for n, m in module.named_modules()}
                self._hook_handles = guard_layers({names[id(m)]: m for m in self._owned}, self._guard)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._elastic is None:
            self._make_replicas()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_global_clipping()

    def _check_support(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        if not module.automatic_optimization:
            raise PipelineContractError(
                f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
                "strategy='avgpipe' does not support: the strategy runs backward itself. Use automatic optimization."
            )
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and (plugin.precision == "16-mixed" or plugin.scaler is not None):
            raise ValueError(
                "precision='16-mixed' is not supported by strategy='avgpipe': its loss scaler sees only the last "
                "stage's loss. Use precision='bf16-mixed' (no loss scaling needed) or '32-true'."
            )

    def _split(self, module: pl.LightningModule) -> None:
        if any(isinstance(m, Elsewhere) for m in module.modules()):
            raise ValueError(
                f"This {type(module).__name__} was already split into stages by another AvgPipeStrategy (it holds "
                "placeholders for layers that lived on other ranks). Give each Trainer a fresh module, for example "
                "MyModule.load_from_checkpoint(path), or reuse the same Trainer."
            )
        layers = pipeline_layers(module)
        stages, stage = self.num_stages, self.stage
        if len(layers) < stages:
            raise ValueError(
                f"num_stages={stages} is more than the {len(layers)} layers configure_pipeline() returns; use at most "
                f"{len(layers)} stages or split the model into more layers."
            )
        self._full_keys = list(module.state_dict().keys())
        sizes: list[int] | None = None
        if self.global_rank == 0:
            sample = getattr(module, "example_input_array", None)
            spec = self.config.partition
            if spec == "balanced" and sample is None:
                rank_zero_info(
                    "AvgPipe: partition='balanced' profiles layers on `example_input_array`, which this module does "
                    "not set; balancing by parameters instead."
                )
            sizes = self._resumed_partition(module, len(layers)) if isinstance(spec, str) else None
            if sizes is None:
                sizes = partition_layers(layers, stages, spec if isinstance(spec, str) else list(spec), sample)
        sizes = self.broadcast(sizes, src=0)
        assert sizes is not None
        self._partition = list(sizes)
        start = sum(sizes[:stage])
        owned = layers[start : start + sizes[stage]]
        names = {id(m): n for n, m in module.named_modules()}
        for index, layer in enumerate(layers):
            if start <= index < start + sizes[stage]:
                continue
            owner = next(s for s in range(stages) if index < sum(sizes[: s + 1]))
            for parent, attr in locate(module, layer):
                setattr(parent, attr, Elsewhere(names[id(layer)], owner, self._guard))
        # Summaries and graph loggers run forward(example_input_array) on one rank, which a split model cannot do;
        # hide it while the model is split (it is back after teardown).
        self._example_input = getattr(module, "example_input_array", None)
        module.example_input_array = None
        rank_zero_info(
            f"AvgPipe: {stages} stages, layers per stage {sizes}, schedule={self.config.schedule}, "
            f"num_microbatches={self.num_microbatches}."
        )
        self._hook_handles = guard_layers({names[id(m)]: m for m in owned}, self._guard)
        self._owned = owned
        if not any(True for layer in owned for _ in layer.parameters()):
            module._avgpipe_anchor = Anchor()  # a parameter-free stage still builds the user's optimizer
        ranks = self._pipeline_ranks
        link = (
            Link(
                ranks[stage - 1] if stage > 0 else None,
                ranks[stage + 1] if stage < stages - 1 else None,
                self.root_device,
                name=f"stage {stage} (rank {self.global_rank})",
                stage=stage,
            )
            if stages > 1
            else None
        )

        self._executor = StageExecutor(stage, stages, _sequential(owned), link, coalesce=self._batched_p2p)
        self._bridge = StepBridge(module, self._guard)
        for metric in module.modules():
            if isinstance(metric, Metric):  # mirrored on every stage: sync each pipeline group's state once
                metric.process_group = self._stage_group

    def _make_replicas(self) -> None:
        """Stage ``s`` of the N replicas, copies of the reference (the module's own layers) on this device."""
        cfg = self.config
        self._elastic = ElasticAveraging(
            self._owned, cfg.num_pipelines, self.num_groups, cfg.elastic_alpha, self._stage_group, cfg.sync_reference,
            device=self.root_device,
        )
        self._stage_params = self._elastic.all_replica_params()
        if not self._elastic.trivial:
            rank_zero_info(
                f"AvgPipe: {cfg.num_pipelines} parallel pipelines x {self.num_groups} groups, elastic alpha "
                f"{self._elastic.alpha:g}, reference update {'synchronous' if cfg.sync_reference else 'overlapped'}."
            )

        self._replica_fns = [_sequential(layers) for layers in self._elastic.replicas]
        if cfg.replica_execution == "batched" and not self._elastic.trivial:
            self._batched = BatchedReplicas(self._elastic.replicas)
        self._meter = ActivationMeter(self._stage_params)

    @property
    def elastic(self) -> ElasticAveraging:
        """The replicas and reference of this stage (after setup)."""
        if self._elastic is None:
            raise RuntimeError("AvgPipeStrategy creates the replicas in setup(); they do not exist yet.")
        return self._elastic

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        elastic = self.elastic
        if elastic.trivial:
            return
        user = self.optimizers[0]
        clones = [
            clone_optimizer(user, elastic.replica_params(n), elastic.reference_params)
            for n in range(elastic.num_replicas)
        ]
        self.optimizers = [ElasticOptimizer(user, clones, elastic)]

    def _install_global_clipping(self) -> None:
        group = self._pipeline_group

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
            elastic = self.elastic
            sets = [elastic.replica_params(n) for n in range(elastic.num_replicas)]
            clip_grad_norm_across(sets, float(clip_val), group, device=self.root_device)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: int | float) -> None:
            elastic = self.elastic  # the replicas hold the gradients, not the reference the optimizer lists
            params = [p for n in range(elastic.num_replicas) for p in elastic.replica_params(n) if p.grad is not None]
            if params:
                torch.nn.utils.clip_grad_value_(params, float(clip_val))

        self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- steps ---------------------------------------------------------------------------------------------------
    @property
    def advance_forwards(self) -> int:
        """The k in use: fixed, or where ``advance_forwards="auto"`` currently is."""
        return self._k

    def _plan(self, training: bool, units: int) -> Plan:
        k = self._k if training else 0
        key = (training, units, k)
        if key not in self._plans:
            cfg = self.config
            batched = self._batched_p2p
            plan = build_plan(cfg.schedule, self.num_stages, units, k, training, int(not batched))
            self._plans[key] = validate_plan(plan, nccl=batched)
        return self._plans[key]

    def _microbatches(self, batch: Any, training: bool) -> tuple[list[Any], list[float]]:
        size = microbatch.batch_size(batch)
        m = self.num_microbatches
        if training:
            if self._full_batch is None:
                self._full_batch = size
            if size > self._full_batch:
                self._full_batch = size
        if size < m:
            if training and size == self._full_batch:
                raise ValueError(
                    f"The batch has {size} samples but num_microbatches={m}; use a DataLoader batch_size of at least "
                    f"{m} or fewer micro-batches."
                )
            m = size  # a short last batch of an epoch: one sample per micro-batch
        elif training and size == self._full_batch and size % m:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            raise ValueError(
                f"A batch of {size} samples does not split into num_microbatches={m} equal micro-batches; use a "
                f"DataLoader batch_size divisible by {m} (e.g. {size + m - size % m}) or num_microbatches in "
                f"{divisors}. (A shorter last batch of an epoch may split unevenly: losses are weighted by size.)"
            )
        micro = microbatch.split(batch, m)
        return micro, [microbatch.batch_size(mb) / size for mb in micro]

    def _run(self, hook: str, batch: Any, args: Sequence[Any], training: bool) -> dict[int, Any]:
        """Run one batch (training: N batches, one per replica) through the pipeline; last stage: unit -> value.

        Units are (replica, micro-batch) pairs, replica-major. In training a unit's loss is weighted by its share
        of its replica's batch (each replica's gradient is its own batch mean); what is logged or reported is
        weighted by its share of all N batches (the mean over replicas).
        """
        assert self._executor is not None and self._bridge is not None
        module = self._module
        replicas = self.num_pipelines if training else 1
        batches = batch if replicas > 1 else [batch]
        if len(batches) != replicas:
            raise RuntimeError(f"expected {replicas} batches (one per parallel pipeline), got {len(batches)}")
        micro: list[Any] = []
        weights: list[float] = []
        owner: list[int] = []
        for n, b in enumerate(batches):
            parts, shares = self._microbatches(b, training)
            micro += parts
            weights += shares
            owner += [n] * len(parts)
        keys = [(hook, microbatch.signature(mb)) for mb in micro]
        bridge = self._bridge
        accumulate = module.trainer.accumulate_grad_batches if training else 1
        if training and self._batched is not None:
            return self._run_batched(hook, micro, weights, owner, args, accumulate)

        def head(u: int, output: Any) -> Any:
            out = bridge.call_step(hook, output, micro[u], weights[u] / replicas, *args)
            if not training:
                return out
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise PipelineContractError(
                    f"training_step must return a scalar loss tensor (or a dict with 'loss') under strategy='avgpipe', "
                    f"got {type(out).__name__}."
                )
            return loss * (weights[u] / accumulate)

        context = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }[hook]
        results = self._executor.run(
            self._plan(training, len(micro)).stages[self.stage],
            keys,
            training=training,
            inputs=lambda u: pipeline_inputs(module, micro[u]),
            head=head,
            forward_context=context,
            stage_fn_for=(lambda u: self._replica_fns[owner[u]]) if training else None,
            trace=self._trace if training else None,
            meter=self._meter if training else None,
        )
        return results

    def _run_batched(
        self, hook: str, micro: list[Any], weights: list[float], owner: list[int], args: Sequence[Any], accumulate: int
    ) -> dict[int, Any]:
        """Training with ``replica_execution="batched"``: unit m carries micro-batch m of every replica, stacked."""
        assert self._executor is not None and self._bridge is not None and self._batched is not None
        module, bridge, n = self._module, self._bridge, self.num_pipelines
        per = [[u for u in range(len(micro)) if owner[u] == r] for r in range(n)]
        if len({len(units) for units in per}) != 1 or len({microbatch.signature(micro[us[0]]) for us in per}) != 1:
            raise ValueError(
                "replica_execution='batched' needs the N batches of an iteration to have the same shape; use "
                "drop_last=True in the DataLoader or replica_execution='sequential'."
            )
        units = [[per[r][m] for r in range(n)] for m in range(len(per[0]))]  # unit m -> its N micro-batches
        keys = [(hook, "batched", microbatch.signature(micro[us[0]])) for us in units]

        def head(m: int, output: Any) -> Tensor:
            total: Tensor | None = None
            for r, u in enumerate(units[m]):
                out = bridge.call_step(hook, select(output, r), micro[u], weights[u] / n, *args)
                loss = out.get("loss") if isinstance(out, Mapping) else out
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise PipelineContractError(
                        "training_step must return a scalar loss tensor (or a dict with 'loss'), got "
                        f"{type(out).__name__}."
                    )
                term = loss * (weights[u] / accumulate)
                total = term if total is None else total + term
            assert total is not None
            return total

        batched = self._batched
        return self._executor.run(
            self._plan(True, len(units)).stages[self.stage],
            keys,
            training=True,
            inputs=lambda m: stack([pipeline_inputs(module, micro[u]) for u in units[m]]),
            head=head,
            forward_context=self.precision_plugin.train_step_context,
            stage_fn_for=lambda m: batched,
            trace=self._trace,
            meter=self._meter,
        )

    def _share(self, payload: Any) -> Any:
        """Broadcast ``payload`` from this pipeline's last stage to its other stages."""
        if self.num_stages == 1:
            return payload
        box = [payload]
        src = self._pipeline_ranks[-1]
        try:
            dist.broadcast_object_list(box, src=src, group=self._pipeline_group)
        except RuntimeError as err:
            raise PeerFailureError(
                f"stage {self.stage} (rank {self.global_rank}): the step's results from rank {src} (stage "
                f"{self.num_stages - 1}, the last) did not arrive: a rank of this pipeline failed, was killed or is "
                f"stuck. {first_failure()}({str(err).splitlines()[0][:160]})"
            ) from err
        return box[0]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Each training iteration gives every one of the N pipelines its own batch of the user's size B.
        module = self.lightning_module
        if self.num_pipelines > 1 and module is not None and module.trainer.training:
            return GroupedBatches(dataloader, self.num_pipelines)
        return dataloader

    def _log_progress(self, batch: Any) -> None:
        """Log samples/s over the last iteration (not counting time spent in validation in between)."""
        now = time.perf_counter()
        batches = batch if self.num_pipelines > 1 else [batch]
        if self._step_started is not None and now > self._step_started:
            samples = sum(microbatch.batch_size(b) for b in batches) * self.num_groups
            rate = samples / (now - self._step_started)
            self._module.log("avgpipe/samples_per_sec", rate, on_step=True, on_epoch=False)
        self._step_started = now

    def _log_step_figures(self) -> None:
        """Per step: bubble fraction, communication wait and peak activation memory of every stage (one
        all-gather over the pipeline), and the timeline when this step is traced."""
        trace, module = self._trace, self._module
        if trace is None:
            return
        figures = trace.summary()  # step, compute, wait, bubble, peak activation bytes (what the stash holds)
        if self.root_device.type == "cuda":  # and the allocator's peak, weights and optimizer states included
            figures.append(float(torch.cuda.max_memory_allocated(self.root_device)))
            torch.cuda.reset_peak_memory_stats(self.root_device)
        else:  # no allocator statistics: what the stage's tensors hold (counted) plus the activation peak
            figures.append(figures[4] + self._static_bytes())
        mine = torch.tensor(figures, dtype=torch.float64, device=self.root_device)
        rows = [mine]
        if self.num_stages > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.num_stages)]
            dist.all_gather(rows, mine, group=self._pipeline_group)
        table = torch.stack(rows).cpu()  # (S, 6): step, compute, wait, bubble, activation peak, device peak
        module.log("avgpipe/bubble_fraction", float(table[:, 3].mean()), on_step=True, on_epoch=False)
        module.log("avgpipe/comm_wait_s", float(table[:, 2].max()), on_step=True, on_epoch=False)
        for s in range(self.num_stages):
            module.log(f"avgpipe/peak_memory_mb/stage{s}", float(table[s, 5]) / 2**20, on_step=True, on_epoch=False)
        step = module.trainer.global_step
        cfg = self.config
        if cfg.trace_dir is not None and step in cfg.trace_steps:
            self._write_trace(step, trace)
        if cfg.schedule == "advance":
            module.log("avgpipe/advance_forwards", float(self._k), on_step=True, on_epoch=False)
            if cfg.advance_forwards == "auto":
                self._search_k(table)

    def _static_bytes(self) -> float:
        """Bytes of this stage's weights (replicas and reference), gradients, optimizer states and averaging buffers."""
        elastic = self.elastic
        seen: set[int] = set()

        def count(tensors: Any) -> int:
            total = 0
            for t in tensors:
                if isinstance(t, Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            return total

        grads = self._grad_stash or [p.grad for p in self._stage_params]
        optimizers = [o for opt in self.optimizers for o in getattr(opt, "replicas", [opt])]
        states = [v for opt in optimizers for st in opt.state.values() for v in st.values()]
        buffers = [t for offsets in (elastic._offsets or []) for t in offsets] + [elastic._flat]
        return float(
            count(self._stage_params) + count(elastic.reference_params) + count(grads) + count(states) + count(buffers)
        )

    def reconfigure(
        self,
        num_microbatches: int | None = None,
        num_pipelines: int | None = None,
        advance_forwards: int | str | None = None,
    ) -> None:
        """Change M, N or k before training starts (the tuner calls it in ``on_fit_start``).

        A new N re-makes the replicas from the reference and the optimizers (``configure_optimizers`` runs again);
        every rank must call it with the same values.
        """
        changes: dict[str, Any] = {}
        if num_microbatches is not None:
            changes["num_microbatches"] = num_microbatches
        if num_pipelines is not None:
            changes["num_pipelines"] = num_pipelines
        if advance_forwards is not None:
            changes["advance_forwards"] = advance_forwards
        old = self.config
        self.config = replace(old, **changes)
        self._plans.clear()
        self._full_batch = None
        if advance_forwards is not None:
            self._search = None
            self._k = 0 if advance_forwards == "auto" else int(advance_forwards)
        if self.config.num_pipelines != old.num_pipelines and self._elastic is not None:
            self._elastic.wait()
            self._elastic = None
            self._batched = None
            self._make_replicas()
            module = self._module
            if module.trainer.state.fn == TrainerFn.FITTING:
                # A loader already grouped for the old N (trainer.estimated_stepping_batches sets it up early) is
                # set up again, and configure_optimizers then sees the new number of iterations per epoch.
                module.trainer.fit_loop._combined_loader = None
                self.setup_optimizers(module.trainer)
                _optimizers_to_device(self.optimizers, self.root_device)
        rank_zero_info(
            f"AvgPipe: reconfigured to num_microbatches={self.num_microbatches}, num_pipelines={self.num_pipelines}"
            + (f", advance_forwards={self.config.advance_forwards}" if self.config.schedule == "advance" else "")
            + "."
        )

    def _search_k(self, table: Tensor) -> None:
        """One observation for ``advance_forwards="auto"``; the decision comes from global rank 0 to every rank."""
        # the plan's units: N x M, or M when the replicas of a micro-batch run as one batched unit
        units = self.num_microbatches * (1 if self._batched is not None else self.num_pipelines)
        if self._search is None:
            self._search = AdvanceSearch(max_k=max(0, units - 1), memory_limit=self._memory_limit_bytes())
        search = self._search
        if search.settled:
            return
        S, k = self.num_stages, self._k
        stash = [min(units, S - s + k) for s in range(S)]  # units in flight at the peak (DESIGN.md §5)
        unit_bytes = [float(table[s, 4]) / max(1, stash[s]) for s in range(S)]
        search.observe(float(table[:, 0].max()), [float(v) for v in table[:, 4]], unit_bytes)
        decision = torch.tensor([search.k, int(search.settled)], dtype=torch.int64, device=self.root_device)
        if self.world_size > 1:
            dist.broadcast(decision, src=0)
        search.k, search.settled = int(decision[0]), bool(decision[1])
        self._k = search.k
        if search.settled:
            rank_zero_info(f"AvgPipe: advance_forwards='auto' {search.reason or f'settled on {search.k} (rank 0)'}.")

    def _memory_limit_bytes(self, limit: float | None = None) -> float | None:
        """``limit`` (default: the configured ``memory_limit``) in bytes: a fraction (<= 1) is of device memory."""
        limit = self.config.memory_limit if limit is None else limit
        if limit is None or limit > 1:
            return limit
        if self.root_device.type == "cuda":
            total = torch.cuda.get_device_properties(self.root_device).total_memory
        else:  # the stage processes on this machine share its memory (or the container's limit)
            total = host_memory_bytes() // max(1, self.num_processes)
        return float(limit) * total

    def _write_trace(self, step: int, trace: StepTrace) -> None:
        spans = trace.spans
        if self.num_stages > 1:
            gathered: list[Any] | None = [None] * self.num_stages if self.stage == 0 else None
            dist.gather_object(spans, gathered, dst=self._pipeline_ranks[0], group=self._pipeline_group)
        else:
            gathered = [spans]
        if gathered is None or self.group_index != 0:
            return
        cfg = self.config
        assert cfg.trace_dir is not None
        names = [f"stage {s} (rank {r})" for s, r in enumerate(self._pipeline_ranks)]
        title = (
            f"step {step}: {cfg.schedule}"
            + (f" k={self._k}" if cfg.schedule == "advance" else "")
            + f", S={self.num_stages}, M={self.num_microbatches}, N={self.num_pipelines}"
        )
        json_path, png_path = write_trace(Path(cfg.trace_dir) / f"step{step}.json", gathered, title, names)
        also = f" and {png_path}" if png_path else ""
        rank_zero_info(f"AvgPipe: timeline of step {step} written to {json_path}{also}")

    def _log_divergence(self) -> None:
        """With replicas: ‖w_n − w_ref‖ / ‖w_ref‖ over all stages, mean and max over replicas.

        Measured after this step's pipeline, once the previous step's reference update has landed (so an
        overlapped all-reduce still had the whole pipeline to hide behind), and only on the steps whose logs
        Lightning writes (every ``log_every_n_steps``): N passes over the stage's weights and an all-reduce that
        holds the stages together cost 2-5% of an N = 4 step on CPU, for a figure no logger would record.
        """
        module, elastic = self._module, self.elastic
        if elastic.trivial or not _writes_logs(module.trainer):
            return
        elastic.wait()
        sums = torch.stack(elastic.divergence())  # (N, 2): ‖w_n - w_ref‖², ‖w_ref‖² on this stage
        if self.num_stages > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self._pipeline_group)
        divergence = sums[:, 0].sqrt() / sums[:, 1].sqrt().clamp_min(1e-12)
        module.log("avgpipe/divergence", divergence.mean(), on_step=True, on_epoch=False)
        module.log("avgpipe/divergence_max", divergence.max(), on_step=True, on_epoch=False)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch, rest = args[0], args[1:]
        params = self._stage_params
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._log_progress(batch)
        self._trace = StepTrace(self.stage)
        if self._meter is not None:
            self._meter.reset()
        self.elastic.follow_reference()  # frozen or unfrozen layers, eval-mode BatchNorm: as the user's module has them
        try:
            if self._batched is not None:
                self._batched.begin()
            results = self._run("training_step", batch, rest, training=True)
            if self._batched is not None:
                self._batched.finish()
            self._log_divergence()
        finally:
            # Lightning zeroes gradients after training_step; keep this step's apart until backward() adds them.
            self._grad_stash = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g
        self._check_finite(results)
        payload = None
        if self._executor is not None and self._executor.is_last:
            accumulate = self._module.trainer.accumulate_grad_batches
            loss = torch.stack([r.float() for r in results.values()]).sum() * accumulate / self.num_pipelines
            payload = (loss.cpu(), self._bridge.take_logs() if self._bridge else [])
        loss, logs = self._share(payload)
        self._log_step_figures()
        if self._executor is not None and self._executor.link is not None:
            self._executor.link.timeout = self.config.p2p_timeout  # the first step may be slow; later ones are bounded
        replay_logs(self._module, logs, self.root_device)
        loss = loss.to(self.root_device)
        if not self.elastic.trivial:  # the mean over replicas, whatever the user logs
            self._module.log("avgpipe/loss", loss, on_step=True, on_epoch=False)
        return loss

    def _check_finite(self, results: Mapping[int, Any]) -> None:
        """Fail, naming stage, replica and where, on a non-finite loss (last stage) or gradient (every stage).

        One reduction per step; the other ranks then stop with a message that names this rank as the first failure.
        """
        where = f"stage {self.stage} (rank {self.global_rank})"
        fix = "lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)) or check the data"
        if results:
            losses = torch.stack([r.detach().float() for r in results.values()])
            if not bool(torch.isfinite(losses).all()):
                units = [u for u, r in results.items() if not bool(torch.isfinite(r))]
                raise FloatingPointError(f"{where}: the loss of unit(s) {units} is not finite; {fix}.")
        stash = self._grad_stash or []
        grads = [g for g in stash if g is not None]
        if not grads:
            return
        norms = torch.stack(torch._foreach_norm(grads))
        if bool(torch.isfinite(norms).all()):
            return
        per_replica = len(self._stage_params) // max(1, self.elastic.num_replicas)
        qualified = {id(p): n for n, p in self._module.named_parameters()}
        reference = self.elastic.reference_params
        for i, g in enumerate(stash):
            if g is not None and not bool(torch.isfinite(g).all()):
                replica, j = divmod(i, max(1, per_replica))
                name = qualified.get(id(reference[j]), f"parameter {j}") if j < len(reference) else f"parameter {j}"
                raise FloatingPointError(
                    f"{where}: a non-finite gradient in replica {replica}, layer parameter '{name}'; {fix}."
                )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The pipeline already ran every backward inside training_step; here the hooks run and the gradients land.
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        stash, self._grad_stash = self._grad_stash, None
        if stash is not None:
            for p, g in zip(self._stage_params, stash):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval(self, hook: str, args: Sequence[Any], share_output: bool) -> Any:
        if self._elastic is not None:
            self._elastic.wait()  # evaluate the up-to-date reference
        self._step_started = None  # the next training step's samples/s must not include this evaluation
        results = self._run(hook, args[0], args[1:], training=False)
        payload = None
        output = None
        if self._executor is not None and self._executor.is_last:
            output = microbatch.merge([results[u] for u in sorted(results)])
            logs = self._bridge.take_logs() if self._bridge else []
            payload = (_cpu(output) if share_output else None, logs)
        shared, logs = self._share(payload)
        replay_logs(self._module, logs, self.root_device)
        if share_output and output is None:
            output = shared
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("validation_step", args, share_output=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("test_step", args, share_output=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval("predict_step", args, share_output=True)

    # -- collectives ---------------------------------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        # Every stage of a pipeline holds the same (mirrored) logged values: reduce over the D ranks that hold this
        # stage, so self.log(..., sync_dist=True) counts each pipeline group once, whatever reduce_fx is.
        if isinstance(tensor, Tensor):
            group = group if group is not None else self._stage_group
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def _gather(self, obj: Any) -> list[Any] | None:
        """Gather ``obj`` from every stage of this pipeline onto its first stage (other ranks get ``None``)."""
        if self.num_stages == 1:
            return [obj]
        dst = self._pipeline_ranks[0]
        out: list[Any] | None = [None] * self.num_stages if self.global_rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self._pipeline_group)
        return out

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit model's state dict, under its own names, assembled on rank 0 (empty elsewhere)."""
        if self._elastic is not None:
            self._elastic.wait()  # the checkpoint holds the up-to-date reference
        local = {k: v.detach().cpu() for k, v in self._module.state_dict().items()}
        parts = self._gather(local)
        if parts is None:
            return {}
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        missing = [k for k in self._full_keys if k not in merged]
        if missing:
            raise RuntimeError(f"Assembling the checkpoint lost keys {missing[:5]}; this is a bug in AvgPipeStrategy.")
        ordered = {k: merged.pop(k) for k in self._full_keys}
        ordered.update(merged)
        return ordered

    def _resumed_partition(self, module: pl.LightningModule, num_layers: int) -> list[int] | None:
        """On a resumed ``fit``, the partition the checkpoint was saved with (when it fits this model and S).

        ``"balanced"`` times the layers, and timing noise gives another cut from run to run; a resumed run must cut
        as the checkpoint did, or its optimizer states and replicas would be dropped as another layout's.
        """
        trainer = getattr(module, "_trainer", None)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        path = resuming_from(trainer)
        layout = checkpoint_layout(path) if path is not None else None
        saved = layout.get("partition") if layout else None
        if (not isinstance(saved, list) or len(saved) != self.num_stages or sum(saved) != num_layers
                or min(saved) < 1):
            return None
        rank_zero_info(f"AvgPipe: resuming; cutting the model as the checkpoint was cut, partition={saved}.")
        return [int(v) for v in saved]

    @property
    def _layout(self) -> dict[str, Any]:
        return {
            "stages": self.num_stages,
            "groups": self.num_groups,
            "pipelines": self.num_pipelines,
            "partition": self.partition,
        }

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every rank's optimizer state (and its replicas' weights when N·D > 1), gathered on rank 0.

        Saved as ``{"avgpipe_layout": {...}, "avgpipe_ranks": [per global rank {"optim", "replicas"}]}`` so a
        resume with the same layout continues exactly.
        """
        inner = getattr(optimizer, "_optimizer", optimizer)
        elastic = self.elastic
        replicas = (
            []
            if elastic.trivial
            else [[_cpu(m.state_dict()) for m in layers] for layers in elastic.replicas]
        )
        entry = {"optim": inner.state_dict(), "replicas": replicas}
        if self.world_size == 1:
            parts: list[Any] | None = [entry]
        else:
            parts = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(entry, parts, dst=0)
        if parts is None:
            return {}
        return {"avgpipe_layout": self._layout, "avgpipe_ranks": parts}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self._module
        full = checkpoint["state_dict"]
        local_keys = module.state_dict().keys()
        missing = [k for k in local_keys if k not in full]
        if strict and missing:
            raise KeyError(
                f"The checkpoint lacks {missing[:5]} that stage {self.stage} holds; it was saved from another model."
            )
        module.load_state_dict({k: full[k] for k in local_keys if k in full}, strict=False)
        self.elastic.reset_replicas()  # replicas restart from the loaded reference unless the checkpoint has them

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint.get("optimizer_states", [])
        for optimizer, state in zip(self.optimizers, states):
            if "avgpipe_layout" not in state:
                raise ValueError(
                    "This checkpoint's optimizer state was not saved by AvgPipeStrategy and cannot be split by stage; "
                    "load its weights with MyModule.load_from_checkpoint(path) and start a new fit instead."
                )
            if state["avgpipe_layout"] != self._layout:
                rank_zero_info(
                    f"AvgPipe: the checkpoint's layout {state['avgpipe_layout']} differs from {self._layout}; the "
                    "weights and the optimizer's hyperparameters (lr, ...) are restored, the replicas start from the "
                    "reference and optimizer states start fresh."
                )
                saved = state["avgpipe_ranks"][0]["optim"]
                groups = saved.get("user_param_groups") or [
                    {k: v for k, v in g.items() if k != "params"} for g in saved.get("param_groups", [])
                ]
                if len(groups) == len(optimizer.param_groups):
                    for group, values in zip(optimizer.param_groups, groups):
                        group.update({k: v for k, v in values.items() if k != "params"})
                continue
            entry = state["avgpipe_ranks"][self.global_rank]
            optimizer.load_state_dict(entry["optim"])
            for layers, saved in zip(self.elastic.replicas, entry["replicas"]):
                for layer, layer_state in zip(layers, saved):
                    layer.load_state_dict(layer_state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load and verify a checkpoint; a truncated or corrupt file is named with what to do instead."""
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # unpickling, zip and EOF errors all mean the same to the user
            raise ValueError(
                f"Cannot read the checkpoint {checkpoint_path}: it is truncated or corrupt ({type(err).__name__}: "
                f"{str(err)[:200]}). AvgPipeStrategy renames a checkpoint into place only once it is complete, so "
                "resume from the previous checkpoint (ModelCheckpoint keeps them under its dirpath)."
            ) from err
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        missing = [k for k in ("state_dict", "optimizer_states") if k not in checkpoint]
        if not fitting and "state_dict" in checkpoint:
            missing = []  # validate/test/predict need only the weights (save_weights_only checkpoints)
        if missing:
            raise ValueError(f"The checkpoint {checkpoint_path} lacks {missing}; it is not a training checkpoint.")
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write on rank 0 to a temporary file, then rename: a crash never leaves a half-written checkpoint.

        Remote paths (``s3://...``) and ``AsyncCheckpointIO`` go straight to the checkpoint IO: a local rename cannot
        address the one, and would run before the other's background write.
        """
        if not self.is_global_zero:
            return
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        text = str(filepath)
        if ("://" in text and not text.startswith("file://")) or isinstance(self.checkpoint_io, AsyncCheckpointIO):
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        path = Path(text[len("file://"):] if text.startswith("file://") else text)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The rank where a failure starts records it, so the others' messages name it (not just their neighbour).
        # A neighbour's timeout is recorded too (unless something was first): then a rank stuck while alive, which
        # raises nothing, is ended by its watchdog.
        if _distributed_is_initialized():
            stage = f"stage {self.stage}" if self._num_stages else "setup"
            report_failure(f"rank {self.global_rank} ({stage}): {type(exception).__name__}: {str(exception)[:200]}")

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._elastic is not None:
            self._elastic.wait()  # the model the user keeps is the up-to-date reference
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        module = self.lightning_module
        if module is not None and self._example_input is not None:
            module.example_input_array = self._example_input
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="AvgPipe pipeline parallelism (lightning_avgpipe)"
            )


def _cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _sequential(layers: Sequence[nn.Module]) -> Any:
    """The layers applied in order (what nn.Sequential does, without registering them anywhere)."""

    def stage_fn(x: Any) -> Any:
        for layer in layers:
            x = layer(x)
        return x

    return stage_fn


def _writes_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (the same answer on every rank: it counts steps)."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
