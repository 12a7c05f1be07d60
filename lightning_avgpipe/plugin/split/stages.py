"""Splitting a LightningModule into its stages, and putting it back (docs/how-it-works.md#lightning-integration).

Each rank keeps the layers of its stage; a layer that lives on another stage is replaced by a placeholder
(``plugin/split/placeholders.py``), so the module tree and its ``state_dict`` keys stay those of the unsplit model. The
owned layers refuse direct calls from a user step (the output of a step comes from ``self(x)``), and
``example_input_array`` is hidden while the model is split: summaries and graph loggers would run ``forward`` on one
rank, which a split model cannot do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.config import check_partition
from lightning_avgpipe.errors import PipelineContractError
from lightning_avgpipe.partition import partition_layers
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.checkpoint.resume import checkpoint_layout
from lightning_avgpipe.plugin.contract import check_forward, locate, pipeline_inputs
from lightning_avgpipe.plugin.split.hints import build_step, meta_build_error
from lightning_avgpipe.plugin.split.placeholders import Anchor, Elsewhere, Guard, Kept, guard_layers
from lightning_avgpipe.plugin.split.second_paths import announce_second_paths, second_paths
from lightning_avgpipe.plugin.steps.data import peek
from lightning_avgpipe.runtime.build.init_record import InitRecord
from lightning_avgpipe.runtime.build.materialize import Materialized, Shard, materialize
from lightning_avgpipe.runtime.failures.console import mark
from lightning_avgpipe.shards import is_dtensor


@dataclass
class SplitModule:
    """What splitting did to the module on this rank, to undo and to redo it."""

    module: nn.Module
    owned: list[nn.Module]
    partition: list[int]
    full_keys: list[str]  # the unsplit model's state_dict keys, in order (checkpoints keep them)
    guard: Guard
    example_input: Any = None
    handles: list[Any] = field(default_factory=list)
    # the unsplit model's parameter names in order (a shared weight once, under its first name), and every name a
    # parameter has there (a weight shared by two layers has two) -> that first name
    param_names: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    stages: list[int] = field(default_factory=list)  # this rank's model stages, in order (several: chunks)
    tensor_split: bool = False  # its layers were split over the tensor group on the meta device, before made real
    kept: Kept | None = None  # rank 0, a model built whole: the other stages' layers, to bring back after a run

    @property
    def chunk_sizes(self) -> list[int]:
        """The layer counts of this rank's stages, in stage order (``owned`` holds them all, in that order)."""
        return [self.partition[j] for j in self.stages]

    def names(self) -> dict[str, nn.Module]:
        qualified = {id(m): n for n, m in self.module.named_modules()}
        return {qualified[id(m)]: m for m in self.owned}

    def put_back(self, values: dict[str, Tensor]) -> None:
        """After a run, on rank 0: the other stages' layers back in the module, with their trained ``values`` (by
        state-dict name): the user's module is the whole trained model again."""
        assert self.kept is not None
        for name, t in self.kept.tensors.items():
            t.data = values[name]
        self.kept.place(layers=True)
        self.kept.whole = True

    @contextmanager
    def as_split(self) -> Iterator[None]:
        """The placeholders in place for a while (the strategy's own use of the module after a run, a checkpoint)."""
        whole = self.kept is not None and self.kept.whole
        if whole:
            self.kept.place(layers=False)  # type: ignore[union-attr]
        try:
            yield
        finally:
            if whole:
                self.kept.place(layers=True)  # type: ignore[union-attr]

    def guard_again(self) -> None:
        """A later fit/validate with this strategy: split again (rank 0's module was whole after the last run),
        guard the layers and hide the example input again."""
        if self.kept is not None and self.kept.whole:
            self.kept.take_away()
        self.module.example_input_array = None  # type: ignore[assignment]
        if not self.handles:
            self.handles = guard_layers(self.names(), self.guard)

    def release(self) -> None:
        """After a fit: the owned layers callable again, the example input back."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.example_input is not None:
            self.module.example_input_array = self.example_input  # type: ignore[assignment]


def already_split(module: nn.Module) -> bool:
    return any(isinstance(m, Elsewhere) for m in module.modules())


def split_module(
    module: nn.Module,
    layers: list[nn.Module],
    sizes: list[int],
    stages: Sequence[int],
    guard: Guard,
    keep: bool = False,
) -> SplitModule:
    """Keep ``layers``' share of ``stages`` (this rank's model stages; ``sizes`` layers per stage) in ``module``;
    placeholders for the rest. ``owned`` lists the kept layers in stage order. With ``keep`` (rank 0, a model built
    whole) the other layers are kept aside with their tensors' storage released (:class:`Kept`)."""
    if already_split(module):
        raise ValueError(
            f"This {type(module).__name__} was already split into stages by another AvgPipeStrategy (it holds "
            "placeholders for layers that lived on other ranks). Give each Trainer a fresh module, for example "
            "MyModule.load_from_checkpoint(path), or reuse the same Trainer."
        )
    full_keys = list(module.state_dict().keys())
    first: dict[int, str] = {}
    aliases = {n: first.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    param_names = [n for n, _ in module.named_parameters()]
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    owned = [layer for layer, s in zip(layers, stage_of) if s in stages]
    qualified = {id(m): n for n, m in module.named_modules()}
    found = second_paths(module, layers, stage_of)
    spots: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
    tensors: dict[str, Tensor] = {}
    if keep:
        own = {id(t) for layer in owned for t in [*layer.parameters(), *layer.buffers()]}
        away = {
            id(t)
            for layer, s in zip(layers, stage_of)
            if s not in stages
            for t in [*layer.parameters(), *layer.buffers()]
        }
        seen: set[int] = set()
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in away - own and id(t) not in seen:
                seen.add(id(t))
                tensors[name] = t

    def replace(parent: nn.Module, attr: str, placeholder: Elsewhere) -> None:
        if keep:
            spots.append((parent, attr, getattr(parent, attr), placeholder))
        setattr(parent, attr, placeholder)

    for layer, owner in zip(layers, stage_of):
        if owner not in stages:
            for parent, attr in locate(module, layer):
                replace(parent, attr, Elsewhere(qualified[id(layer)], owner, guard))
    for alias in found:  # a layer's module under another name: a placeholder too, where no own layer holds it
        if not alias.stages & set(stages):
            replace(alias.parent, alias.attr, Elsewhere(alias.name, min(alias.stages), guard))
    announce_second_paths(found)
    example = getattr(module, "example_input_array", None)
    module.example_input_array = None  # type: ignore[assignment]
    if not any(True for layer in owned for _ in layer.parameters()):
        module._avgpipe_anchor = Anchor()  # a parameter-free stage still builds the user's optimizer
    split = SplitModule(module, owned, list(sizes), full_keys, guard, example, [], param_names, aliases, list(stages))
    split.handles = guard_layers(split.names(), guard)
    if keep:
        split.kept = Kept(spots, tensors, {n: tuple(t.shape) for n, t in tensors.items()})
        split.kept.release()
    return split


@contextmanager
def recorded_build(precision_context: ContextManager[Any], records: list[InitRecord]) -> Iterator[None]:
    """Build on the meta device under ``precision_context`` (the precision's default dtype), recording the build
    into ``records``; a value read there (``.item()``, ``if`` on a tensor) or ``from_pretrained`` fails saying why and
    what to do (``plugin/split/hints.py``), and any error of the build is said in short
    (``runtime/failures/console.py``)."""
    record = InitRecord()
    try:
        with torch.device("meta"), precision_context, record:
            yield
    except Exception as err:  # said in short, the user's message first (runtime/failures/console.py)
        step = build_step(err)
        said = meta_build_error(err)
        if said is not None:
            mark(said, step)
            raise said from err
        mark(err, step)
        raise
    records.append(record)


def own_layers(
    module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int], stages: Sequence[int]
) -> dict[str, nn.Module]:
    """This rank's layers (of its model ``stages``; ``sizes`` layers per stage) by their names in ``module``."""
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    qualified = {id(m): n for n, m in module.named_modules()}
    return {qualified[id(layer)]: layer for layer, s in zip(layers, stage_of) if s in stages}


