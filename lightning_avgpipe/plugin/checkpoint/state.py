"""Checkpoints of a split model: the unsplit model's state dict on rank 0, every rank's optimizer state and replicas
(under the unsplit model's parameter names: ``plugin/checkpoint/optimizer_by_name.py``), and files never left
half-written."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.microbatch import to_cpu
from lightning_avgpipe.algorithms.optim import ElasticOptimizer, hyperparameters
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.checkpoint import sharded
from lightning_avgpipe.plugin.checkpoint.optimizer_by_name import (
    Names,
    load_by_name,
    named_groups,
    unsplit_names,
    unsplit_state,
)
from lightning_avgpipe.runtime.failures.report import guarded
from lightning_avgpipe.runtime.files import checksums
from lightning_avgpipe.runtime.files.disk_full import no_space
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer
from lightning_avgpipe.shards import full, is_dtensor, like, same_data, to_local_tree


def assemble_state_dict(module: nn.Module, pipeline: StagePipeline, full_keys: Sequence[str]) -> dict[str, Any]:
    """The unsplit model's state dict, under its own names and order, on the first pipeline group's first stage
    (collective; ``{}`` elsewhere). The D groups hold the same weights: only the first group's are pickled."""
    state = whole_state_dict(module, pipeline)  # collective over a tensor or stage group: every rank takes part
    first = pipeline.topology.group_index == 0
    parts = pipeline.gather(state if first else {})
    if parts is None or not first:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return ordered(merged, full_keys)


def whole_state_dict(module: nn.Module, pipeline: StagePipeline) -> dict[str, Any]:
    """This stage's weights under the unsplit model's names, on the CPU, tensor shards gathered whole (collective
    over a tensor group)."""
    pipeline.replicas.elastic.wait()  # the checkpoint holds the up-to-date reference
    pipeline.replicas.elastic.require_whole("Saving the model")
    copies: dict[Any, Tensor] = {}  # a weight under two names is copied once, and stored once
    out = {}
    for k, v in module.state_dict().items():
        same = same_data(v)
        if same is None or same not in copies:
            copy = full(v).detach().cpu()
            if same is not None:
                copies[same] = copy
        out[k] = copies[same] if same is not None else copy
    return out


def ordered(merged: dict[str, Any], full_keys: Sequence[str]) -> dict[str, Any]:
    """A state dict in the unsplit model's order (keys it does not name after)."""
    missing = [k for k in full_keys if k not in merged]
    if missing:
        raise RuntimeError(f"Assembling the checkpoint lost keys {missing[:5]}; this is a bug in AvgPipeStrategy.")
    return {k: merged.pop(k) for k in full_keys} | merged


def optimizer_entry(optimizer: Optimizer, pipeline: StagePipeline, names: Names, whole: bool = True) -> dict[str, Any]:
    """This rank's part of the optimizer's checkpoint: ``"named"`` (:func:`named_groups`) and, with N·D > 1
    replicas, its own optimizers' states, the replicas' weights and the averaging's state (``"optim"``,
    ``"replicas"``, ``"elastic"``). ``whole=False`` keeps each rank's part as it holds it (a ``DTensor``, ZeRO-1's
    ``FlatPieces``), with no collective but ZeRO-1's under tensor parallelism: a folder writes it, a single file
    assembles each tensor from the ranks' parts (``plugin/checkpoint/streamed.py``)."""
    inner = compat.unwrap_optimizer(optimizer)
    elastic = pipeline.replicas.elastic
    named = named_groups(inner, pipeline, names, whole)  # collective over a tensor group when whole
    if whole and pipeline.topology.tensor_rank > 0:  # shard 0 of the stage sends the whole tensors; the rest copies
        named = [{**group, "params": []} for group in named]
    entry: dict[str, Any] = {"named": named, "replicas": []}
    if not elastic.trivial:  # the replicas' optimizers and weights, the period's position and offsets, the momentum
        elastic.wait()
        entry["optim"] = to_local_tree(inner.state_dict())  # a rank's own entry: its shards, as they are
        entry["replicas"] = [[to_cpu(to_local_tree(m.state_dict())) for m in layers] for layers in elastic.replicas]
        entry["elastic"] = to_cpu(elastic.state_dict())
    return entry


