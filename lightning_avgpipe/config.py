"""The pipeline configuration: a frozen dataclass mapped one to one onto AvgPipeStrategy's keyword arguments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Union

from lightning_avgpipe.algorithms.elastic import check_alpha, check_outer
from lightning_avgpipe.checks import is_int, is_number
from lightning_avgpipe.schedules import check_schedule_name
from lightning_avgpipe.schedules.generate import check_schedule_costs, check_stages_per_rank

AVERAGING = ("elastic", "exact")  # how the N batches of a step combine (PipelineConfig.averaging)
Spec = bool | str | tuple[str, ...]  # activation_checkpointing normalised: all, none, "auto" or layer class names
PartitionSpec = Union[str, Sequence[int]]
PARTITION_METHODS: tuple[str, ...] = ("balanced", "parameters", "uniform")


def check_partition(
    partition: PartitionSpec, num_layers: int | None = None, num_stages: int | None = None, stages_per_rank: int = 1
) -> None:
    """Raise a ``ValueError`` naming the fix when ``partition`` cannot describe ``num_layers`` over ``num_stages``
    (the model's stages: ranks x ``stages_per_rank``)."""
    if isinstance(partition, str):
        if partition not in PARTITION_METHODS:
            raise ValueError(
                f"partition={partition!r} is not a known method. Use one of {list(PARTITION_METHODS)} "
                "or a list with the number of layers of each stage, for example [3, 5]."
            )
        if num_layers is not None and num_stages is not None and num_layers < num_stages:
            raise ValueError(
                f"{_stages(num_stages, stages_per_rank)} is more than the {num_layers} layers configure_pipeline() "
                f"returns; use at most {num_layers} stages or split the model into more layers."
            )
        return
    sizes = list(partition)
    if not sizes or not all(is_int(n, 1) for n in sizes):
        raise ValueError(f"partition={sizes!r} must list a positive layer count per stage, for example [3, 5].")
    if num_stages is not None and len(sizes) != num_stages:
        raise ValueError(
            f"partition={sizes} has {len(sizes)} entries but {_stages(num_stages, stages_per_rank)}; give one layer "
            "count per stage, in stage order."
        )
    if num_layers is not None and sum(sizes) != num_layers:
        raise ValueError(
            f"partition={sizes} sums to {sum(sizes)} layers but configure_pipeline() returns {num_layers}; "
            "make the counts add up to the number of layers."
        )


def _stages(num_stages: int, stages_per_rank: int) -> str:
    """``num_stages=4``, or with several stages per rank ``num_stages=2 x stages_per_rank=2 = 4 stages``."""
    if stages_per_rank == 1:
        return f"num_stages={num_stages}"
    return f"num_stages={num_stages // stages_per_rank} x stages_per_rank={stages_per_rank} = {num_stages} stages"


def check_checkpointing(spec: Any) -> Spec:
    """``activation_checkpointing``: ``False``, ``True`` (every layer), ``"auto"`` (every layer of a stage whose
    measured peak exceeds ``memory_limit``) or layer types (classes or class names)."""
    if isinstance(spec, bool) or spec == "auto":
        return spec
    values = [spec] if isinstance(spec, (str, type)) else list(spec) if isinstance(spec, (list, tuple)) else None
    if not values or any(not (isinstance(v, str) and v) and not isinstance(v, type) for v in values):
        raise ValueError(
            f"activation_checkpointing={spec!r} must be True (every layer), False, 'auto', or layer types: classes "
            "such as [nn.TransformerEncoderLayer] or their names such as ['Block']."
        )
    return tuple(v if isinstance(v, str) else v.__name__ for v in values)


LEVELS = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")  # ZeRO-0 .. ZeRO-3
ALIASES = {"zero0": "NO_SHARD", "zero1": "SHARD_OPTIM", "zero2": "SHARD_GRAD_OP", "zero3": "FULL_SHARD"}
REDUCE = ("per_microbatch", "per_step")


def level_of(name: Any) -> str:
    """The level ``name`` gives (an FSDP-style name or ``"zero1"``..``"zero3"``, case-insensitive)."""
    if isinstance(name, str):
        key = name.strip()
        if key.upper() in LEVELS:
            return key.upper()
        alias = ALIASES.get(key.lower().replace("-", "").replace("_", ""))
        if alias is not None:
            return alias
    raise ValueError(
        f"sharding_strategy={name!r} is not one of {list(LEVELS)} (or 'zero1', 'zero2', 'zero3'): 'SHARD_OPTIM' "
        "shards the optimizer state over the D pipeline groups (ZeRO-1), 'SHARD_GRAD_OP' the gradients too (ZeRO-2), "
        "'FULL_SHARD' the weights too (ZeRO-3)."
    )


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is pipelined. Each field is the :class:`~lightning_avgpipe.AvgPipeStrategy` argument of the same
    name, with the same default: the strategy builds its config from those arguments, and ``tests/test_arguments.py``
    holds the two together. What each field means and when to change it: docs/arguments.md (generated from the
    strategy's docstring)."""

    num_stages: int | None = None
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    advance_forwards: int | str = "auto"
    stages_per_rank: int | None = None
    schedule_costs: tuple[float, float, float] | None = None
    memory_limit: float | None = None
    partition: str | Sequence[int] = "balanced"
    num_pipelines: int = 1
    averaging: str = "elastic"
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    averaging_period: int = 1
    elastic_alpha: float | None = None
    sync_reference: bool | None = None
    replica_execution: str = "sequential"
    p2p: str = "auto"
    trace_dir: str | None = None
    trace_steps: Sequence[int] = (2,)
    p2p_timeout: float = 30.0
    timeout: float = 1800.0
    activation_checkpointing: Any = False
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    tensor_parallel_mode: str = "1d"
    tensor_parallel_depth: int = 1
    shard_optimizer_state: bool = False
    sharding_strategy: str = "NO_SHARD"
    reduce_gradients: str = "per_microbatch"

    @property
    def grid(self) -> tuple[int, int] | None:
        """``(d, q)``: the d x q x q grid of a stage's tensor group under ``tensor_parallel_mode`` ``"2d"`` (d = 1) or
        ``"2.5d"``; None under ``"1d"``."""
        if self.tensor_parallel_mode == "1d":
            return None
        d = self.tensor_parallel_depth
        return d, round((self.tensor_parallel_size // d) ** 0.5)

    @property
    def synchronous_reference(self) -> bool:
        """Whether the reference update across groups finishes inside the step: ``sync_reference``, or for ``None``
        whether the state is sharded (a sharded reference's update is synchronous)."""
        return self.shard_optimizer_state if self.sync_reference is None else self.sync_reference

    def __post_init__(self) -> None:
        self._check_layout()
        self._check_schedule()
        self._check_averaging()
        self._check_runtime()

    def _check_layout(self) -> None:
        """Stages, micro-batches, the partition, tensor parallelism and how replicas run."""
        if not is_int(self.tensor_parallel_size, 1):
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size!r} must be an int >= 1 (1: no tensor parallelism); "
                "use a divisor of the devices per node, such as 2."
            )
        if self.num_stages is not None and not is_int(self.num_stages, 1):
            raise ValueError(f"num_stages={self.num_stages!r} must be an int >= 1 (or None for all devices).")
        m = self.num_microbatches
        if m is not None and not is_int(m, 1):
            raise ValueError(
                f"num_microbatches={m!r} must be an int >= 1 (or None for 2 x num_stages); it splits each batch."
            )
        if self.replica_execution not in ("sequential", "batched"):
            raise ValueError(f"replica_execution={self.replica_execution!r} is not one of ['sequential', 'batched'].")

    def _check_schedule(self) -> None:
        """The schedule, k, the memory limit and activation checkpointing."""
        object.__setattr__(self, "schedule", check_schedule_name(self.schedule))
        v = check_stages_per_rank(self.schedule, self.stages_per_rank)
        if v > 1 and (self.tensor_parallel_size > 1 or self.replica_execution == "batched"):
            raise ValueError(
                f"schedule={self.schedule!r} ({v} stages per rank) runs with tensor_parallel_size=1 and "
                "replica_execution='sequential' only; use schedule='zbh1' for one stage per rank."
            )
        object.__setattr__(self, "schedule_costs", check_schedule_costs(self.schedule, self.schedule_costs))
        if not isinstance(self.partition, str):
            object.__setattr__(self, "partition", tuple(self.partition))
            model_stages = None if self.num_stages is None else self.num_stages * v
            check_partition(self.partition, num_stages=model_stages, stages_per_rank=v)
        else:
            check_partition(self.partition)
        k = self.advance_forwards
        if k != "auto" and not is_int(k, 0):
            raise ValueError(
                f"advance_forwards={self.advance_forwards!r} must be an int >= 0 (0 gives 1F1B) or 'auto'."
            )
        limit = self.memory_limit
        if limit is not None and (not is_number(limit) or limit <= 0):
            raise ValueError(
                f"memory_limit={limit!r} must be a number of bytes, or a fraction in (0, 1] of the device's memory."
            )
        if self.schedule in ("zbh1", "zbadvance", "zbv") and self.replica_execution == "batched":
            raise ValueError(
                f"schedule={self.schedule!r} with replica_execution='batched' is not supported (the weight gradients "
                "are deferred per layer, which torch.func.vmap does not allow); use replica_execution='sequential', "
                "or schedule='1f1b'."
            )
        spec = check_checkpointing(self.activation_checkpointing)
        object.__setattr__(self, "activation_checkpointing", spec)
        if spec and self.replica_execution == "batched":
            raise ValueError(
                "activation_checkpointing with replica_execution='batched' is not supported (torch.func.vmap over "
                "checkpointed layers); use replica_execution='sequential', or turn activation_checkpointing off."
            )

    def _check_averaging(self) -> None:
        """N, the averaging, its outer optimizer and period, alpha, and the sharded state."""
        n = self.num_pipelines
        if not is_int(n, 1):
            raise ValueError(f"num_pipelines={n!r} must be an int >= 1 (1 = plain pipeline training).")
        if self.averaging not in AVERAGING:
            raise ValueError(
                f"averaging={self.averaging!r} is not one of {list(AVERAGING)}; 'exact' trains the N batches of a step "
                "as one batch of N x B, 'elastic' is the paper's rule."
            )
        check_outer(self.outer_lr, self.outer_momentum, self.averaging_period)
        if self.averaging == "exact" and (
            self.outer_lr != 1.0 or self.outer_momentum != 0.0 or self.averaging_period != 1
        ):
            raise ValueError(
                f"averaging='exact' trains one model, which has no reference to step: outer_lr={self.outer_lr!r}, "
                f"outer_momentum={self.outer_momentum!r} and averaging_period={self.averaging_period!r} apply to "
                "averaging='elastic'. Use averaging='elastic', or leave them at 1.0, 0.0 and 1."
            )
        if self.elastic_alpha is not None:
            check_alpha(self.elastic_alpha)
        self._check_sharding()

    def _check_grid(self) -> None:
        """``tensor_parallel_mode`` and ``tensor_parallel_depth`` against ``tensor_parallel_size``."""
        mode, d, T = self.tensor_parallel_mode, self.tensor_parallel_depth, self.tensor_parallel_size
        if mode not in ("1d", "2d", "2.5d"):
            raise ValueError(
                f"tensor_parallel_mode={mode!r} is not one of ['1d', '2d', '2.5d']: '1d' splits each layer's weights "
                "over T ranks (Megatron's), '2d' weights and activations over a q x q grid (T = q x q), '2.5d' over "
                "d copies of that grid (T = d x q x q, tensor_parallel_depth=d)."
            )
        if not is_int(d, 1) or (mode == "2.5d") != (d > 1):
            raise ValueError(
                f"tensor_parallel_depth={d!r} with tensor_parallel_mode={mode!r}: the depth d is an int >= 2 under "
                "'2.5d' (T = d x q x q) and 1 otherwise; set tensor_parallel_mode='2.5d' with a depth of 2 or more, "
                "or tensor_parallel_depth=1."
            )
        q = round((T // d) ** 0.5) if T % d == 0 else 0
        if mode != "1d" and (q < 2 or d * q * q != T):
            raise ValueError(
                f"tensor_parallel_mode={mode!r} needs tensor_parallel_size = {'d x ' if d > 1 else ''}q x q with q >= 2"
                f" (d = tensor_parallel_depth = {d}), but tensor_parallel_size={T}: use {d * 4} or {d * 9} ranks per "
                "stage, or tensor_parallel_mode='1d'."
            )
        if mode != "1d" and self.sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True with tensor_parallel_mode={mode!r}: the grid splits the sequence already "
                "(each grid row holds a part of it); set sequence_parallel=False."
            )

    def _check_sharding(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or False.")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True cuts the sequence over the tensor_parallel_size shards of a stage, but "
                "tensor_parallel_size=1: set tensor_parallel_size > 1, or sequence_parallel=False."
            )
        self._check_grid()
        if not isinstance(self.shard_optimizer_state, bool):
            raise ValueError(f"shard_optimizer_state={self.shard_optimizer_state!r} must be True or False.")
        level = level_of(self.sharding_strategy)
        if self.grid is not None and level in ("SHARD_GRAD_OP", "FULL_SHARD"):
            raise ValueError(
                f"sharding_strategy={self.sharding_strategy!r} with tensor_parallel_mode="
                f"{self.tensor_parallel_mode!r}: FSDP over the grid's 3D weights is not supported; use 'NO_SHARD' or "
                "'SHARD_OPTIM', or tensor_parallel_mode='1d'."
            )
        if self.shard_optimizer_state and level not in ("NO_SHARD", "SHARD_OPTIM"):
            raise ValueError(
                f"shard_optimizer_state=True with sharding_strategy={self.sharding_strategy!r}: "
                "shard_optimizer_state=True is sharding_strategy='SHARD_OPTIM' (ZeRO-1), and the two name one choice. "
                f"Give sharding_strategy={level!r} alone (it shards the optimizer state too)."
            )
        if level == "SHARD_OPTIM" or self.shard_optimizer_state:
            level = "SHARD_OPTIM"
            object.__setattr__(self, "shard_optimizer_state", True)
        object.__setattr__(self, "sharding_strategy", level)
        if self.reduce_gradients not in REDUCE:
            raise ValueError(
                f"reduce_gradients={self.reduce_gradients!r} is not one of {list(REDUCE)}: 'per_microbatch' "
                "reduce-scatters each micro-batch's gradients into a shard, 'per_step' accumulates them whole and "
                "reduces once at the end of the step (less traffic, the memory of ZeRO-1)."
            )
        if self.fsdp and self.averaging != "exact":
            raise ValueError(
                f"sharding_strategy={level!r} shards one model over the D pipeline groups, which needs "
                f"averaging='exact' (under averaging={self.averaging!r} each group trains a replica of its own). Use "
                "averaging='exact', or sharding_strategy='SHARD_OPTIM' (ZeRO-1, which also shards the elastic "
                "reference's optimizer state)."
            )
        if self.sync_reference is not None and not isinstance(self.sync_reference, bool):
            raise ValueError(f"sync_reference={self.sync_reference!r} must be True, False or None.")
        if self.shard_optimizer_state and self.sync_reference is False:
            raise ValueError(
                "sync_reference=False with shard_optimizer_state=True: the sharded state is updated inside the step "
                "(a sharded elastic reference is gathered at the end of every step, so its update cannot overlap the "
                "next one). Leave sync_reference=None (or True), or turn sharding off."
            )

    def _check_runtime(self) -> None:
        """Transfers, timeouts and traces."""
        if self.p2p not in ("auto", "eager", "batched"):
            raise ValueError(f"p2p={self.p2p!r} is not one of ['auto', 'eager', 'batched']; 'auto' suits most jobs.")
        t = self.p2p_timeout
        if not is_number(t) or not t > 0:
            raise ValueError(f"p2p_timeout={t!r} must be a positive number of seconds.")
        if not is_number(self.timeout) or not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r} must be a positive number of seconds.")
        steps = self.trace_steps
        if isinstance(steps, (str, bytes)) or not all(is_int(s) for s in steps):
            raise ValueError(f"trace_steps={steps!r} must be a list of training step numbers, e.g. [2, 100].")
        object.__setattr__(self, "trace_steps", tuple(steps))

    @property
    def fsdp(self) -> bool:
        """Whether each stage is sharded over its stage group with FSDP (ZeRO-2 or ZeRO-3)."""
        return self.sharding_strategy in ("SHARD_GRAD_OP", "FULL_SHARD")

    @property
    def exact(self) -> bool:
        """Whether the N batches of a step train one model as one batch (``averaging="exact"``)."""
        return self.averaging == "exact"

    def one_model(self, num_groups: int) -> bool:
        """Whether each stage trains one model (exact averaging, or N·D = 1 with ``num_groups`` = D): no replicas."""
        return self.exact or self.num_pipelines * num_groups == 1

    @property
    def chunks_per_rank(self) -> int:
        """v, the model chunks every rank runs: ``stages_per_rank``, or the schedule's default (2 for
        ``interleaved`` and ``zbv``, else 1)."""
        return check_stages_per_rank(self.schedule, self.stages_per_rank)

    def microbatches_for(self, num_stages: int) -> int:
        return self.num_microbatches if self.num_microbatches is not None else 2 * num_stages


CONFIG_FIELDS = frozenset(f.name for f in fields(PipelineConfig))  # the strategy's arguments that make the config


def check_same_placement(old: PipelineConfig, new: PipelineConfig) -> None:
    """A running pipeline may change schedule only where the model stays cut as it is: one stage per rank before
    and after (``1f1b``, ``zbh1``, ``advance``, ...), or the same chunked schedule and v."""
    if new.chunks_per_rank != old.chunks_per_rank or (new.chunks_per_rank > 1 and new.schedule != old.schedule):
        raise ValueError(
            f"reconfigure to schedule={new.schedule!r} ({new.chunks_per_rank} stage(s) per rank) from "
            f"{old.schedule!r} ({old.chunks_per_rank}): the model is cut for the old placement. Start a new fit with "
            f"AvgPipeStrategy(schedule={new.schedule!r})."
        )