def materialize_own(
    module: nn.Module,
    layers: Sequence[nn.Module],
    sizes: Sequence[int],
    stages: Sequence[int],
    records: Sequence[InitRecord],
    device: torch.device,
    forward_note: str | None = None,
    shards: Sequence[Shard] = (),
) -> Materialized:
    """On a model built on the meta device: make real, with one process's values, the parameters and buffers of
    this rank's ``stages`` and those outside every layer (``runtime/build/materialize.py``), and of the tensors split on
    the meta device (``shards``) only this rank's shards; the rest stays on the meta device until the split
    replaces it. Logs what rank 0 made real and what was skipped."""
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    own = {id(t) for layer, s in zip(layers, stage_of) if s in stages for t in [*layer.parameters(), *layer.buffers()]}
    total = sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in [*module.parameters(), *module.buffers(), *(s[1] for s in shards)]}.values()
        if not is_dtensor(t)
    )
    report = materialize(module, lambda t: id(t) in own or id(t) not in inside, records, device, shards)
    left = _still_meta(module, layers, stage_of, stages)
    if left:
        raise ValueError(
            f"AvgPipe: {left[:5]} of this rank are still on the meta device after the build was replayed: they were "
            "not created by configure_model's build (or a trainer.init_module() block), or are neither parameters "
            "nor buffers (a torchmetrics metric's state). Create them there as parameters or buffers, or outside "
            "both blocks."
        )
    notes = ["layer timing was skipped: no process holds the whole model"]
    if forward_note:
        notes.append(forward_note)
    if report.uninitialized:
        notes.append(f"no recorded call gave values to {report.uninitialized[:5]} (left as torch.empty gave them)")
    if report.rng_moved:
        notes.append(
            "the random generator was used between the build and setup: random draws after it differ from one process's"
        )
    rank_zero_info(
        f"AvgPipe: the model was built without memory; each rank makes only its own stages real, with the values one "
        f"process gives them (rank 0: {_size(report.kept_bytes)} of {_size(total)}, {report.steps} init calls "
        f"replayed, at most {_size(report.peak_other_bytes)} of other ranks' tensors at once); "
        + "; ".join(notes)
        + "."
    )
    return report