def unsplit_optimizer_state(parts: list[dict[str, Any]], layout: dict[str, Any], names: Names) -> dict[str, Any]:
    """Every rank's :func:`optimizer_entry` (in rank order) as one ``torch.optim`` state dict of the unsplit model
    plus ``"avgpipe_layout"`` and ``"avgpipe_ranks"``."""
    unified = unsplit_state([part.pop("named") for part in parts], names.order)
    return {**unified, "avgpipe_layout": layout, "avgpipe_ranks": parts}


def gather_optimizer_state(
    optimizer: Optimizer, pipeline: StagePipeline, layout: dict[str, Any], names: Names
) -> dict[str, Any]:
    """Every rank's optimizer state, gathered on global rank 0 (collective; ``{}`` elsewhere).

    Saved as a ``torch.optim`` state dict of the unsplit model (``"state"`` and ``"param_groups"``, each group with
    its ``"param_names"``), which plain Lightning on one device or DDP loads as it is and another layout splits by
    name, plus ``"avgpipe_layout"`` and ``"avgpipe_ranks"``: per global rank, with N·D > 1 replicas, their own
    optimizers' states, weights and the averaging's state, so a resume with the same layout continues exactly.
    """
    entry = optimizer_entry(optimizer, pipeline, names)
    top = pipeline.topology
    if top.group_index > 0 and not isinstance(compat.unwrap_optimizer(optimizer), ShardedOptimizer):
        # the D groups' states are copies (replica 0's is the first group's): rank 0 unpickles one of them
        entry["named"] = [{**g, "params": [(n, {}) for n, _ in g["params"]]} for g in entry["named"]]
    if top.world_size == 1:
        parts: list[Any] | None = [entry]
    else:
        parts = [None] * top.world_size if top.rank == 0 else None
        with guarded("a checkpoint's gather of every stage's state to rank 0"):
            dist.gather_object(entry, parts, dst=0)
    if parts is None:
        return {}
    return unsplit_optimizer_state(parts, layout, names)


# -- sharded checkpoints (plugin/checkpoint/sharded.py's folder) -------------------------------------------------
LOCAL = "avgpipe_local"  # optimizer_state()'s value when saving sharded: this rank's entry, not yet merged


def local_state_dict(module: nn.Module, pipeline: StagePipeline) -> dict[str, Any]:
    """This stage's weights under the unsplit model's names, tensor shards as they are (a sharded save)."""
    pipeline.replicas.elastic.wait()
    pipeline.replicas.elastic.require_whole("Saving the model")
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in module.state_dict().items()}


def optimizer_part(entry: Mapping[str, Any], i: int, rank: int, tensors: dict[str, Tensor]) -> dict[str, Any]:
    """:func:`optimizer_entry` ``entry`` of optimizer ``i`` with each tensor a reference (its key and value put in
    ``tensors``): the per-parameter states under the unsplit names, the rest under the rank."""
    rest = dict(entry)
    named = [
        {
            "hyper": sharded.to_refs(group["hyper"], f"optimizer_states.{i}.rank{rank}.hyper{g}", tensors),
            "params": [
                (name, sharded.to_refs(st, f"optimizer_states.{i}.state.{name}", tensors))
                for name, st in group["params"]
            ],
        }
        for g, group in enumerate(rest.pop("named"))
    ]
    return {**sharded.to_refs(rest, f"optimizer_states.{i}.rank{rank}", tensors), "named": named}


def state_refs(state: Mapping[str, Any], aliases: Mapping[str, str], tensors: dict[str, Tensor]) -> dict[str, Any]:
    """A stage's weights, each a reference (its key and value put in ``tensors``) keyed by the unsplit model's first
    name of that weight (``aliases``): a weight under two names, or tied across stages (the same values on two
    ranks), has one key, so it is stored once and read back under every name."""
    seen: dict[Any, str] = {}
    return {
        name: sharded.to_refs(v, f"state_dict.{aliases.get(name, name)}", tensors, seen) for name, v in state.items()
    }


