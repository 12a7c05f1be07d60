"""AvgPipeStrategy's checkpoint hooks: the unsplit model and optimizer state gathered on rank 0, streamed into one
file or written shard by shard into a folder, and loaded back into any layout.

The layout rules live in ``plugin/checkpoint/state.py`` (what a checkpoint holds and how a stage's part is cut from it),
the transports in ``plugin/checkpoint/streamed.py`` (one file) and ``plugin/checkpoint/sharded.py`` (a folder); this
mixin maps Lightning's hooks onto them.
:class:`~lightning_avgpipe.plugin.strategy.AvgPipeStrategy` sets the state it reads.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.checkpoint import sharded, streamed
from lightning_avgpipe.plugin.checkpoint import state as ckpt
from lightning_avgpipe.plugin.checkpoint.optimizer_by_name import Names
from lightning_avgpipe.plugin.compat import _optimizers_to_device
from lightning_avgpipe.plugin.process.base import ProcessStrategy
from lightning_avgpipe.plugin.split.placeholders import Guard
from lightning_avgpipe.plugin.split.stages import SplitModule
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.failures.report import guarded
from lightning_avgpipe.runtime.files import checksums, torchfile
from lightning_avgpipe.runtime.files.disk_full import no_space
from lightning_avgpipe.runtime.files.save_waits import SaveWaits, release_group
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.shards import is_dtensor


def _own_use(method: Callable[..., Any]) -> Callable[..., Any]:
    """A hook where the strategy reads or fills its split module itself (a checkpoint after the run too): its
    placeholders let it (``Guard.allowing``)."""

    @functools.wraps(method)
    def wrapped(self: CheckpointHooks, *args: Any, **kwargs: Any) -> Any:
        split = self._split.as_split() if self._split is not None else contextlib.nullcontext()
        with self._guard.allowing(), split:
            return method(self, *args, **kwargs)

    return wrapped


class Staged(Protocol):
    """What the checkpoint hooks read of their strategy besides ``ProcessStrategy``'s: ``AvgPipeStrategy`` defines
    each. A class that subclasses a protocol must define its members, so mypy refuses a strategy that lacks one."""

    @property
    def topology(self) -> Topology: ...

    @property
    def pipeline(self) -> StagePipeline: ...

    @property
    def partition(self) -> list[int]: ...


class CheckpointHooks(ProcessStrategy, Staged):
    """Lightning's checkpoint hooks for a model split over stages (docs/strategy.md#checkpoints)."""

    # set by AvgPipeStrategy: its settings and the split module's state at setup
    config: PipelineConfig
    save_distributed_checkpoint: bool
    trusted_checkpoints: bool
    _split: SplitModule | None
    _guard: Guard
    _outbox: streamed.Outbox  # a checkpoint being dumped: this rank's tensors, until save_checkpoint
    _param_names: dict[int, str]  # id(parameter) -> its name in the module

    def _lightning(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("AvgPipeStrategy has no LightningModule yet; the Trainer attaches it in fit/validate.")
        return module

    # -- the layout and the hooks ---------------------------------------------------------------------------------
    @property
    def layout(self) -> dict[str, Any]:
        """What a checkpoint's optimizer states depend on: stages, groups, pipelines and the partition."""
        T = self.config.tensor_parallel_size
        return {
            "stages": self.topology.num_stages,
            "groups": self.topology.num_groups,
            "pipelines": self.config.num_pipelines,
            "partition": self.partition,
            **({"tensor_parallel": T} if T > 1 else {}),
        }

    @override
    @_own_use
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsplit model's state dict, under its own names, assembled on rank 0 (empty elsewhere). In Lightning's
        checkpoint dump: this rank's stage as it is (a folder), or on rank 0 the tensors it holds whole and a
        placeholder for each other one, which ``save_checkpoint`` assembles from the ranks' parts as it writes it (one
        file: ``plugin/checkpoint/streamed.py``)."""
        assert self._split is not None
        if compat.dumping_checkpoint(self._trainer_or_none()):  # save_checkpoint writes what this returns
            if self.save_distributed_checkpoint:
                return ckpt.local_state_dict(self._lightning(), self.pipeline)
            # a dump starts here: each rank's parts of the tensors, as it holds them, are streamed at the save
            self._outbox = streamed.Outbox()
            local = ckpt.local_state_dict(self._lightning(), self.pipeline)
            tree = ckpt.state_refs(local, self._split.aliases, self._outbox.tensors)
            with self._waits("a checkpoint's gather of every stage's tensor names to rank 0") as waits:
                parts = self._outbox.gather(tree, *self._ranks, waits)
            merged = {k: v for part in parts or [] for k, v in part.items()}
            return {} if parts is None else ckpt.ordered(merged, self._split.full_keys)
        return ckpt.assemble_state_dict(self._lightning(), self.pipeline, self._split.full_keys)

    @override
    @_own_use
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The unsplit model's optimizer state, and every rank's replicas when N·D > 1, gathered on rank 0. In
        Lightning's checkpoint dump, as ``lightning_module_state_dict`` says."""
        if compat.dumping_checkpoint(self._trainer_or_none()):
            if self.save_distributed_checkpoint:
                return {ckpt.LOCAL: ckpt.optimizer_entry(optimizer, self.pipeline, self._names(), whole=False)}
            box = self._outbox
            entry = ckpt.optimizer_entry(optimizer, self.pipeline, self._names(), whole=False)
            part = ckpt.optimizer_part(entry, box.optimizers, self.global_rank, box.tensors)
            box.optimizers += 1
            with self._waits("a checkpoint's gather of every stage's optimizer state names to rank 0") as waits:
                parts = box.gather(part, *self._ranks, waits)
            return {} if parts is None else ckpt.unsplit_optimizer_state(parts, self.layout, self._names())
        return ckpt.gather_optimizer_state(optimizer, self.pipeline, self.layout, self._names())

    def _names(self) -> Names:
        assert self._split is not None
        return Names(self._param_names, self._split.aliases, self._split.param_names)

    @override
    @_own_use
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.pipeline.replicas.elastic.reclaim()  # a sharded reference a failed step released takes the weights again
        ckpt.load_stage_state(self._lightning(), checkpoint, self.pipeline, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        note = ckpt.load_optimizer_states(self.optimizers, checkpoint, self.pipeline, self.layout, self._names())
        if note is not None:
            rank_zero_info(note)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    @_own_use
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load and verify a checkpoint; a truncated, damaged or corrupt file is named with what to do instead.

        Loads with ``weights_only=True`` unless ``trusted_checkpoints=True`` or the caller passed
        ``weights_only=False``: this strategy's checkpoints hold only tensors and plain values, and unpickling
        anything else can run code from the file on every rank. Each tensor this rank reads is checked against the
        checksum recorded at the save (``runtime/files/checksums.py``).
        """
        weights_only = (not self.trusted_checkpoints) if weights_only is None else weights_only
        local = ckpt.local_path(self.checkpoint_io, checkpoint_path)
        found = sharded.interrupted(local) if local is not None else None
        if found is not None:  # a kill between the two renames of a replace: read the complete one where it is
            rank_zero_info(f"AvgPipe: {checkpoint_path} is missing after an interrupted save; resuming from {found}.")
        if (found or Path(str(checkpoint_path))).is_dir():
            loaded = self._load_sharded(found or Path(str(checkpoint_path)), not weights_only, found is not None)
        else:
            loaded = self._load_file(found or checkpoint_path, weights_only)
            if sharded.CHECKSUMS in loaded:  # this rank's tensors only: the others' pages are never read
                view = ckpt.rank_view(loaded, self._lightning(), self.pipeline, self.layout, self._names())
                checksums.check_tensors(view, loaded[sharded.CHECKSUMS], checkpoint_path)
        loaded.pop(sharded.CHECKSUMS, None)
        module = self.lightning_module
        trainer = compat.attached_trainer(module) if module is not None else None
        ckpt.check_loaded(loaded, checkpoint_path, trainer is not None and trainer.state.fn == TrainerFn.FITTING)
        return loaded

    def _load_file(self, checkpoint_path: Any, weights_only: bool) -> dict[str, Any]:
        """Through the checkpoint IO; a local file through Lightning's default IO memory-mapped instead: every rank
        touches only the bytes of its own stage's tensors."""
        try:
            path = ckpt.local_path(self.checkpoint_io, checkpoint_path)
            if type(self.checkpoint_io) is TorchCheckpointIO and path is not None and zipfile.is_zipfile(path):
                return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)  # type: ignore[no-any-return]
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # unpickling, zip and EOF errors all mean the same to the user
            if weights_only and ckpt.needs_unpickling(err):
                raise ckpt.refused(checkpoint_path, err) from err
            raise ckpt.unreadable(checkpoint_path, err) from err

    @override
    @_own_use
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write on rank 0 to a temporary file, then rename: a crash never leaves a half-written checkpoint. Saving
        sharded, every rank writes its part into a folder (``plugin/checkpoint/sharded.py``)."""
        if self.save_distributed_checkpoint:
            self._save_sharded(checkpoint, filepath)
        elif self._outbox:
            self._save_streamed(checkpoint, filepath, storage_options)
        elif self.is_global_zero:
            ckpt.save_atomically(self.checkpoint_io, checkpoint, filepath, storage_options)

    @property
    def _ranks(self) -> tuple[int, int]:
        return self.global_rank, self.world_size

    def _waits(self, what: str) -> SaveWaits:
        """A save's waits, each bounded by ``p2p_timeout`` however long a live rank's I/O takes
        (``runtime/files/save_waits.py``)."""
        return SaveWaits(what, self.config.p2p_timeout, self.config.timeout)

    @override
    def close(self) -> None:
        release_group()  # the checkpoint group, freed when the groups are destroyed at exit
        super().close()

    @override
    def barrier(self, name: str | None = None) -> None:
        """Lightning's barrier after ``save_checkpoint`` ("Trainer.save_checkpoint") is a save's last wait: bounded
        by ``p2p_timeout`` as the save's own are. Any other barrier is the process group's."""
        if name != "Trainer.save_checkpoint" or self.world_size < 2 or not dist.is_initialized():
            return super().barrier(name)
        with self._waits("the barrier after a checkpoint's save") as waits:
            waits.arrive("barrier")

    def _trainer_or_none(self) -> pl.Trainer | None:
        module = self.lightning_module
        return compat.attached_trainer(module) if module is not None else None

    def _save_streamed(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Rank 0 writes the file tensor by tensor, each other rank's tensor received as it is written
        (``plugin/checkpoint/streamed.py``)."""
        outbox, self._outbox = self._outbox, streamed.Outbox()
        io = self.checkpoint_io
        streams = type(io) is TorchCheckpointIO and storage_options is None  # Lightning's refuses storage_options

        def write(prepared: Any, fetch: Any) -> None:
            if streams and ckpt.local_path(io, filepath) is not None:
                ckpt.save_atomically(
                    io,
                    checkpoint,
                    filepath,
                    storage_options,
                    lambda tmp: torchfile.write(tmp, prepared, fetch, checksums=sharded.CHECKSUMS),
                )
            else:
                whole = streamed.received(prepared, fetch, checkpoint)
                ckpt.save_atomically(io, whole, filepath, storage_options)

        with self._waits("a checkpoint's transfer of every stage's tensors to rank 0") as waits:
            streamed.transfer(checkpoint if self.is_global_zero else None, outbox, *self._ranks, write, waits)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Every rank writes its part into a staging folder, rank 0 renames it into place; each wait of it bounded by
        ``p2p_timeout`` (``runtime/files/save_waits.py``), a slow write never failed for its length."""
        assert self._split is not None
        with self._waits(f"a sharded checkpoint's save ({Path(str(filepath)).name})") as waits:
            box = [str(filepath)]
            if self.world_size > 1:
                waits.collective("started", lambda g: dist.broadcast_object_list(box, 0, group=g))
            path = Path(box[0])
            if self.is_global_zero:
                with guarded("preparing a sharded checkpoint's folder", record=False):  # rank 0's alone
                    sharded.prepare(path)
            waits.arrive("prepared")
            tensors: dict[str, Tensor] = {}
            part = ckpt.sharded_part(checkpoint, self.global_rank, tensors, self._split.aliases)
            staged = sharded.staging(path)
            try:
                with guarded(f"{waits.what} (writing)"):
                    try:
                        files = sharded.write_tensors(staged, tensors, waits.group, waits.writer)
                    except BaseException as err:  # DCP's CheckpointException is a BaseException
                        waits.reraise(err)  # a wait inside torch.distributed.checkpoint that failed, if one did
                        raise
                    waits.finish()  # rank 0: DCP's .metadata
                    if self.is_global_zero:
                        files.update(sharded.file_entries(staged, [sharded.DCP_META], 0))
                # the structure only (each tensor is a reference) and the files' checksums
                parts: list[Any] | None = [(part, files)] if self.world_size == 1 else None
                if self.world_size > 1:
                    parts = [None] * self.world_size if self.is_global_zero else None
                    waits.collective("parts", lambda g: dist.gather_object((part, files), parts, dst=0, group=g))
                if parts is not None:
                    meta = ckpt.merge_parts(
                        checkpoint, [p for p, _ in parts], self._split.full_keys, self.layout, self._names()
                    )
                    sharded.finish(path, meta, {name: entry for _, f in parts for name, entry in f.items()})
            except BaseException as err:
                full = no_space(err, staged / f"__{self.global_rank}_0.distcp")
                if full is None:
                    raise
                if self.is_global_zero:  # every rank's write has ended: DCP's save fails on all of them together
                    shutil.rmtree(staged, ignore_errors=True)
                raise full from None
            waits.arrive("done")

    def _load_sharded(self, path: Path, trusted: bool = False, staged: bool = False) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: its stage's weights, its parameters' optimizer states, and in
        the same layout its own replicas; read by this rank alone, each file it reads checked first."""
        meta, metadata = sharded.check_folder(path, trusted, allow_staged=staged)
        view = ckpt.rank_view(meta, self._lightning(), self.pipeline, self.layout, self._names())
        current = self._lightning().state_dict()  # the weights are read into the parameters themselves
        into = {
            ref[sharded.REF]: current[name]
            for name, ref in view["state_dict"].items()
            if sharded.is_ref(ref) and name in current and not is_dtensor(current[name])
        }
        split_as = ckpt.split_refs(view, current)  # a tensor shard's weight and state: this rank's part alone
        loaded = sharded.read_tensors(path, metadata, sharded.refs_in(view), into, split_as, meta=meta)
        view.pop(sharded.FILES, None)
        return sharded.resolve(view, loaded.__getitem__)