def _still_meta(
    module: nn.Module, layers: Sequence[nn.Module], stage_of: Sequence[int], stages: Sequence[int]
) -> list[str]:
    """The names of this rank's tensors (its own layers' and those outside every layer: parameters, buffers and
    tensor attributes) still on the meta device."""
    mine = {id(m) for layer, s in zip(layers, stage_of) if s in stages for m in layer.modules()}
    # by module, not by layer: a wrapper layer's module is reached through the model's own attributes too
    others = {id(m) for layer, s in zip(layers, stage_of) if s not in stages for m in layer.modules()} - mine
    left: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        if id(mod) in others:
            return
        for key, value in vars(mod).items():
            if isinstance(value, Tensor) and value.is_meta:
                left.append(prefix + key)
        for key, value in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if value.is_meta:
                left.append(prefix + key)
        for key, child in mod.named_children():
            walk(child, f"{prefix}{key}.")

    walk(module, "")
    return left


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_layer_count(num_layers: int, stages: int, stages_per_rank: int = 1) -> None:
    """Refuse more model stages (``stages``: ranks x ``stages_per_rank``) than layers."""
    check_partition("uniform", num_layers, stages, stages_per_rank)


def choose_partition(
    module: nn.Module, layers: list[nn.Module], spec: Any, stages: int, v: int = 1, deferred: bool = False
) -> list[int]:
    """Layers per model stage (``stages`` of them: ranks x ``v``): ``spec`` (a list of counts, or ``"balanced"``,
    ``"parameters"``, ``"uniform"``), or the checkpoint's cut on a resumed ``fit`` (called on one rank:
    ``"balanced"`` times the layers, except on a model built without memory (``deferred``): by parameters)."""
    check_layer_count(len(layers), stages, v)
    if not isinstance(spec, str):
        return partition_layers(layers, stages, list(spec), stages_per_rank=v)
    resumed = _resumed_partition(module, stages, len(layers))
    if resumed is not None:
        return resumed
    sample = getattr(module, "example_input_array", None)
    if spec == "balanced" and sample is not None and deferred:
        rank_zero_info(
            "AvgPipe: partition='balanced' balances by parameters: the model was built without memory "
            "(configure_model), so no process holds it whole to time its layers."
        )
        sample = None
    elif spec == "balanced" and sample is None:
        rank_zero_info(
            "AvgPipe: partition='balanced' profiles layers on `example_input_array`, which this module does not set; "
            "balancing by parameters instead."
        )
    return partition_layers(layers, stages, spec, sample, v)


def _resumed_partition(module: nn.Module, stages: int, num_layers: int) -> list[int] | None:
    """On a resumed ``fit``, the partition the checkpoint was saved with (when it fits this model and S).

    ``"balanced"`` times the layers, and timing noise gives another cut from run to run; a resumed run must cut as
    the checkpoint did, or its optimizer states and replicas would be dropped as another layout's.
    """
    trainer = compat.attached_trainer(module)
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    path = compat.resuming_from(trainer)
    layout = checkpoint_layout(path) if path is not None else None
    saved = layout.get("partition") if layout else None
    if not isinstance(saved, list) or len(saved) != stages or sum(saved) != num_layers or min(saved) < 1:
        return None
    rank_zero_info(f"AvgPipe: resuming; cutting the model as the checkpoint was cut, partition={saved}.")
    return [int(v) for v in saved]