def sharded_part(
    checkpoint: Mapping[str, Any], rank: int, tensors: dict[str, Tensor], aliases: Mapping[str, str]
) -> dict[str, Any]:
    """This rank's weights and optimizer entries with each tensor a reference (its key and value put in
    ``tensors``)."""
    part: dict[str, Any] = {"state_dict": state_refs(checkpoint.get("state_dict", {}), aliases, tensors)}
    if "optimizer_states" in checkpoint:
        part["optimizer_states"] = [
            optimizer_part(state[LOCAL], i, rank, tensors) for i, state in enumerate(checkpoint["optimizer_states"])
        ]
    return part


def merge_parts(
    checkpoint: Mapping[str, Any],
    parts: list[dict[str, Any]],
    full_keys: Sequence[str],
    layout: dict[str, Any],
    names: Names,
) -> dict[str, Any]:
    """Rank 0: the sharded checkpoint's ``avgpipe.pt``, Lightning's checkpoint with every rank's part merged as the
    single file would hold it (the unsplit model's state dict and optimizer state), references for tensors."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part["state_dict"])
    meta["state_dict"] = {k: merged.pop(k) for k in full_keys if k in merged} | merged
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = [
            unsplit_optimizer_state([part["optimizer_states"][i] for part in parts], layout, names)
            for i in range(len(checkpoint["optimizer_states"]))
        ]
    meta[sharded.SHARDED] = {"world_size": len(parts), "layout": layout}
    return meta


def rank_view(
    meta: Mapping[str, Any], module: nn.Module, pipeline: StagePipeline, layout: dict[str, Any], names: Names
) -> dict[str, Any]:
    """The part of a sharded checkpoint's ``avgpipe.pt`` this rank loads, references still in it: its stage's
    weights, its parameters' optimizer states and, in the same layout, its own entry."""
    view = dict(meta)
    saved = meta.get("state_dict", {})
    view["state_dict"] = {k: saved[k] for k in module.state_dict() if k in saved}
    own = set(unsplit_names(pipeline, names).values())
    same = meta.get(sharded.SHARDED, {}).get("layout") == layout
    states = []
    for state in meta.get("optimizer_states", []):
        index_name = {i: n for g in state["param_groups"] for i, n in zip(g["params"], g.get("param_names", []))}
        ranks = state.get("avgpipe_ranks", [])
        states.append(
            {
                **state,
                "state": {i: st for i, st in state["state"].items() if index_name.get(i) in own},
                "avgpipe_ranks": [
                    e if same and r == pipeline.topology.rank else {k: None for k in e} for r, e in enumerate(ranks)
                ],
            }
        )
    if "optimizer_states" in meta:
        view["optimizer_states"] = states
    view.pop(sharded.SHARDED, None)
    return view


