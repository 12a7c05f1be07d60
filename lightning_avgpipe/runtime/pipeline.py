"""StagePipeline: one rank's part of the pipelined step, the one step that the strategy, the tuner and the benchmarks
all call (Lightning-free).

It owns what a stage needs to train: its layers and their N replicas tied by elastic averaging
(docs/how-it-works.md#elastic-averaging-rule), the executor and its link to the neighbouring stages, the plan cache, the
micro-batch rules, the advance-forward search and the step's measurements. A caller gives it an iteration's N batches
and a loss function, then steps the optimizer that :meth:`StagePipeline.optimizer` returns::

    pipe = StagePipeline(layers, topology, PipelineConfig(num_microbatches=4, num_pipelines=2))
    opt = pipe.optimizer(torch.optim.AdamW(pipe.reference_params, lr=3e-4))
    for batches in loader:                               # N batches per iteration, one per replica
        opt.zero_grad()
        result = pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
        opt.step()                                       # every replica's optimizer, then the elastic update
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe import microbatch
from lightning_avgpipe.autotune import AdvanceSearch, added_bytes
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.cpu import host_memory_bytes
from lightning_avgpipe.elastic import ElasticAveraging, average_gradients
from lightning_avgpipe.errors import loss_of
from lightning_avgpipe.noise import GradientNorms, NoiseScale
from lightning_avgpipe.optim import ElasticOptimizer, clone_optimizer
from lightning_avgpipe.replicas import BatchedReplicas, select, stack
from lightning_avgpipe.runtime.executor import StageExecutor
from lightning_avgpipe.runtime.gradnoise import GradientProbe
from lightning_avgpipe.runtime.p2p import Link, PeerFailureError, first_failure
from lightning_avgpipe.runtime.recompute import layer_mask, stage_function
from lightning_avgpipe.runtime.tensor_parallel import TensorParallelLink, whole_outputs
from lightning_avgpipe.runtime.ties import TiedGradients, TiedWeights
from lightning_avgpipe.runtime.topology import Topology
from lightning_avgpipe.runtime.trace import ActivationMeter, StepTrace, write_trace
from lightning_avgpipe.runtime.zero import ShardedOptimizer, ShardedReference
from lightning_avgpipe.schedules import Plan, build_plan, max_advance_forwards, validate_plan
from lightning_avgpipe.shards import local

# (stage output, micro-batch, its share of all the iteration's samples) -> a scalar loss, or {"loss": ...}
LossFn = Callable[[Any, Any, float], Any]
# (stage output, micro-batch, its share of the batch) -> anything (evaluation)
EvalFn = Callable[[Any, Any, float], Any]
Context = Callable[[], contextlib.AbstractContextManager[Any]]


def first_input(batch: Any) -> Any:
    """The default first-layer input of a micro-batch: ``batch[0]`` of a tuple or list, else the batch itself."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def stage_link(topology: Topology, device: torch.device) -> Link | None:
    """The transfers to the neighbouring stages over the default process group (``None`` with one stage). Under
    tensor parallelism shard 0 of each stage carries them for its tensor group (``runtime/tensor_parallel.py``)."""
    stage, S, T = topology.stage, topology.num_stages, topology.tensor_parallel_size
    if S == 1:
        return None
    name = f"stage {stage} (rank {topology.rank})"
    leader = topology.rank_of(topology.group_index, stage, 0)
    inner = None
    if topology.rank == leader:
        g = topology.group_index
        inner = Link(
            topology.rank_of(g, stage - 1) if stage > 0 else None,
            topology.rank_of(g, stage + 1) if stage < S - 1 else None,
            device,
            name=name,
            stage=stage,
        )
    if T == 1:
        return inner
    return TensorParallelLink(inner, topology.tensor_group, leader, device, name, stage)


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