def check_forward_of(module: nn.Module, layers: list[nn.Module], sample: Any, deferred: bool) -> str | None:
    """``check_forward`` on ``sample``; on a model built without memory, on the meta device (shapes and dtypes
    only), skipped where an operation cannot run there. Returns what to say of it, or ``None``."""
    if not deferred:
        check_forward(module, layers, sample)
        return None
    meta = microbatch.map_tensors(sample, lambda t: t.to("meta"))
    try:
        check_forward(module, layers, meta)
    except (NotImplementedError, RuntimeError) as err:  # an operation without a meta kernel, or one reading values
        if isinstance(err, RuntimeError) and "meta" not in str(err).lower():
            raise
        return f"the forward check was skipped (on the meta device: {type(err).__name__}: {str(err)[:120]})"
    return "the forward check compared shapes and dtypes only (on the meta device)"


def forward_sample(module: nn.Module) -> Any:
    """A small input for checking ``forward`` against the layers: the first two samples of
    ``example_input_array``, or, in ``fit``, of the first training batch (drawn without changing the data order);
    ``None`` when there is neither."""
    sample = getattr(module, "example_input_array", None)
    if sample is None:
        trainer = compat.attached_trainer(module)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return None
        loader = compat.request_train_dataloader(trainer)
        batch = peek(loader) if loader is not None else None
        if batch is None:
            return None
        sample = pipeline_inputs(module, batch)
    try:
        size = microbatch.batch_size(sample)
    except (TypeError, ValueError):  # no tensor to split: check with the whole sample
        return sample
    device = next((p.device for p in module.parameters()), None)
    if device is not None:
        sample = microbatch.map_tensors(sample, lambda t: t.to(device))
    return microbatch.split(sample, max(1, size // 2))[0] if size > 2 else sample


def shared_across_stages(
    module: nn.Module, layers: list[nn.Module], sizes: list[int]
) -> dict[tuple[int, ...], list[tuple[str, nn.Parameter]]]:
    """The parameters that layers on more than one stage use (a tied embedding and output head), by the stages
    that hold a copy: ``{(0, 3): [("embed.weight = head.weight", p)]}``. The same on every rank (called before the
    split, on the whole model)."""
    bounds = [sum(sizes[: s + 1]) for s in range(len(sizes))]
    stages_of: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for index, layer in enumerate(layers):
        stage = next(s for s, end in enumerate(bounds) if index < end)
        for p in layer.parameters():
            stages_of.setdefault(id(p), set()).add(stage)
            params[id(p)] = p
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    ties: dict[tuple[int, ...], list[tuple[str, nn.Parameter]]] = {}
    for key, stages in stages_of.items():
        if len(stages) > 1:
            ties.setdefault(tuple(sorted(stages)), []).append((" = ".join(names.get(key, ["?"])), params[key]))
    return dict(sorted(ties.items()))


def announce_shared(
    shared: dict[tuple[int, ...], list[tuple[str, Any]]], rank_of: Callable[[int], int] | None = None
) -> None:
    """Say which weights several stages share (``shared_across_stages``) and what is done about them (``rank_of``:
    the rank of a model stage, with several stages per rank)."""
    for holders, named in shared.items():
        ranks = {rank_of(s) for s in holders} if rank_of is not None else set(holders)
        if len(ranks) == 1:
            rank_zero_info(
                f"AvgPipe: {', '.join(name for name, _ in named)} shared by the layers of stages {list(holders)}, "
                f"which rank {min(ranks)} of each pipeline runs: it holds the weight once."
            )
            continue
        rank_zero_info(
            f"AvgPipe: {', '.join(name for name, _ in named)} shared by the layers of stages {list(holders)}: each "
            "keeps a copy, and their gradients are summed over those stages every step (the copies stay equal)."
        )


def check_supported(module: Any, precision_plugin: Any, one_model: bool = True) -> None:
    """Refuse what the strategy cannot train: manual optimization, and ``16-mixed`` with replicas."""
    if not module.automatic_optimization:
        raise PipelineContractError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False), which "
            "strategy='avgpipe' does not support: the strategy runs backward itself. Use automatic optimization."
        )
    plugin = precision_plugin
    scaled = isinstance(plugin, MixedPrecision) and (plugin.precision == "16-mixed" or plugin.scaler is not None)
    if scaled and not one_model:
        raise ValueError(
            "precision='16-mixed' with replicas (num_pipelines x pipeline groups > 1 and averaging='elastic') is not "
            "supported by strategy='avgpipe': the loss scaler would unscale the reference, not the replicas. Use "
            "averaging='exact', precision='bf16-mixed' (no loss scaling needed) or '32-true'."
        )


def metrics_sync_over(module: nn.Module, group: Any, only: Any = None) -> None:
    """Point the module's torchmetrics at ``group`` for their sync (every stage mirrors them, so each stage's
    group of D ranks syncs once); with ``only``, just those that use ``only`` now (``None`` releases them)."""
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric) and (only is None or metric.process_group is only):
            metric.process_group = group
