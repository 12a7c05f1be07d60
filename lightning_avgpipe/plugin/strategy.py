"""AvgPipeStrategy: Lightning's hooks, each delegating to the stage pipeline, the split or the checkpoint layout.

The step itself lives in :class:`~lightning_avgpipe.runtime.pipeline.StagePipeline` (no Lightning there); this class
maps Lightning's life cycle onto it (docs/how-it-works.md#lightning-integration).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_avgpipe.checks import check_flag
from lightning_avgpipe.config import CONFIG_FIELDS, PipelineConfig
from lightning_avgpipe.plugin.checkpoint import streamed
from lightning_avgpipe.plugin.checkpoint.hooks import CheckpointHooks
from lightning_avgpipe.plugin.checkpoint.resume import refuse_interrupted_last
from lightning_avgpipe.plugin.compat import _optimizers_to_device, _StrategyRegistry, _sync_ddp_if_available
from lightning_avgpipe.plugin.split import tensor, whole
from lightning_avgpipe.plugin.split.cut import CutInputs, cut_module
from lightning_avgpipe.plugin.split.placeholders import Guard
from lightning_avgpipe.plugin.split.stages import SplitModule, check_supported, metrics_sync_over, recorded_build
from lightning_avgpipe.plugin.steps.bridge import StepBridge
from lightning_avgpipe.plugin.steps.data import GroupedBatches, same_order_on_every_rank
from lightning_avgpipe.plugin.steps.gradients import install_clipping
from lightning_avgpipe.plugin.steps.hooks import (
    PipelineSteps,
    announce_averaging,
    announce_checkpointing,
    announce_sequence,
    announce_sharding,
)
from lightning_avgpipe.plugin.steps.precision import for_pipeline
from lightning_avgpipe.plugin.tuner_surface import TunerSurface
from lightning_avgpipe.runtime.build.init_record import InitRecord
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.controller import StepController
from lightning_avgpipe.runtime.failures.report import guarded
from lightning_avgpipe.runtime.failures.shutdown import failed
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.streams import RandomStreams
from lightning_avgpipe.runtime.sync.ties import TiedWeights


class AvgPipeStrategy(CheckpointHooks, TunerSurface):
    """Pipeline-parallel training: the model's layers split over ``num_stages`` processes, micro-batches in flight.

    The result equals plain training with gradient accumulation over the same micro-batches (docs/strategy.md).

    Args:
        num_stages: stages per pipeline; ``None`` uses every device of the job (world size / T under tensor
            parallelism: one pipeline group).
        num_microbatches: micro-batches per batch (``None``: 2 x stages): more shrink the bubble,
            ``(S - 1) / (M + S - 1)`` of a step, but each is smaller and runs less efficiently.
        schedule: ``"1f1b"`` keeps at most ``S - s`` micro-batches' activations on stage ``s`` (the default);
            ``"afab"`` (GPipe) keeps all ``M``; ``"advance"`` sits between with ``advance_forwards`` early forwards.
            ``"zbh1"`` is 1F1B with the backward split in two, the input gradient first and the weight gradient
            deferred into the bubbles (zero bubble H1: about a third of 1F1B's bubble at 1F1B's memory peak);
            ``"zbadvance"`` the advance forward with that split.
        advance_forwards: early forwards on every stage but the last for ``schedule="advance"`` (or
            ``"zbadvance"``); 0 is 1F1B. ``"auto"`` (the default) starts at 0 and raises k while iterations get
            faster beyond noise and ``memory_limit`` holds, then keeps it (the choice and why are logged).
        stages_per_rank: v, the model chunks every rank runs under ``schedule="interleaved"`` (loop placement: rank r
            runs stages r, S + r, ...) or ``"zbv"`` (2, a V: stages r and 2S - 1 - r); ``None``: 2 for those, 1
            otherwise. The model is cut into S·v stages; a list ``partition`` gives all S·v counts in stage order.
        schedule_costs: one unit's measured (forward, input gradient, weight gradient) times, in any unit, that
            ``"interleaved"`` and ``"zbv"`` place their actions by (``None``: equal; I and W seldom are, and a plan
            placed by the real ratio idles less). ``AvgPipeTuner`` sets them from its profile.
        memory_limit: a stage's peak for ``advance_forwards="auto"``: bytes, or a fraction (<= 1) of its memory.
        partition: ``"balanced"`` evens out profiled forward+backward time (``"parameters"`` without an
            ``example_input_array``); ``"parameters"`` parameter bytes; ``"uniform"`` layer counts; or a list of
            layer counts per stage, e.g. ``[3, 5]`` (S·v of them with ``stages_per_rank`` v).
        num_pipelines: N parallel pipelines: every stage holds N replicas, each training on its own batch of the
            DataLoader's size B (an iteration carries N x M micro-batches, a smaller bubble), combined by
            ``averaging``. 1 is plain pipeline training.
        averaging: how the N batches of a step (and the D pipeline groups) combine: ``"elastic"``, the paper's
            rule, or ``"exact"``: one model, the N x D batches as one batch of N x D x B (docs/strategy.md#averaging).
        outer_lr: elastic averaging's outer optimizer: the reference moves by ``outer_lr`` times the mean update
            (or its momentum). 1.0 and 0.0 are the paper's rule; DiLoCo's preset is 0.7 and 0.9.
        outer_momentum: the outer optimizer's Nesterov momentum in [0, 1).
        averaging_period: H, the local steps every replica takes between elastic pulls and reference updates; the
            all-reduce between pipeline groups then runs every H steps. 1 is the paper's rule.
        elastic_alpha: how far each replica moves toward the reference per step (at most 1); ``None``: 1/(N x D).
        sync_reference: finish the reference update across pipeline groups inside the step; ``None`` (default):
            overlap it with the next iteration, except with a sharded reference (``shard_optimizer_state``), whose
            update is synchronous.
        replica_execution: ``"sequential"`` runs N x M units through the schedule (the smallest bubble);
            ``"batched"`` runs M units, each the N replicas' micro-batch m in one ``torch.func.vmap`` call (fewer,
            larger operations for micro-batches too small to keep a device busy; layers without buffers).
        p2p: ``"eager"`` posts each receive one compute early (best on gloo); ``"batched"`` issues each run of
            communication as one ``batch_isend_irecv`` group (NCCL needs it); ``"auto"`` picks by backend.
        trace_dir: a folder for timelines of the steps in ``trace_steps`` (Chrome-trace JSON and a PNG Gantt chart).
        trace_steps: the training steps (``global_step``) to trace.
        p2p_timeout: seconds a stage waits, after the first training step, for a neighbour before the job fails
            naming it; raise it if one step of a stage legitimately takes longer.
        timeout: seconds a collective (and a point-to-point wait in the first step) may block before failing.
        process_group_backend: ``"gloo"`` or ``"nccl"``; ``None`` picks by device.
        check_forward: at setup, run the whole model once in eval mode on two samples and fail when ``forward`` is
            not the ``configure_pipeline()`` layers applied in order; off only for a model too large for one device.
        trusted_checkpoints: unpickle a checkpoint in full (``weights_only=False``, a folder's ``.metadata`` by plain
            ``pickle``): only for one you wrote that holds more than tensors and plain values; the refusal says so.
        activation_checkpointing: ``True`` checkpoints every layer of every stage, a list of layer types (classes
            or class names) those layers only: they keep only their inputs and run their forward again in the
            backward (less activation memory, one more forward of them per step; docs/strategy.md). ``"auto"``:
            every layer of a stage whose measured peak exceeds ``memory_limit`` (decided at the second step), and
            the tuner's fallback when no setting fits without it.
        tensor_parallel_size: T, the ranks that split every layer of a stage (DTensor; docs/parallelism.md). The
            job is a D x S x T mesh, T innermost: T must divide the devices of a node.
        tensor_parallel_plan: module name (patterns allowed) -> ``ColwiseParallel()``/``RowwiseParallel()`` (or
            ``"colwise"``/``"rowwise"``; ``"heads"`` for an attention module); None: a Hugging Face model's own
            ``config.base_model_tp_plan`` where the module holds one, else attention by whole heads (tried on the
            shards first, left whole with a warning where that changes its output) and MLP pairs (a widening
            Linear or Conv1D, then the one reading it back) column- then row-wise; the rest stays whole.
        sequence_parallel: with ``tensor_parallel_size > 1``, the layers the plan splits hold 1/T of the sequence
            between their split matmuls (norms, residual stream: Megatron's sequence parallelism), the all-reduce
            becoming a reduce-scatter and an all-gather (docs/parallelism.md#sequence-parallelism). ``False``
            (default): 1D, activations there whole on every shard.
        tensor_parallel_mode: ``"1d"`` (default, Megatron's); ``"2d"``: a stage's T = q x q ranks a grid, weights
            and activations in q x q blocks (SUMMA); ``"2.5d"``: d such grids, tokens over d
            (docs/parallelism.md#2d-and-25d).
        tensor_parallel_depth: d under ``"2.5d"`` (T = d x q x q), 1 otherwise.
        shard_optimizer_state: ``True`` is ``sharding_strategy="SHARD_OPTIM"`` (ZeRO-1, docs/parallelism.md).
        sharding_strategy: how the D groups share each stage, by FSDP's names: ``"NO_SHARD"``; ``"SHARD_OPTIM"``
            (ZeRO-1: optimizer state; under elastic averaging the reference, docs/parallelism.md#sharded-reference);
            ``"SHARD_GRAD_OP"`` (ZeRO-2: gradients too, FSDP2 over the stage group); ``"FULL_SHARD"`` (ZeRO-3:
            weights too). ``"zero1"``..``"zero3"`` work too. ZeRO-2 and 3 need ``averaging="exact"``.
        reduce_gradients: under ZeRO-2/3, ``"per_microbatch"`` reduce-scatters each micro-batch's gradients;
            ``"per_step"`` keeps weights and gradients whole through the step and reduces once (less traffic,
            ZeRO-1's peak). ``zbh1``/``zbv`` reduce once per step.
        save_distributed_checkpoint: Lightning's name and meaning (as ``ModelParallelStrategy``'s): ``True`` saves a
            folder that every rank writes its own part of in parallel (torch.distributed.checkpoint), nothing
            gathered; resume from it in any layout, ``python -m lightning_avgpipe consolidate FOLDER OUT.ckpt`` for
            one file. ``False`` (default): one file on rank 0, gathered one stage at a time, that
            ``load_from_checkpoint`` and plain Lightning read as it is (docs/guide.md#a-model-larger-than-one-device).
        seed_layers: ``True`` (default): a layer's random draws (dropout) are seeded by (seed, step, micro-batch,
            layer): the same masks for every S, v and schedule (docs/strategy.md#random-draws); ``False``: each
            process's own generator.
        accelerator: Lightning's own, as for any strategy (the Trainer sets it, as the next four).
        parallel_devices: the devices of this node.
        cluster_environment: where the ranks come from (Lightning's, torchrun, SLURM).
        checkpoint_io: how checkpoints are written and read.
        precision_plugin: the precision the Trainer was given.
    """

    strategy_name = "avgpipe"

    def __init__(
        self,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        schedule: str = "1f1b",
        advance_forwards: int | str = "auto",
        stages_per_rank: int | None = None,
        schedule_costs: tuple[float, float, float] | None = None,
        memory_limit: float | None = None,
        partition: str | list[int] = "balanced",
        num_pipelines: int = 1,
        averaging: str = "elastic",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        averaging_period: int = 1,
        elastic_alpha: float | None = None,
        sync_reference: bool | None = None,
        replica_execution: str = "sequential",
        p2p: str = "auto",
        trace_dir: str | None = None,
        trace_steps: Sequence[int] = (2,),
        p2p_timeout: float = 30.0,
        timeout: float = 1800.0,
        process_group_backend: str | None = None,
        check_forward: bool = True,
        trusted_checkpoints: bool = False,
        activation_checkpointing: bool | str | list[Any] = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: dict[str, Any] | None = None,
        sequence_parallel: bool = False,
        tensor_parallel_mode: str = "1d",
        tensor_parallel_depth: int = 1,
        shard_optimizer_state: bool = False,
        sharding_strategy: str = "NO_SHARD",
        reduce_gradients: str = "per_microbatch",
        save_distributed_checkpoint: bool = False,
        seed_layers: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # the pipeline's arguments (PipelineConfig's fields, by the same names), checked there; the rest are ours
        self.config = PipelineConfig(**{k: v for k, v in locals().items() if k in CONFIG_FIELDS})
        self.tensor_parallel_plan = tensor.check_tensor_parallel_args(
            tensor_parallel_size, tensor_parallel_plan, None, tensor_parallel_mode
        )
        # The k the user asked for, kept across fits (a tuner's reconfigure replaces "auto" with a number).
        self.user_advance_forwards: int | str = advance_forwards
        self.check_forward = bool(check_forward)
        self.trusted_checkpoints = bool(trusted_checkpoints)
        parts, flag = "a folder every rank writes its part of", save_distributed_checkpoint
        self.save_distributed_checkpoint = check_flag("save_distributed_checkpoint", flag, parts, "one file")
        seeded = "each layer's random draws seeded by step, micro-batch and layer: the same for every layout"
        self.seed_layers = check_flag("seed_layers", seed_layers, seeded, "each process's own generator")
        self._topology: Topology | None = None
        self._topology_of: Any = None  # the default process group the topology's groups were made in
        self._controller: StepController | None = None  # the stage's step and what steers it
        self._split: SplitModule | None = None
        self._bridge: StepBridge | None = None
        self._steps: PipelineSteps | None = None  # Lightning's step hooks through the controller
        self._guard = Guard()
        self._ties: list[TiedWeights] = []  # weights this stage shares with others (tied embedding and head)
        self._whole_after_run = False  # set at the split: rank 0 gets the whole trained model back after a run
        self._param_names: dict[int, str] = {}  # id(parameter) -> its name in the module, for error messages
        self._outbox = streamed.Outbox()  # a checkpoint being dumped: this rank's tensors, until save_checkpoint
        self._init_records: list[InitRecord] = []  # builds on the meta device, replayed per rank at setup

    # -- topology ------------------------------------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """This rank's stage, pipeline group and process groups (once processes are up)."""
        if self._topology is None:
            raise RuntimeError("AvgPipeStrategy's topology is known once the trainer has set up its processes.")
        return self._topology

    @override
    def data_parallel_size(self) -> int:
        # D: one group reads the user's loader as it is; D > 1 are sharded by Lightning's DistributedSampler
        return self._topology.num_groups if self._topology is not None else 2

    @property
    def controller(self) -> StepController:
        """What watches and steers this rank's step: k's search, the recompute decision, the noise scale, the
        figures and traces (after setup)."""
        if self._controller is None:
            raise RuntimeError("AvgPipeStrategy makes its stage pipeline in setup(); it does not exist yet.")
        return self._controller

    @property
    def pipeline(self) -> StagePipeline:
        """This rank's stage pipeline: the step, the replicas and the executor (after setup)."""
        return self.controller.pipeline

    @property
    def bridge(self) -> StepBridge:
        """Runs the user's step hooks on the last stage (after setup)."""
        if self._bridge is None:
            raise RuntimeError("AvgPipeStrategy makes its step bridge in setup(); it does not exist yet.")
        return self._bridge

    @property
    def partition(self) -> list[int]:
        """Layers per stage, once decided at setup."""
        if self._split is None:
            raise RuntimeError("The partition is decided in AvgPipeStrategy.setup(); it is not known yet.")
        return list(self._split.partition)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # All stages of a pipeline group read the same batches; only groups get distinct shards.
        return {"num_replicas": self.topology.num_groups, "rank": self.topology.group_index}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @override
    def setup_environment(self) -> None:
        self._guard.finished = False  # a new run of the same Trainer uses the split module again (Lightning too)
        super().setup_environment()
        self.init_processes()
        default = dist.group.WORLD if self.world_size > 1 else None  # the groups: once per process group
        if self._topology is None or default is None or self._topology_of is not default:
            self._topology_of = default
            T = self.config.tensor_parallel_size
            stages = self.config.num_stages or max(1, self.world_size // T)  # every device a stage's shard (D = 1)
            tensor.check_tensor_parallel_args(T, None, len(self.parallel_devices or []) or None)
            with guarded("making the process groups (setup_environment)"):
                where = (self.config.timeout, T, self.root_device.type, self.config.grid)
                self._topology = Topology.build(self.global_rank, self.world_size, stages, *where)
        self.start_watchdog(f"rank {self.global_rank} (stage {self.topology.stage})", grace=self.config.p2p_timeout)

    # -- setup ---------------------------------------------------------------------------------------------------
    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """A model built in ``configure_model`` (or under ``trainer.init_module()``) is built on the meta device, its
        build recorded; at setup each rank makes only its own stages real, with the values one process would have
        given them (``runtime/build/materialize.py``); ``empty_init`` changes nothing: the values are replayed."""
        if self._split is not None:  # a later fit of a split module: nothing of it is built again
            self._init_records = []
        with recorded_build(self.precision_plugin.tensor_init_context(), self._init_records):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        refuse_interrupted_last(trainer, self)  # ckpt_path="last" after a kill mid-replace, under torchrun
        module = self.lightning_module
        assert module is not None and self.model is not None
        self._guard.finished = False  # a new run of the same Trainer uses the split module again
        check_supported(module, self.precision_plugin, self.config.one_model(self.topology.num_groups))
        self.precision_plugin = for_pipeline(self.precision_plugin)
        if self._split is None:
            self._split_module(module)
        else:  # a second fit/validate with this strategy
            self._split.guard_again()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._controller is None:
            self._make_pipeline()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        install_clipping(self.precision_plugin, lambda: self.pipeline, self.root_device)

    def _split_module(self, module: pl.LightningModule) -> None:
        records, self._init_records = self._init_records, []
        cut = cut_module(
            module,
            self.config,
            self.topology,
            self.tensor_parallel_plan,
            CutInputs(records, self.root_device, self._guard, self.check_forward, self.broadcast),
        )
        self._split, self._ties, self._whole_after_run = cut.split, cut.ties, cut.whole_after_run
        self._bridge = StepBridge(module, self._guard)
        metrics_sync_over(module, self.topology.stage_group)  # mirrored on every stage: one group per stage syncs

    def _make_pipeline(self) -> None:
        """Stage ``s`` of the N replicas (copies of the module's own layers) and the step that trains them."""
        assert self._split is not None
        if not self._split.tensor_split and self.config.grid is None:  # the grid converts whole layers itself
            tensor.apply(
                self._split.names(),
                self.tensor_parallel_plan,
                self.topology,
                self.lightning_module,
                sequence=self.config.sequence_parallel,
            )
        pipeline = StagePipeline(
            self._split.owned,
            self.topology,
            self.config,
            self.root_device,
            self._process_group_backend,
            self.num_processes,
            ties=self._ties,
            chunks=self._split.chunk_sizes,
        )
        if self.seed_layers:  # the run's seed, the same on every rank (rank 0's: seed_everything's where it ran)
            seed = self.broadcast(torch.initial_seed() % (1 << 63), src=0)
            pipeline.streams = RandomStreams(seed, list(itertools.accumulate([0, *self._split.partition[:-1]])))
        self._controller = StepController(pipeline)
        self._param_names = {id(p): n for n, p in self._lightning().named_parameters()}
        self._steps = PipelineSteps(self._lightning(), self._controller, self.bridge, self._param_names)
        announce_averaging(pipeline)
        announce_checkpointing(pipeline, list(self._split.names()))
        announce_sequence(pipeline)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self.optimizers = [self.pipeline.optimizer(self.optimizers[0])]
        announce_sharding(self.pipeline, self.optimizers[0])

    # -- steps ---------------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Each training iteration gives every one of the N pipelines its own batch of the user's size B.
        module = self.lightning_module
        training = module is not None and module.trainer.training
        if training and self._topology is not None and self.topology.num_groups == 1:  # no DistributedSampler put on it
            same_order_on_every_rank(dataloader)
        if self.config.num_pipelines > 1 and training:
            return GroupedBatches(dataloader, self.config.num_pipelines)
        return dataloader

    @property
    def steps(self) -> PipelineSteps:
        """Lightning's step hooks through this rank's controller (after setup)."""
        if self._steps is None:
            raise RuntimeError("AvgPipeStrategy makes its steps in setup(); they do not exist yet.")
        return self._steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.training_step(args[0], args[1:], self.precision_plugin, self.config.num_pipelines)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The pipeline already ran every backward inside training_step; here the hooks run and the gradients land.
        module = self._lightning()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.steps.land_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.eval_step("validation_step", args, self.precision_plugin, share_output=False)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.eval_step("test_step", args, self.precision_plugin, share_output=False)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.eval_step("predict_step", args, self.precision_plugin, share_output=True)

    # -- collectives ---------------------------------------------------------------------------------------------

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        # Every stage of a pipeline holds the same (mirrored) logged values: reduce over the D ranks that hold this
        # stage, so self.log(..., sync_dist=True) counts each pipeline group once, whatever reduce_fx is.
        if isinstance(tensor, Tensor):
            group = group if group is not None else self.topology.stage_group
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # -- the end -------------------------------------------------------------------------------------------------
    @override
    def failure_site(self) -> str:
        return (
            f"rank {self.global_rank} ({f'stage {self.topology.stage}' if self._controller is not None else 'setup'})"
        )

    @override
    def teardown(self) -> None:
        if self._controller is not None:
            elastic = self._controller.pipeline.replicas.elastic
            elastic.wait()  # the model the user keeps is the up-to-date reference
            if elastic.released:
                warnings.warn(whole.released(self.global_rank), stacklevel=2)
        if self._split is not None:
            self._split.release()
            if self._whole_after_run and self._controller is not None and not failed():
                with guarded("bringing the trained model back to rank 0 (teardown)"), self._guard.allowing():
                    mine = whole.own_state(self._lightning(), keep=self.topology.group_index == 0)
                    whole.bring_back(self._split, mine, self.global_rank, self.world_size)
        super().teardown()
        if self._split is not None and self.topology.num_stages > 1:
            self._guard.finished = True  # the module is not whole here: its placeholders refuse

    @override
    def close(self) -> None:
        super().close()
        if self._topology is not None and self.lightning_module is not None:  # the metrics' group, set in setup
            metrics_sync_over(self.lightning_module, None, only=self._topology.stage_group)
        self.optimizers = []  # they hold the elastic averaging, and it holds its group
        pipeline = self._controller.pipeline if self._controller is not None else None
        tensor.release(self._topology, pipeline)  # the groups the tensor-parallel meshes hold
        self._controller = self._steps = self._topology = self._topology_of = None
        self._ties = []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="AvgPipe pipeline parallelism (lightning_avgpipe)"
            )