@dataclass
class StepResult:
    """What one training step produced on this stage.

    Attributes:
        losses: on the last stage, unit -> that unit's loss as weighted for backward (detached); empty elsewhere.
        loss: on the last stage, the mean over the N replicas of each replica's batch loss (what is logged).
        samples: samples in the iteration on this pipeline (the N batches).
        trace: this stage's timeline of the step (compute, waits, sends; activation peak when measured).
        divergence: ``(N,)`` relative distances ‖w_n − w_ref‖/‖w_ref‖ over the whole pipeline, when asked for.
        noise: the step's squared gradient norms at two batch sizes over the whole job, when asked for and the
            step has two sizes (``runtime/gradnoise.py``); :attr:`StagePipeline.noise_scale` is then updated.
    """

    losses: dict[int, Tensor]
    loss: Tensor | None
    samples: int
    trace: StepTrace
    divergence: Tensor | None = None
    noise: GradientNorms | None = None


class StagePipeline:
    """This rank's stage of the pipeline and of its N replicas, and the training and evaluation steps.

    Args:
        layers: this stage's layers, in order: the reference model's (what evaluation and checkpoints use).
        topology: this rank's stage and groups (:class:`~lightning_avgpipe.runtime.topology.Topology`).
        config: M, N, the schedule, k, the averaging and timeouts (:class:`~lightning_avgpipe.PipelineConfig`).
        device: where this stage runs.
        backend: the process-group backend (``"nccl"`` makes ``p2p="auto"`` batch its transfers).
        processes: stage processes sharing this machine (a ``memory_limit`` fraction is of their share on CPU).
        link: the transfers to the neighbouring stages; by default a :class:`~lightning_avgpipe.runtime.Link` over
            the default process group (a benchmark passes one over its own group, or an emulated slow link).
        ties: the weights this stage shares with other stages, whose gradients every step sums over them.
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
    ) -> None:
        self.layers = list(layers)
        self.topology = topology
        self.config = config if config is not None else PipelineConfig()
        self.device = device if device is not None else torch.device("cpu")
        self.backend = backend
        self.processes = processes
        if topology.tensor_parallel_size > 1 and self.config.replica_execution == "batched":
            raise ValueError(
                "replica_execution='batched' with tensor_parallel_size > 1 is not supported (torch.func.vmap over "
                "DTensor layers); use replica_execution='sequential', or tensor_parallel_size=1."
            )
        link = link or stage_link(topology, self.device)
        self.recompute = layer_mask(self.layers, self.config.activation_checkpointing)  # checkpointed layers
        self._recompute_seen = 0  # activation_checkpointing="auto": measured steps seen before deciding
        stage_fn = self._stage_function(self.layers)
        self.executor = StageExecutor(topology.stage, topology.num_stages, stage_fn, link, coalesce=self.batched_p2p)
        k = self.config.advance_forwards
        self._k = 0 if k == "auto" else int(k)
        self._search: AdvanceSearch | None = None
        self._plans: dict[tuple[bool, int, int], Plan] = {}
        self._full_batch: int | None = None
        self._bounds_link_timeout = True
        self.ties = tuple(ties)
        self.noise_scale = NoiseScale()  # B_simple, smoothed over the steps that measure it (train_step(noise=True))
        self._make_replicas()

    # -- what it holds -------------------------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.topology.stage

    @property
    def num_stages(self) -> int:
        return self.topology.num_stages

    @property
    def is_last(self) -> bool:
        return self.executor.is_last

    @property
    def link(self) -> Link | None:
        return self.executor.link

    @property
    def num_pipelines(self) -> int:
        return self.config.num_pipelines

    @property
    def num_microbatches(self) -> int:
        return self.config.microbatches_for(self.num_stages)

    @property
    def batched_p2p(self) -> bool:
        """Whether transfers are posted just in time as ``batch_isend_irecv`` groups (NCCL) rather than eagerly."""
        mode = self.config.p2p
        return mode == "batched" or (mode == "auto" and self.backend == "nccl")

    @property
    def advance_forwards(self) -> int:
        """The k in use: fixed, or where ``advance_forwards="auto"`` currently is."""
        return self._k

    @property
    def k_search(self) -> AdvanceSearch | None:
        """The search of ``advance_forwards="auto"`` once it has started."""
        return self._search

    @property
    def replica_fns(self) -> list[Callable[[Any], Any]]:
        """Per replica, its copy of this stage's layers applied in order."""
        return list(self._replica_fns)

    @property
    def params(self) -> list[nn.Parameter]:
        """Every replica's parameters on this stage (the reference's when N·D = 1): what a step's gradients reach."""
        return list(self._params)

    @property
    def reference_params(self) -> list[nn.Parameter]:
        return self.elastic.reference_params

    @property
    def full_batch(self) -> int | None:
        """The largest training batch seen since the last change of M: a shorter one is an epoch's last."""
        return self._full_batch

    @full_batch.setter
    def full_batch(self, value: int | None) -> None:
        self._full_batch = value

    def _make_replicas(self) -> None:
        cfg, top = self.config, self.topology
        sharded = cfg.shard_optimizer_state and not cfg.exact and top.num_groups > 1
        self.elastic = (ShardedReference if sharded else ElasticAveraging)(  # exact: one model, the reference itself
            self.layers,
            1 if cfg.exact else cfg.num_pipelines,
            1 if cfg.exact else top.num_groups,
            alpha=cfg.elastic_alpha,
            group=top.stage_group,
            synchronous=cfg.synchronous_reference,
            device=self.device,
            outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum,
            period=cfg.averaging_period,
            tensor_parallel_size=top.tensor_parallel_size,
        )
        self._params = self.elastic.all_replica_params()
        self._tied = TiedGradients(self.ties, self.elastic, self.stage)
        self._replica_fns = [self._stage_function(layers) for layers in self.elastic.replicas]
        self.batched: BatchedReplicas | None = None
        if cfg.replica_execution == "batched" and not self.elastic.trivial:
            self.batched = BatchedReplicas(self.elastic.replicas)
        self.meter = ActivationMeter(self._params)

    def _stage_function(self, layers: Sequence[nn.Module]) -> Callable[[Any], Any]:
        """``layers`` applied in order (the checkpointed ones recomputed); under tensor parallelism, checked once per
        output signature to give every shard the same output (``runtime/tensor_parallel.py``)."""
        fn = stage_function(layers, self.recompute)
        top = self.topology
        if top.tensor_parallel_size == 1:
            return fn
        return whole_outputs(fn, top.tensor_group, f"stage {top.stage} (rank {top.rank})")

    def optimizer(self, user: Optimizer) -> Optimizer:
        """The optimizer to step: ``user`` itself when N·D = 1, else one clone of it per replica, stepped together
        and followed by the elastic update (``user`` must be built over :attr:`reference_params`)."""
        elastic, top = self.elastic, self.topology
        if elastic.trivial:
            if self.config.shard_optimizer_state and top.num_groups > 1:  # one model over D groups: ZeRO-1
                return ShardedOptimizer(
                    user, elastic.reference_params, top.stage_group, top.stage_ranks, top.group_index
                )
            return user
        clones = [
            clone_optimizer(user, elastic.replica_params(n), elastic.reference_params)
            for n in range(elastic.num_replicas)
        ]
        return ElasticOptimizer(user, clones, elastic)

    def variant(self, **changes: Any) -> StagePipeline:
        """This stage running replica 0 alone under a changed config (same layers, executor and link).

        The tuner profiles the real step this way at other micro-batch counts and schedules: every rank must take
        the same variant. Its plans, micro-batch rules and activation meter are its own; it leaves the link's
        timeout as it is.
        """
        other = copy.copy(self)
        other.config = replace(self.config, num_pipelines=1, replica_execution="sequential", **changes)
        k = other.config.advance_forwards
        other._k = 0 if k == "auto" else int(k)
        other._search = None
        other._plans = {}
        other._full_batch = None
        other._bounds_link_timeout = False
        other._replica_fns = self._replica_fns[:1]
        other.batched = None
        other.meter = ActivationMeter(self._params)
        other.noise_scale = NoiseScale()  # its measurements are the caller's, not training's
        return other

    def reconfigure(self, config: PipelineConfig) -> bool:
        """Take a new M, N, k or averaging; returns whether the replicas were made anew (the caller then makes new
        optimizers with :meth:`optimizer`). Exact averaging under another N trains the same one model: nothing is
        made anew, and the optimizer and its state carry on."""
        old, self.config = self.config, config
        self._plans.clear()
        self._full_batch = None
        if config.advance_forwards != old.advance_forwards:
            self._search = None
            self._k = 0 if config.advance_forwards == "auto" else int(config.advance_forwards)
        if config.num_pipelines == old.num_pipelines and config.averaging == old.averaging:
            return False
        if self.one_model(old) and self.one_model(config):  # exact under another N: the same one model and optimizer
            return False
        self.elastic.wait()
        self._make_replicas()
        return True

    def one_model(self, config: PipelineConfig) -> bool:
        """Whether ``config`` trains one model per stage (exact averaging, or N·D = 1): no replicas to make."""
        return config.one_model(self.topology.num_groups)

    # -- the step's parts ----------------------------------------------------------------------------------------
    def plan(self, training: bool, units: int) -> Plan:
        """The validated plan for ``units`` units (cached; evaluation runs forwards only, in 1F1B order)."""
        k = self._k if training else 0
        key = (training, units, k)
        if key not in self._plans:
            batched = self.batched_p2p
            plan = build_plan(self.config.schedule, self.num_stages, units, k, training, int(not batched))
            self._plans[key] = validate_plan(plan, nccl=batched)
        return self._plans[key]

    def microbatches(self, batch: Any, training: bool) -> tuple[list[Any], list[float]]:
        """Split ``batch`` into M micro-batches and their shares of it, by the rules a user can rely on.

        A training batch must split into M equal parts, except an epoch's shorter last batch, which may split
        unevenly (losses are weighted by size) or, below M samples, into parts of one sample.
        """
        size = microbatch.batch_size(batch)
        m = self.num_microbatches
        if training:
            self._full_batch = max(size, self._full_batch or 0)
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

    # -- training ------------------------------------------------------------------------------------------------
    def train_step(
        self,
        batches: Sequence[Any],
        loss_fn: LossFn,
        *,
        inputs: Callable[[Any], Any] = first_input,
        accumulate: int = 1,
        forward_context: Context = contextlib.nullcontext,
        measure: bool = False,
        divergence: bool = False,
        noise: bool = False,
        param_names: Mapping[int, str] | None = None,
        key: str = "training_step",
        loss_scale: Any = None,
    ) -> StepResult:
        """Run one iteration: replica n trains on ``batches[n]``; gradients land in each replica's ``.grad``.

        Units are (replica, micro-batch) pairs, replica-major. A unit's loss is weighted by its share of its
        replica's batch (each replica's gradient is its own batch mean) and divided by ``accumulate``.

        Args:
            batches: the N batches of this iteration, one per parallel pipeline.
            loss_fn: on the last stage, ``(output, micro_batch, share) -> loss`` for one micro-batch, ``share``
                being its part of all N batches (to weight what is logged).
            inputs: micro-batch -> the first layer's input (first stage).
            accumulate: gradient accumulation steps the optimizer step spans.
            forward_context: entered around every forward and loss (autocast).
            measure: count the activation bytes every unit saves (saved-tensor hooks: costs time; the trace's
                ``peak_activation_bytes``); the step's timeline is always kept.
            divergence: also measure the replicas' distance to the reference over the pipeline (collective).
            noise: also measure the gradient noise (collective over the job; with ``accumulate`` 1 only).
            param_names: ``id(reference parameter) -> name`` for errors about non-finite gradients.
            key: a name that keeps this step's transfer metadata apart from other kinds of step.
            loss_scale: multiply every unit's loss by it before its backward (16-mixed's loss scale), so every
                stage's gradients are scaled; an overflow is then the scaler's to handle, not an error here.

        Raises:
            FloatingPointError: a loss (last stage) or a gradient (any stage) is not finite; names the stage,
                replica and parameter. The other stages then fail naming this one.
        """
        replicas = self.num_pipelines
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
        trace = StepTrace(self.stage)
        meter = self.meter if measure else None
        if meter is not None:
            meter.reset()
        self.elastic.follow_reference()  # frozen layers, eval-mode BatchNorm: as the user's module has them
        before = self._tied.before(replicas) if self.ties else None
        probe = None
        if noise and accumulate == 1 and GradientProbe.usable(replicas, len(micro)):
            params = [self.elastic.replica_params(n) for n in range(replicas)] if replicas > 1 else [self.params]
            sizes = [microbatch.batch_size(mb) for mb in micro]
            T = self.topology.tensor_parallel_size
            probe = GradientProbe(params, sizes, owner, skip=self.uncounted_params, tensor_parallel_size=T)
        if self.batched is not None:
            results = self._run_batched(
                key, micro, weights, owner, loss_fn, inputs, accumulate, forward_context, trace, meter, loss_scale
            )
        else:

            def head(u: int, output: Any) -> Tensor:
                loss = loss_of(loss_fn(output, micro[u], weights[u] / replicas), "training_step")
                return loss * (weights[u] / accumulate)

            results = self.executor.run(
                self.plan(True, len(micro)).stages[self.stage],
                [(key, microbatch.signature(mb)) for mb in micro],
                training=True,
                inputs=lambda u: inputs(micro[u]),
                head=head,
                forward_context=forward_context,
                stage_fn_for=lambda u: self._replica_fns[owner[u]],
                trace=trace,
                meter=meter,
                after_backward=probe.after_backward if probe is not None else None,
                loss_scale=loss_scale,
            )
        if self.ties:
            self._tied.sum(replicas, before, self.device)
        spread = self.divergence() if divergence else None
        norms = None
        if probe is not None:
            norms = probe.finish(self.topology.job_group, self.topology.num_groups, self.device)
            self.noise_scale.update(norms)
        if exact and self.topology.num_groups > 1:  # the D groups' gradients: one batch of D x N x B
            average_gradients(self.params, self.topology.stage_group, self.topology.num_groups, self.device)
        self.check_finite(results, param_names, gradients=loss_scale is None)
        if self.link is not None and self._bounds_link_timeout:
            self.link.timeout = self.config.p2p_timeout  # the first step may be slow; later ones are bounded
        loss = None
        if self.is_last and results:
            loss = torch.stack([r.float() for r in results.values()]).sum() * accumulate / replicas
        return StepResult(results, loss, samples, trace, spread, norms)

    def _run_batched(
        self,
        key: str,
        micro: list[Any],
        weights: list[float],
        owner: list[int],
        loss_fn: LossFn,
        inputs: Callable[[Any], Any],
        accumulate: int,
        forward_context: Context,
        trace: StepTrace,
        meter: ActivationMeter | None,
        loss_scale: Any = None,
    ) -> dict[int, Any]:
        """``replica_execution="batched"``: unit m carries micro-batch m of every replica, stacked (one vmap)."""
        assert self.batched is not None
        n = self.num_pipelines
        per = [[u for u in range(len(micro)) if owner[u] == r] for r in range(n)]
        if len({len(units) for units in per}) != 1 or len({microbatch.signature(micro[us[0]]) for us in per}) != 1:
            raise ValueError(
                "replica_execution='batched' needs the N batches of an iteration to have the same shape; use "
                "drop_last=True in the DataLoader or replica_execution='sequential'."
            )
        units = [[per[r][m] for r in range(n)] for m in range(len(per[0]))]  # unit m -> its N micro-batches

        def head(m: int, output: Any) -> Tensor:
            terms = [
                loss_of(loss_fn(select(output, r), micro[u], weights[u] / n), "training_step")
                * (weights[u] / accumulate)
                for r, u in enumerate(units[m])
            ]
            return torch.stack(terms).sum()

        batched = self.batched
        batched.begin()
        results = self.executor.run(
            self.plan(True, len(units)).stages[self.stage],
            [(key, "batched", microbatch.signature(micro[us[0]])) for us in units],
            training=True,
            inputs=lambda m: stack([inputs(micro[u]) for u in units[m]]),
            head=head,
            forward_context=forward_context,
            stage_fn_for=lambda m: batched,
            trace=trace,
            meter=meter,
            loss_scale=loss_scale,
        )
        batched.finish()
        return results

    @property
    def uncounted_params(self) -> set[int]:
        """Ids of the shared weights' copies a global gradient norm must not count on this stage."""
        return self._tied.uncounted()

    def check_finite(
        self, results: Mapping[int, Any], param_names: Mapping[int, str] | None = None, gradients: bool = True
    ) -> None:
        """Fail, naming stage, replica and where, on a non-finite loss (last stage) or gradient (every stage; not
        with ``gradients=False``: under loss scaling an overflow skips the step instead)."""
        where = f"stage {self.stage} (rank {self.topology.rank})"
        fix = "lower the learning rate, clip gradients (Trainer(gradient_clip_val=...)) or check the data"
        if results:
            losses = torch.stack([r.detach().float() for r in results.values()])
            if not bool(torch.isfinite(losses).all()):
                units = [u for u, r in results.items() if not bool(torch.isfinite(r))]
                raise FloatingPointError(f"{where}: the loss of unit(s) {units} is not finite; {fix}.")
        grads = [local(p.grad) if p.grad is not None else None for p in self._params] if gradients else []
        present = [g for g in grads if g is not None]
        if not present or bool(torch.isfinite(torch.stack(torch._foreach_norm(present))).all()):
            return
        per_replica = len(self._params) // max(1, self.elastic.num_replicas)
        reference = self.elastic.reference_params
        names = param_names or {}
        for i, g in enumerate(grads):
            if g is not None and not bool(torch.isfinite(g).all()):
                replica, j = divmod(i, max(1, per_replica))
                name = names.get(id(reference[j]), f"parameter {j}") if j < len(reference) else f"parameter {j}"
                raise FloatingPointError(
                    f"{where}: a non-finite gradient in replica {replica}, layer parameter '{name}'; {fix}."
                )

    def divergence(self) -> Tensor:
        """``(N,)``: ‖w_n − w_ref‖ / ‖w_ref‖ over all stages of this pipeline (collective over the pipeline).

        Waits for the previous step's reference update first (an overlapped all-reduce had the whole pipeline to
        hide behind).
        """
        self.elastic.wait()
        sums = torch.stack(self.elastic.divergence())  # (N, 2): ‖w_n - w_ref‖², ‖w_ref‖² on this stage
        if self.topology.tensor_parallel_size > 1:  # the stage's shards (whole tensors weighted 1/T: shards.py)
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.topology.tensor_group)
        if self.num_stages > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.topology.pipeline_group)
        return sums[:, 0].sqrt() / sums[:, 1].sqrt().clamp_min(1e-12)

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
        self.elastic.wait()  # evaluate the up-to-date reference
        self.elastic.require_whole("Evaluating the model")
        micro, shares = self.microbatches(batch, training=False)
        return self.executor.run(
            self.plan(False, len(micro)).stages[self.stage],
            [(key, microbatch.signature(mb)) for mb in micro],
            training=False,
            inputs=lambda u: inputs(micro[u]),
            head=lambda u, output: head(output, micro[u], shares[u]),
            forward_context=forward_context,
        )

    # -- what crosses the pipeline -------------------------------------------------------------------------------
    def share(self, payload: Any) -> Any:
        """``payload`` from this pipeline's last stage, on every stage (collective over the pipeline)."""
        if self.num_stages == 1:
            return payload
        box = [payload]
        src = self.topology.pipeline_ranks[-1]
        try:
            dist.broadcast_object_list(box, src=src, group=self.topology.pipeline_group)
        except RuntimeError as err:
            raise PeerFailureError(
                f"stage {self.stage} (rank {self.topology.rank}): the step's results from rank {src} (stage "
                f"{self.num_stages - 1}, the last) did not arrive: a rank of this pipeline failed, was killed or is "
                f"stuck. {first_failure()}({str(err).splitlines()[0][:160]})"
            ) from err
        return box[0]

    def share_tensor(self, tensor: Tensor) -> Tensor:
        """``tensor`` of this pipeline's last stage, in place on every stage (collective over the pipeline)."""
        if self.num_stages > 1:
            src = self.topology.pipeline_ranks[-1]
            try:
                dist.broadcast(tensor, src=src, group=self.topology.pipeline_group)
            except RuntimeError as err:
                raise PeerFailureError(
                    f"stage {self.stage} (rank {self.topology.rank}): the step's results from rank {src} (stage "
                    f"{self.num_stages - 1}, the last) did not arrive: a rank of this pipeline failed, was killed or "
                    f"is stuck. {first_failure()}({str(err).splitlines()[0][:160]})"
                ) from err
        return tensor

    def gather(self, obj: Any) -> list[Any] | None:
        """``obj`` of every stage of this pipeline, on its first stage (``None`` elsewhere; collective)."""
        if self.num_stages == 1:
            return [obj]
        dst = self.topology.pipeline_ranks[0]
        out: list[Any] | None = [None] * self.num_stages if self.topology.rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self.topology.pipeline_group)
        return out

    def figures(self, trace: StepTrace, static_bytes: float) -> Tensor:
        """``(S, 6)`` over the pipeline: step, compute, wait, bubble, activation peak, device peak (collective).

        The device peak is the allocator's on CUDA (weights and optimizer states included; reset here) and, on CPU,
        ``static_bytes`` (what the stage's tensors hold) plus the activation peak.
        """
        row = trace.summary()
        if self.device.type == "cuda":
            row.append(float(torch.cuda.max_memory_allocated(self.device)))
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            row.append(row[4] + static_bytes)
        mine = torch.tensor(row, dtype=torch.float64, device=self.device)
        rows = [mine]
        if self.num_stages > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.num_stages)]
            dist.all_gather(rows, mine, group=self.topology.pipeline_group)
        return torch.stack(rows).cpu()

    def static_bytes(self, optimizers: Sequence[Optimizer] = ()) -> float:
        """Bytes of this stage's weights (replicas and reference), gradients, optimizer states and averaging buffers."""
        elastic = self.elastic
        seen: set[int] = set()

        def count(tensors: Any) -> int:
            total = 0
            for t in map(local, tensors):  # a tensor-parallel shard: the part this rank holds
                if isinstance(t, Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            return total

        grads = [p.grad for p in self._params]
        inner = [o for opt in optimizers for o in getattr(opt, "replicas", [opt])]
        states = [v for opt in inner for st in opt.state.values() for v in st.values()]
        return float(
            count(self._params)
            + count(elastic.reference_params)
            + count(grads)
            + count(states)
            + count(elastic.buffers())
        )

    # -- advance forward: k ----------------------------------------------------------------------------------------
    def observe_k(self, table: Tensor) -> str | None:
        """One step's observation for ``advance_forwards="auto"`` (``table`` from :meth:`figures`); the decision is
        global rank 0's, broadcast to every rank. Returns the reason when this observation settled k."""
        if self.config.schedule != "advance" or self.config.advance_forwards != "auto":
            return None
        units = self.num_microbatches * (1 if self.batched is not None else self.num_pipelines)
        if self._search is None:
            limit = memory_limit_bytes(self.config.memory_limit, self.device, self.processes)
            self._search = AdvanceSearch(max_k=max_advance_forwards(self.num_stages, units), memory_limit=limit)
        search = self._search
        if search.settled:
            return None
        peaks = [float(v) for v in table[:, 4]]  # what k + 1 would add follows the peak stash's closed form
        search.observe(float(table[:, 0].max()), peaks, added_bytes(peaks, self.num_stages, units, self._k))
        decision = torch.tensor([search.k, int(search.settled)], dtype=torch.int64, device=self.device)
        if self.topology.world_size > 1:  # global rank 0 decides for the whole job
            dist.broadcast(decision, src=0, group=self.topology.job_group)
        search.k, search.settled = int(decision[0]), bool(decision[1])
        self._k = search.k
        return (search.reason or f"settled on {search.k} (rank 0)") if search.settled else None

    # -- activation checkpointing: "auto" --------------------------------------------------------------------------
    @property
    def measuring_memory(self) -> bool:
        """Whether ``activation_checkpointing="auto"`` still needs a step's figures to decide."""
        return self.config.activation_checkpointing == "auto" and self._recompute_seen >= 0

    def observe_memory(self, table: Tensor) -> str | None:
        """``activation_checkpointing="auto"``: from the second measured step (the optimizer's state exists by then),
        every stage whose device peak (``table`` from :meth:`figures`, column 5; the largest over the stage's groups and
        tensor shards, and the smallest limit: collective over the job) is above ``memory_limit`` checkpoints all its
        layers, so every rank of a stage decides alike; returns what was decided."""
        if not self.measuring_memory:
            return None
        self._recompute_seen += 1
        if self._recompute_seen < 2:
            return None
        self._recompute_seen = -1  # decided
        limit = memory_limit_bytes(self.config.memory_limit, self.device, self.processes)
        if limit is None:  # the same configuration on every rank
            return "off: no memory_limit to keep under"
        # every rank of a stage decides alike (under tensor parallelism recomputation adds collectives): the peaks'
        # maximum and the limits' minimum over the job, in one all-reduce
        values = torch.cat([table[:, 5].double(), torch.tensor([-float(limit)], dtype=torch.float64)])
        if self.topology.world_size > 1:
            values = values.to(self.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.topology.job_group)
        *peak, limit = values.tolist()
        limit = -limit
        over = [s for s, p in enumerate(peak) if p > limit]
        if self.stage in over:
            self.set_recompute([True] * len(self.layers))
        if not over:
            return f"off: every stage's peak is under memory_limit ({limit / 2**20:.1f} MiB)"
        named = ", ".join(f"stage {s} {peak[s] / 2**20:.1f} MiB" for s in over)
        return f"on for every layer of stage(s) {over}: peaks {named} above memory_limit ({limit / 2**20:.1f} MiB)"

    def set_recompute(self, mask: Sequence[bool]) -> None:
        """Checkpoint the layers in ``mask`` from the next step on (every replica's copy of them); under
        ``activation_checkpointing="auto"`` that is the decision, and nothing more is measured for it."""
        self._recompute_seen = -1
        self.recompute = list(mask)
        self.executor.stage_fn = self._stage_function(self.layers)
        self._replica_fns = [self._stage_function(layers) for layers in self.elastic.replicas]

    @property
    def measuring_k(self) -> bool:
        """Whether ``advance_forwards="auto"`` still needs every step's figures."""
        cfg = self.config
        return (
            cfg.schedule == "advance"
            and cfg.advance_forwards == "auto"
            and not (self._search is not None and self._search.settled)
        )

    def write_trace(self, trace: StepTrace, path: Path, title: str) -> tuple[Path, Path | None] | None:
        """Gather the step's timelines of every stage and write them (first pipeline's first stage; collective)."""
        gathered = self.gather(trace.spans)
        if gathered is None or self.topology.group_index != 0:
            return None
        names = [f"stage {s} (rank {r})" for s, r in enumerate(self.topology.pipeline_ranks)]
        return write_trace(path, gathered, title, names)

    def describe(self) -> str:
        cfg = self.config
        return (
            f"{cfg.schedule}"
            + (f" k={self._k}" if cfg.schedule == "advance" else "")
            + f", S={self.num_stages}, M={self.num_microbatches}, N={self.num_pipelines}"
        )


def reconfigured(config: PipelineConfig, **changes: Any) -> PipelineConfig:
    """``config`` with the given fields changed (``None`` values are left as they are)."""
    return replace(config, **{k: v for k, v in changes.items() if v is not None})