def split_refs(view: Mapping[str, Any], current: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """In a rank's view of a sharded checkpoint (:func:`rank_view`): the reference of each weight and optimizer
    state of a tensor-parallel parameter (``current``: the module's state dict, DTensors for those), and the
    parameter whose layout it is read in."""
    split = {n: t for n, t in current.items() if is_dtensor(t)}
    out = {
        ref[sharded.REF]: split[n]
        for n, ref in view.get("state_dict", {}).items()
        if sharded.is_ref(ref) and n in split
    }
    for state in view.get("optimizer_states", []):
        index_name = {i: n for g in state["param_groups"] for i, n in zip(g["params"], g.get("param_names", []))}
        for i, st in state["state"].items():
            param = split.get(index_name.get(i, ""))
            if param is not None:
                out.update({v[sharded.REF]: param for v in st.values() if sharded.is_ref(v)})
    return out


def load_stage_state(module: nn.Module, checkpoint: Mapping[str, Any], pipeline: StagePipeline, strict: bool) -> None:
    """This stage's weights from a full checkpoint; the replicas restart from them (unless the optimizer state
    brings their own)."""
    full = checkpoint["state_dict"]
    local_keys = module.state_dict().keys()
    missing = [k for k in local_keys if k not in full]
    if strict and missing:
        raise KeyError(
            f"The checkpoint lacks {missing[:5]} that stage {pipeline.topology.stage} holds; it was saved from another "
            "model."
        )
    load_whole(module, {k: full[k] for k in local_keys if k in full})
    pipeline.replicas.elastic.reset_replicas()


def load_whole(module: nn.Module, state: Mapping[str, Any], whole: bool = True) -> None:
    """``module.load_state_dict(state, strict=False)``, a tensor-parallel weight taking its shard of a whole tensor
    (``whole``) or its own local part (a rank's own checkpoint entry)."""
    current = module.state_dict()
    module.load_state_dict(
        {k: like(v, current[k], whole=whole) if k in current else v for k, v in state.items()}, strict=False
    )


def relayout_state(optimizer: Optimizer) -> None:
    """After ``load_state_dict`` of a rank's own (local) entry: each tensor-parallel parameter's state as DTensors."""
    inner = compat.unwrap_optimizer(optimizer)
    for opt in [inner.user, *inner.replicas] if isinstance(inner, ElasticOptimizer) else [inner]:
        for p, st in opt.state.items():
            for k, v in st.items():
                st[k] = like(v, p)


def load_optimizer_states(
    optimizers: Sequence[Optimizer],
    checkpoint: Mapping[str, Any],
    pipeline: StagePipeline,
    layout: dict[str, Any],
    names: Names,
) -> str | None:
    """Restore this rank's optimizer state (and replicas); returns a note when the checkpoint's layout differs.

    The same layout restores every rank's own entry (the replicas' optimizers, weights and averaging state). Another
    layout, or a checkpoint of plain Lightning whose optimizer groups carry ``param_names``, takes each parameter's
    state from the unsplit ``torch.optim`` state dict by name: exact for one model per stage (N·D = 1 or exact
    averaging); with replicas, each starts from the reference with the saved (replica 0's) state.
    """
    note = None
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        saved_layout = state.get("avgpipe_layout")
        groups = state.get("param_groups")
        named = isinstance(groups, list) and all(isinstance(g, Mapping) and "param_names" in g for g in groups)
        if saved_layout is None and not named:
            raise ValueError(
                "This checkpoint's optimizer state was not saved by AvgPipeStrategy and names no parameters (its "
                "param_groups have no 'param_names'), so it cannot be split by stage; load its weights with "
                "MyModule.load_from_checkpoint(path) and start a new fit, or build the optimizer from "
                "self.named_parameters() so its state names them."
            )
        entry = state["avgpipe_ranks"][pipeline.topology.rank] if saved_layout == layout else None
        if entry is not None and "optim" in entry:  # the same layout with replicas (or a checkpoint from before names)
            optimizer.load_state_dict(entry["optim"])
            relayout_state(optimizer)
            for layers, saved_layers in zip(pipeline.replicas.elastic.replicas, entry["replicas"]):
                for layer, layer_state in zip(layers, saved_layers):
                    load_whole(layer, layer_state, whole=False)
            if "elastic" in entry and not pipeline.replicas.elastic.trivial:
                pipeline.replicas.elastic.load_state_dict(entry["elastic"])
            continue
        if not named:  # an AvgPipe checkpoint from before the unsplit state, under another layout
            note = (
                f"AvgPipe: the checkpoint's layout {saved_layout} differs from {layout} and names no parameters (it "
                "predates that); the weights and the optimizer's hyperparameters (lr, ...) are restored, optimizer "
                "states start fresh."
            )
            restore_hyperparameters(optimizer, state["avgpipe_ranks"][0]["optim"])
            continue
        load_by_name(compat.unwrap_optimizer(optimizer), state, pipeline, names)
        if saved_layout != layout:
            had_replicas = any("optim" in e for e in state.get("avgpipe_ranks", []))
            note = (
                f"AvgPipe: the checkpoint's layout {saved_layout or 'plain Lightning'} differs from {layout}; the "
                "optimizer state moved to this layout by parameter name"
                + (
                    "; the replicas start from the reference, each with the saved (replica 0's) optimizer state, "
                    "and their spread and the averaging's state start anew."
                    if not pipeline.replicas.elastic.trivial
                    else " from replica 0's state: not exact, the other replicas' states are left behind."
                    if had_replicas
                    else " (exact: one model per stage)."
                )
            )
    return note


def restore_hyperparameters(optimizer: Optimizer, saved: Mapping[str, Any]) -> None:
    groups = saved.get("user_param_groups") or [
        {k: v for k, v in g.items() if k != "params"} for g in saved.get("param_groups", [])
    ]
    if len(groups) == len(optimizer.param_groups):
        for group, values in zip(optimizer.param_groups, groups):
            group.update(hyperparameters(values))


def check_loaded(checkpoint: Mapping[str, Any], path: Any, fitting: bool) -> None:
    """A training checkpoint has weights and optimizer states; validate/test/predict need only the weights."""
    missing = [k for k in ("state_dict", "optimizer_states") if k not in checkpoint]
    if not fitting and "state_dict" in checkpoint:
        missing = []  # save_weights_only checkpoints
    if missing:
        raise ValueError(f"The checkpoint {path} lacks {missing}; it is not a training checkpoint.")


def needs_unpickling(err: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` refused the file for holding more than tensors and plain values."""
    return isinstance(err, pickle.UnpicklingError) and "weights_only" in str(err)


def refused(path: Any, err: BaseException) -> ValueError:
    what = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0][:200]
    return ValueError(
        f"Refusing to load the checkpoint {path}: it holds objects other than tensors and plain values ({what}), and "
        "unpickling them can run code from the file on every rank, so AvgPipeStrategy loads with weights_only=True. "
        "If you trust the file, load it with AvgPipeStrategy(trusted_checkpoints=True) (weights_only=False)."
    )


def unreadable(path: Any, err: BaseException) -> ValueError:
    return ValueError(
        f"Cannot read the checkpoint {path}: it is truncated or corrupt ({type(err).__name__}: {str(err)[:200]}). "
        "AvgPipeStrategy renames a checkpoint into place only once it is complete, so resume from the previous "
        "checkpoint (ModelCheckpoint keeps them under its dirpath)."
    )


def local_path(checkpoint_io: Any, filepath: Any) -> Path | None:
    """Where a checkpoint is renamed into place: ``None`` for a remote path (``s3://...``) or ``AsyncCheckpointIO``
    (a local rename cannot address the one, and would run before the other's background write)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    text = str(filepath)
    if ("://" in text and not text.startswith("file://")) or isinstance(checkpoint_io, AsyncCheckpointIO):
        return None
    return Path(text[len("file://") :] if text.startswith("file://") else text)


def save_atomically(
    checkpoint_io: Any,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any,
    write: Callable[[Path], None] | None = None,
) -> None:
    """Write to a temporary file beside ``filepath`` (with ``checkpoint_io``, or ``write(tmp)``), then rename: a
    crash never leaves a half-written checkpoint. A remote path or ``AsyncCheckpointIO`` goes straight to the
    checkpoint IO (:func:`local_path`). Written through the checkpoint IO, the file also holds each tensor's
    checksum (``runtime/files/checksums.py``; ``write`` adds its own); a full disk is said as such."""
    if write is None:
        checkpoint = {**checkpoint, sharded.CHECKSUMS: checksums.tensor_checksums(checkpoint)}
    path = local_path(checkpoint_io, filepath)
    if path is None:
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if write is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                write(tmp)
            except PermissionError:
                tmp.unlink(missing_ok=True)  # said below, as for the checkpoint IO
        else:
            checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        if not tmp.exists():  # Lightning's _atomic_save swallows a PermissionError and writes nothing
            raise PermissionError(
                f"Cannot save the checkpoint {path}: nothing could be written in its directory {path.parent}, which "
                "is not writable by this process. Make it writable, or save elsewhere (ModelCheckpoint(dirpath=...), "
                "Trainer(default_root_dir=...))."
            )
        os.replace(tmp, path)
    except Exception as err:
        full = no_space(err, tmp)
        if full is None:
            raise
        raise full from None
    finally:
        if tmp.exists():
            tmp.unlink()
