"""StagePipeline: one rank's part of the pipelined step, the one step that the strategy, the tuner and the benchmarks
all call (Lightning-free).

It runs one executor (``runtime/executor.py``) over a plan (``schedules/``): it splits an iteration's N batches into
micro-batches by the rules a user can rely on, builds the plan for them (cached) and sends every (replica,
micro-batch) unit through it; the replicas it runs are
:class:`~lightning_avgpipe.runtime.sync.stage_replicas.StageReplicas` (averaging, optimizers, batched execution, ties).
A caller gives it the N batches and a loss function (or a ``StepRequest``, :meth:`StagePipeline.run_step`), then steps
the optimizer that :meth:`StagePipeline.optimizer` returns::

    pipe = StagePipeline(layers, topology, PipelineConfig(num_microbatches=4, num_pipelines=2))
    opt = pipe.optimizer(torch.optim.AdamW(pipe.reference_params, lr=3e-4))
    for batches in loader:                               # N batches per iteration, one per replica
        opt.zero_grad()
        result = pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
        opt.step()                                       # every replica's optimizer, then the elastic update
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.algorithms.elastic import average_gradients
from lightning_avgpipe.algorithms.noise_scale import GradientNorms
from lightning_avgpipe.config import PipelineConfig, check_same_placement
from lightning_avgpipe.errors import check_finite
from lightning_avgpipe.runtime import units
from lightning_avgpipe.runtime.comms import collectives
from lightning_avgpipe.runtime.comms.p2p import Link
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.deferred import WeightGradQueue
from lightning_avgpipe.runtime.executor import StageExecutor
from lightning_avgpipe.runtime.rank_stages import ChunkLayout
from lightning_avgpipe.runtime.recompute import layer_mask, stage_function
from lightning_avgpipe.runtime.request import StepRequest
from lightning_avgpipe.runtime.sharding.fsdp import StageSharding, shard_stage
from lightning_avgpipe.runtime.sharding.tensor_parallel import ActivationStage, activation_stage, whole_outputs
from lightning_avgpipe.runtime.streams import RandomStreams
from lightning_avgpipe.runtime.sync.gradient_probe import GradientProbe
from lightning_avgpipe.runtime.sync.stage_replicas import StageReplicas
from lightning_avgpipe.runtime.sync.ties import TiedWeights
from lightning_avgpipe.runtime.trace import ActivationMeter, StepTrace
from lightning_avgpipe.runtime.units import LossFn, StepResult, first_input
from lightning_avgpipe.schedules import Plan, build_plan, validate_plan
from lightning_avgpipe.schedules.generate import reads_k, splits_backward

# (stage output, micro-batch, its share of the batch) -> anything (evaluation)
EvalFn = Callable[[Any, Any, float], Any]
Context = Callable[[], contextlib.AbstractContextManager[Any]]


def batched_p2p(config: PipelineConfig, backend: str | None) -> bool:
    """Whether a pipeline posts its transfers just in time as ``batch_isend_irecv`` groups (NCCL) or eagerly."""
    return config.p2p == "batched" or (config.p2p == "auto" and backend == "nccl")


class StagePipeline:
    """This rank's stage of the pipeline and of its N replicas, and the training and evaluation steps.

    Args:
        layers: this stage's layers, in order: the reference model's (what evaluation and checkpoints use).
        topology: this rank's stage and groups (:class:`~lightning_avgpipe.runtime.comms.topology.Topology`).
        config: M, N, the schedule, k, the averaging and timeouts (:class:`~lightning_avgpipe.PipelineConfig`).
        device: where this stage runs.
        backend: the process-group backend (``"nccl"`` makes ``p2p="auto"`` batch its transfers).
        processes: stage processes sharing this machine (a ``memory_limit`` fraction is of their share on CPU).
        link: the transfers to the neighbouring stages; by default a :class:`~lightning_avgpipe.runtime.Link` over
            the default process group (a benchmark passes one over its own group, or an emulated slow link).
        ties: the weights this stage shares with other stages, whose gradients every step sums over them.
        chunks: with several stages per rank (``interleaved``, ``zbv``: ``config.chunks_per_rank`` v), the layer
            counts of this rank's stages in stage order; ``layers`` holds them all, in that order.

    What watches and steers the step (k's search, the recompute decision, the figures, traces) is its controller's,
    :class:`~lightning_avgpipe.runtime.controller.StepController`.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        topology: Topology,
        config: PipelineConfig | None = None,
        device: torch.device | None = None,
        backend: str | None = None,
        processes: int = 1,
        link: Link | None = None,
        ties: Sequence[TiedWeights] = (),
        chunks: Sequence[int] | None = None,
    ) -> None:
        config = config if config is not None else PipelineConfig()
        if topology.tensor_parallel_size > 1 and config.replica_execution == "batched":
            raise ValueError(
                "replica_execution='batched' with tensor_parallel_size > 1 is not supported (torch.func.vmap over "
                "DTensor layers); use replica_execution='sequential', or tensor_parallel_size=1."
            )
        device = device if device is not None else torch.device("cpu")
        # what the stage functions read as they are made (every part is set in _hold)
        self.layers, self.topology = list(layers), topology
        self.streams: RandomStreams | None = None
        self.recompute = layer_mask(self.layers, config.activation_checkpointing)  # checkpointed layers
        layout = ChunkLayout.of(config, topology, len(self.layers), chunks)
        chunked = list(layout.functions(self.layers, lambda stage, start, ls: ls).values())
        # sequence parallelism or the 2D/2.5D grid (T > 1; runtime/sharding/), before the replicas copy the layers
        self.sequence = activation_stage(chunked, config, topology.tensor_group, topology.grid_mesh, ties)
        carry = self.sequence.carry(topology, device) if self.sequence else (False, False)  # boundaries on shards
        # ZeRO-2/3 (runtime/sharding/fsdp.py): layers sharded over the stage group, the stage functions on its roots
        self.sharding, ties = shard_stage(chunked, topology, config, splits_backward(config.schedule), device, ties)
        stage_fns = layout.functions(self.layers, self._stage_function)
        coalesce = batched_p2p(config, backend)
        if layout.v == 1:
            link = link or collectives.stage_link(topology, device, carry)
            fn = stage_fns[topology.stage]
            executor = StageExecutor(topology.stage, topology.num_stages, fn, link, coalesce=coalesce)
        else:
            executor = layout.executor(topology, device, stage_fns, coalesce)
        self._hold(
            layers=self.layers,
            topology=topology,
            config=config,
            device=device,
            backend=backend,
            processes=processes,
            chunks=layout,
            recompute=self.recompute,
            executor=executor,
            ties=tuple(ties),
            replicas=StageReplicas.build(
                self.layers, topology, config, device, ties, lambda copy: layout.functions(copy, self._stage_function)
            ),
            streams=None,
            bounds_link_timeout=True,
            sharding=self.sharding,
            sequence=self.sequence,
        )
        self._defer_weight_grads()

    def _hold(
        self,
        *,
        layers: list[nn.Module],
        topology: Topology,
        config: PipelineConfig,
        device: torch.device,
        backend: str | None,
        processes: int,
        chunks: ChunkLayout,
        recompute: list[bool],
        executor: StageExecutor,
        ties: tuple[TiedWeights, ...],
        replicas: StageReplicas,
        streams: RandomStreams | None,
        bounds_link_timeout: bool,
        sharding: StageSharding | None,
        sequence: ActivationStage | None,
    ) -> None:
        """Every part a pipeline holds, set here alone: :meth:`__init__` and :meth:`alone` both pass them all."""
        self.layers, self.topology, self.device, self.backend = layers, topology, device, backend
        self.processes, self.chunks, self.recompute, self.executor = processes, chunks, recompute, executor
        self.ties, self.replicas, self.sharding, self.sequence = ties, replicas, sharding, sequence
        self._bounds_link_timeout = bounds_link_timeout  # the first step may be slow; later ones are bounded
        # each layer's random draws from a stream of its own (runtime/streams.py): set by the caller; None: the
        # process's generator
        self.streams = streams
        self.meter = ActivationMeter(replicas.params)
        self._start(config)

    def _start(self, config: PipelineConfig) -> None:
        """What the step derives from its config, afresh: k's start, the plan cache, the full batch size."""
        self.config = config
        k = config.advance_forwards
        # the k in use: fixed, or where advance_forwards="auto" currently is (the controller moves it)
        self.advance_forwards = 0 if k == "auto" else int(k)
        self.num_microbatches = config.microbatches_for(self.topology.num_stages)
        # transfers posted just in time as batch_isend_irecv groups (NCCL) rather than eagerly
        self.batched_p2p = batched_p2p(config, self.backend)
        # the schedule splits the backward into input and weight gradients (zbh1, zbadvance, zbv)
        self.splits_backward = splits_backward(config.schedule)
        self._plans: dict[tuple[bool, int, int], Plan] = {}
        # the largest training batch seen since the last change of M: a shorter one is an epoch's last
        self.full_batch: int | None = None

    # -- what it holds: its config, topology, executor and replicas, read directly ----------------------------------
    @property
    def reference_params(self) -> list[nn.Parameter]:
        return self.replicas.elastic.reference_params

    def _defer_weight_grads(self) -> None:
        """Under a schedule that splits the backward, every copy of the stage's layers queues its weight gradients
        in the executor's one queue (runtime/deferred.py); new replicas join it."""
        if not self.splits_backward:
            return
        queue = self.executor.weight_grads
        if queue is None:
            self.executor.weight_grads = WeightGradQueue(self.replicas.copies)
        else:
            queue.install(self.replicas.copies)

    def _stage_function(self, stage: int, start: int, layers: Sequence[nn.Module]) -> Callable[[Any], Any]:
        """``layers`` (model stage ``stage``'s, from ``start`` in this rank's) applied in order (the checkpointed
        ones recomputed), each drawing from its own stream where :attr:`streams` is set; under tensor parallelism,
        checked once per output signature to give every shard the same output
        (``runtime/sharding/tensor_parallel.py``)."""
        mask = self.recompute[start : start + len(layers)]
        # each layer's stream, read when the layer runs (the caller may set streams after the functions are made)
        fn = stage_function(
            layers, mask, lambda i: self.streams.seed_of(stage, i) if self.streams is not None else None
        )
        top = self.topology
        if top.tensor_parallel_size > 1 and not (self.sequence and self.sequence.carried[0][1]):  # whole output
            fn = whole_outputs(fn, top.tensor_group, f"stage {top.stage} (rank {top.rank})")
        return fn if self.sharding is None else self.sharding.wrap(layers, fn)

    def optimizer(self, user: Optimizer) -> Optimizer:
        """The optimizer to step (:meth:`StageReplicas.optimizer
        <lightning_avgpipe.runtime.sync.stage_replicas.StageReplicas.optimizer>`): ``user`` itself when N·D = 1, else
        one clone of it per replica, stepped together and followed by the elastic update (``user`` must be built over
        :attr:`reference_params`)."""
        return self.replicas.optimizer(user)

    def reconfigure(self, config: PipelineConfig) -> bool:
        """Take a new M, N, k or averaging; returns whether the replicas were made anew (the caller then makes new
        optimizers with :meth:`optimizer`). Exact averaging under another N trains the same one model: nothing is
        made anew, and the optimizer and its state carry on."""
        old, k = self.config, self.advance_forwards
        check_same_placement(old, config)
        self._start(config)
        if config.advance_forwards == old.advance_forwards:
            self.advance_forwards = k  # where an "auto" search stands carries on
        if self.splits_backward and self.executor.weight_grads is None:  # now splitting: layers queue their W
            self._defer_weight_grads()
        elif not self.splits_backward and self.executor.weight_grads is not None:  # no longer: their own forward
            self.executor.weight_grads.remove()
            self.executor.weight_grads = None
        if config.num_pipelines == old.num_pipelines and config.averaging == old.averaging:
            return False
        groups = self.topology.num_groups
        if old.one_model(groups) and config.one_model(groups):  # exact under another N: the same model and optimizer
            return False
        self.replicas.elastic.wait()
        self.replicas = StageReplicas.build(
            self.layers,
            self.topology,
            config,
            self.device,
            self.ties,
            lambda copy: self.chunks.functions(copy, self._stage_function),
        )
        self.meter = ActivationMeter(self.replicas.params)
        self._defer_weight_grads()
        return True

    @contextlib.contextmanager
    def deferring_weight_grads(self) -> Iterator[None]:
        """Within it, this stage's layers queue their weight gradients for ``W`` even under a schedule that does not
        split the backward: a variant that splits it (the tuner profiling ``zbh1``) then times I and W apart."""
        if self.executor.weight_grads is not None:
            yield
            return
        queue = self.executor.weight_grads = WeightGradQueue(self.replicas.copies)
        try:
            yield
        finally:
            queue.remove()
            self.executor.weight_grads = None

    def alone(self, config: PipelineConfig) -> StagePipeline:
        """This stage running replica 0 alone under ``config`` (N = 1, sequential): the same layers, executor and
        link, its own plans, micro-batch rules and activation meter; it leaves the link's timeout as it is. The
        controller's :meth:`~lightning_avgpipe.runtime.controller.StepController.variant` makes it."""
        other = object.__new__(StagePipeline)
        other._hold(
            layers=self.layers,
            topology=self.topology,
            config=replace(config, num_pipelines=1, replica_execution="sequential"),
            device=self.device,
            backend=self.backend,
            processes=self.processes,
            chunks=self.chunks,
            recompute=self.recompute,
            executor=self.executor,
            ties=self.ties,
            replicas=self.replicas.first_alone(),
            streams=self.streams,
            bounds_link_timeout=False,
            sharding=self.sharding,
            sequence=self.sequence,
        )
        return other

    # -- the step's parts ----------------------------------------------------------------------------------------
    def plan(self, training: bool, units: int) -> Plan:
        """The validated plan for ``units`` units (cached; evaluation runs forwards only, in 1F1B order)."""
        k = self.advance_forwards if training else 0
        key = (training, units, k)
        if key not in self._plans:
            batched = self.batched_p2p
            v = self.chunks.v
            costs = self.config.schedule_costs
            plan = build_plan(
                self.config.schedule, self.topology.num_stages, units, k, training, int(not batched), v, costs
            )
            self._plans[key] = validate_plan(plan, nccl=batched)
        return self._plans[key]

    def microbatches(self, batch: Any, training: bool) -> tuple[list[Any], list[float]]:
        """``batch`` as M micro-batches and their shares of it, by the rules of :func:`microbatch.split_step`."""
        if training:
            self.full_batch = max(microbatch.batch_size(batch), self.full_batch or 0)
        return microbatch.split_step(batch, self.num_microbatches, self.full_batch if training else None)

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(
        self, batches: Sequence[Any], loss_fn: LossFn, *, measure: bool = False, **fields: Any
    ) -> StepResult:
        """:meth:`run_step` of ``StepRequest(batches, loss_fn, **fields)`` (``runtime/request.py``)."""
        return self.run_step(StepRequest(batches, loss_fn, **fields), measure)

    def run_step(self, request: StepRequest, measure: bool = False) -> StepResult:
        """Run one iteration: replica n trains on ``request.batches[n]``; gradients land in each replica's
        ``.grad``.

        Units are (replica, micro-batch) pairs, replica-major. A unit's loss is weighted by its share of its
        replica's batch (each replica's gradient is its own batch mean) and divided by ``request.accumulate``.
        ``measure``: count the activation bytes every unit saves (saved-tensor hooks: costs time; the trace's
        ``peak_activation_bytes``); the step's timeline is always kept.

        Raises:
            FloatingPointError: a loss (last stage) or a gradient (any stage) is not finite; names the stage,
                replica and parameter. The other stages then fail naming this one.
        """
        batches, accumulate = request.batches, request.accumulate
        if self.streams is not None and request.step is not None:  # each layer's random stream follows the step
            self.streams.step = (request.step, request.batch_index)
        replicas = self.config.num_pipelines
        if len(batches) != replicas:
            raise ValueError(
                f"train_step got {len(batches)} batches for num_pipelines={replicas}; give one per parallel pipeline."
            )
        micro: list[Any] = []
        weights: list[float] = []
        owner: list[int] = []
        samples = sum(microbatch.batch_size(b) for b in batches)
        exact = self.config.exact
        for n, b in enumerate(batches):
            parts, shares = self.microbatches(b, training=True)
            micro += parts
            # exact: one model, one batch of all N; a unit's share is of all N batches' samples
            weights += [s * microbatch.batch_size(b) / samples for s in shares] if exact else shares
            owner += [0 if exact else n] * len(parts)
        if exact:
            replicas = 1  # one replica trains on every unit; what follows counts replicas, not batches
        _start_peaks(self.executor)
        trace = StepTrace(self.topology.stage)
        meter = self.meter if measure else None
        if meter is not None:
            meter.reset()
        reps = self.replicas
        reps.elastic.follow_reference()  # frozen layers, eval-mode BatchNorm: as the user's module has them
        before = reps.tied.before(replicas) if self.ties else None
        probe = _noise_probe(self, request, accumulate, replicas, micro, owner)
        step = (request.key, micro, weights, owner, replicas, accumulate, request.loss_fn, request.inputs)
        batched = reps.batched
        if self.sharding is not None:
            self.sharding.begin(self.splits_backward)
        if batched is not None:  # micro-batch m of every replica in one vmap call: M units
            todo = units.batched(*step, batched_replicas=batched)
            batched.begin()
        else:  # each replica's micro-batches: N x M units
            todo = units.sequential(*step, replica_fns=reps.fns)
        results = self.executor.run(
            self.plan(True, len(todo.keys)).stages[self.topology.stage],
            todo.keys,
            training=True,
            inputs=todo.inputs,
            head=todo.head,
            stage_fn_for=todo.stage_fn_for,
            trace=trace,
            meter=meter,
            after_backward=probe.after_backward if probe is not None and batched is None else None,
            request=request,
        )
        if batched is not None:
            batched.finish()
        norms = _reduce(self, replicas, before, probe)
        spread = reps.divergence() if request.divergence else None
        grads = reps.params if request.loss_scale is None else []  # under loss scaling an overflow skips the step
        where = f"stage {self.topology.stage} (rank {self.topology.rank})"
        check_finite(where, results, grads, reps.elastic.reference_params, request.param_names or {})
        if self._bounds_link_timeout:
            for link in self.executor.all_links:
                link.timeout = self.config.p2p_timeout  # the first step may be slow; later ones are bounded
        loss = None
        if self.executor.is_last and results:
            loss = torch.stack([r.float() for r in results.values()]).sum() * accumulate / replicas
        return StepResult(results, loss, samples, trace, spread, norms)

    # -- evaluation ----------------------------------------------------------------------------------------------
    def eval_step(
        self,
        batch: Any,
        head: EvalFn,
        *,
        inputs: Callable[[Any], Any] = first_input,
        forward_context: Context = contextlib.nullcontext,
        key: str = "eval",
    ) -> dict[int, Any]:
        """Forward ``batch`` through the reference layers, M micro-batches in flight, no gradients.

        Returns, on the last stage, micro-batch -> ``head(output, micro_batch, share)``; elsewhere an empty dict.
        """
        self.replicas.elastic.wait()  # evaluate the up-to-date reference
        self.replicas.elastic.require_whole("Evaluating the model")
        micro, shares = self.microbatches(batch, training=False)
        try:
            return self.executor.run(
                self.plan(False, len(micro)).stages[self.topology.stage],
                [(key, microbatch.signature(mb)) for mb in micro],
                training=False,
                inputs=lambda u: inputs(micro[u]),
                head=lambda u, output: head(output, micro[u], shares[u]),
                forward_context=forward_context,
            )
        finally:
            if self.sharding is not None:  # forwards without a backward leave the weights gathered
                self.sharding.reshard()

    # -- what crosses the pipeline (runtime/comms/collectives.py) -------------------------------------------------
    def share(self, payload: Any) -> Any:
        """``payload`` from this pipeline's last stage, on every stage (collective over the pipeline)."""
        return collectives.share(self.topology, payload, self.chunks.loss_rank)

    def share_tensor(self, tensor: Tensor) -> Tensor:
        """``tensor`` of this pipeline's last stage, in place on every stage (collective over the pipeline)."""
        return collectives.share_tensor(self.topology, tensor, self.chunks.loss_rank)

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj`` of every stage of this pipeline, on its first stage (``None`` elsewhere; collective)."""
        return collectives.gather(self.topology, obj)

    # -- activation checkpointing ----------------------------------------------------------------------------------
    def set_recompute(self, mask: Sequence[bool]) -> None:
        """Checkpoint the layers in ``mask`` from the next step on (every replica's copy of them)."""
        self.recompute = list(mask)
        self.executor.stage_fns = self.chunks.functions(self.layers, self._stage_function)
        self.replicas.remake_functions(lambda copy: self.chunks.functions(copy, self._stage_function))

    def describe(self) -> str:
        cfg = self.config
        return (
            f"{cfg.schedule}"
            + (f" k={self.advance_forwards}" if reads_k(cfg.schedule) else "")
            + f", S={self.topology.num_stages}, M={self.num_microbatches}, N={self.config.num_pipelines}"
        )


def _reduce(pipe: StagePipeline, replicas: int, before: Any, probe: GradientProbe | None) -> GradientNorms | None:
    """The step's gradients made the model's: FSDP's reduction (runtime/sharding/fsdp.py), the shared weights' sum
    over their stages, the noise probe's norms (of the groups' own gradients), then under ``averaging="exact"`` over
    D groups without FSDP the groups' mean, one batch of D x N x B. Returns the probe's norms."""
    if pipe.sharding is not None:
        pipe.sharding.finish()
    if pipe.sequence is not None:  # the weights that saw one shard of the sequence: summed over the tensor group
        pipe.sequence.sum_grads(pipe.replicas.copies)
    if pipe.ties:
        pipe.replicas.tied.sum(replicas, before, pipe.device)
    top = pipe.topology
    norms = probe.finish(top.job_group, top.num_groups, pipe.device) if probe is not None else None
    if pipe.config.exact and top.num_groups > 1 and pipe.sharding is None:
        average_gradients(pipe.replicas.params, top.stage_group, top.num_groups, pipe.device)
    return norms


def _noise_probe(
    pipe: StagePipeline, request: StepRequest, accumulate: int, replicas: int, micro: list[Any], owner: list[int]
) -> GradientProbe | None:
    """The noise-scale probe of a step, where it can read each unit's whole gradients: not under a split backward
    (which interleaves units' parts), several stages per rank or FSDP (which reduces them)."""
    reps = pipe.replicas
    whole_units = not pipe.splits_backward and pipe.chunks.v == 1 and pipe.sharding is None
    if not (request.noise and accumulate == 1 and whole_units and GradientProbe.usable(replicas, len(micro))):
        return None
    params = [reps.elastic.replica_params(n) for n in range(replicas)] if replicas > 1 else [reps.params]
    sizes = [microbatch.batch_size(mb) for mb in micro]
    return GradientProbe(
        params, sizes, owner, skip=reps.uncounted, tensor_parallel_size=pipe.topology.tensor_parallel_size
    )


def _start_peaks(executor: StageExecutor) -> None:
    """Start the links' peaks of receive buffers in flight anew (the first step's memory breakdown reads them)."""
    for link in executor.all_links:
        link.peak_in_flight = link.in_flight
