"""Checkpoints of a split model: the unsplit model's state dict on rank 0, every rank's optimizer state and replicas,
and files that are never left half-written."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_avgpipe.microbatch import to_cpu
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.runtime.pipeline import StagePipeline


def assemble_state_dict(module: nn.Module, pipeline: StagePipeline, full_keys: Sequence[str]) -> dict[str, Any]:
    """The unsplit model's state dict, under its own names and order, on the pipeline's first stage (collective;
    ``{}`` elsewhere)."""
    pipeline.elastic.wait()  # the checkpoint holds the up-to-date reference
    local = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    parts = pipeline.gather(local)
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    missing = [k for k in full_keys if k not in merged]
    if missing:
        raise RuntimeError(f"Assembling the checkpoint lost keys {missing[:5]}; this is a bug in AvgPipeStrategy.")
    ordered = {k: merged.pop(k) for k in full_keys}
    ordered.update(merged)
    return ordered


def gather_optimizer_state(optimizer: Optimizer, pipeline: StagePipeline, layout: dict[str, Any]) -> dict[str, Any]:
    """Every rank's optimizer state (and its replicas' weights when N·D > 1), gathered on global rank 0.

    Saved as ``{"avgpipe_layout": {...}, "avgpipe_ranks": [per global rank {"optim", "replicas"}]}`` so a resume
    with the same layout continues exactly.
    """
    inner = compat.unwrap_optimizer(optimizer)
    elastic = pipeline.elastic
    replicas = [] if elastic.trivial else [[to_cpu(m.state_dict()) for m in layers] for layers in elastic.replicas]
    entry: dict[str, Any] = {"optim": inner.state_dict(), "replicas": replicas}
    if not elastic.trivial:  # the averaging period's position and offsets, the outer momentum
        elastic.wait()
        entry["elastic"] = to_cpu(elastic.state_dict())
    top = pipeline.topology
    if top.world_size == 1:
        parts: list[Any] | None = [entry]
    else:
        parts = [None] * top.world_size if top.rank == 0 else None
        dist.gather_object(entry, parts, dst=0)
    if parts is None:
        return {}
    return {"avgpipe_layout": layout, "avgpipe_ranks": parts}


def load_stage_state(module: nn.Module, checkpoint: Mapping[str, Any], pipeline: StagePipeline, strict: bool) -> None:
    """This stage's weights from a full checkpoint; the replicas restart from them (unless the optimizer state
    brings their own)."""
    full = checkpoint["state_dict"]
    local_keys = module.state_dict().keys()
    missing = [k for k in local_keys if k not in full]
    if strict and missing:
        raise KeyError(
            f"The checkpoint lacks {missing[:5]} that stage {pipeline.stage} holds; it was saved from another model."
        )
    module.load_state_dict({k: full[k] for k in local_keys if k in full}, strict=False)
    pipeline.elastic.reset_replicas()


def load_optimizer_states(
    optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any], pipeline: StagePipeline, layout: dict[str, Any]
) -> str | None:
    """Restore this rank's optimizer state and replicas; returns a note when the checkpoint's layout differs (then
    only the hyperparameters are restored)."""
    note = None
    for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
        if "avgpipe_layout" not in state:
            raise ValueError(
                "This checkpoint's optimizer state was not saved by AvgPipeStrategy and cannot be split by stage; "
                "load its weights with MyModule.load_from_checkpoint(path) and start a new fit instead."
            )
        if state["avgpipe_layout"] != layout:
            note = (
                f"AvgPipe: the checkpoint's layout {state['avgpipe_layout']} differs from {layout}; the weights and "
                "the optimizer's hyperparameters (lr, ...) are restored, the replicas start from the reference and "
                "optimizer states start fresh."
            )
            saved = state["avgpipe_ranks"][0]["optim"]
            groups = saved.get("user_param_groups") or [
                {k: v for k, v in g.items() if k != "params"} for g in saved.get("param_groups", [])
            ]
            if len(groups) == len(optimizer.param_groups):
                for group, values in zip(optimizer.param_groups, groups):
                    group.update({k: v for k, v in values.items() if k != "params"})
            continue
        entry = state["avgpipe_ranks"][pipeline.topology.rank]
        optimizer.load_state_dict(entry["optim"])
        for layers, saved_layers in zip(pipeline.elastic.replicas, entry["replicas"]):
            for layer, layer_state in zip(layers, saved_layers):
                layer.load_state_dict(layer_state)
        if "elastic" in entry and not pipeline.elastic.trivial:
            pipeline.elastic.load_state_dict(entry["elastic"])
    return note


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


def save_atomically(checkpoint_io: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
    """Write to a temporary file beside ``filepath``, then rename: a crash never leaves a half-written checkpoint.

    Remote paths (``s3://...``) and ``AsyncCheckpointIO`` go straight to the checkpoint IO: a local rename cannot
    address the one, and would run before the other's background write.
    """
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    text = str(filepath)
    if ("://" in text and not text.startswith("file://")) or isinstance(checkpoint_io, AsyncCheckpointIO):
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    path = Path(text[len("file://") :] if text.startswith("file://") else text)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
