"""A stage's optimizer state under the unsplit model's parameter names, and back: how a checkpoint's optimizer state
is one ``torch.optim`` state dict of the whole model (``plugin/checkpoint/state.py``), which another layout, or plain
Lightning, splits by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.microbatch import to_cpu
from lightning_avgpipe.algorithms.optim import ElasticOptimizer, hyperparameters, source_groups
from lightning_avgpipe.plugin.checkpoint import sharded
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.sharding.zero import ShardedOptimizer
from lightning_avgpipe.shards import full, like


@dataclass(frozen=True)
class Names:
    """How a stage's parameters are named in the unsplit model (the strategy's, from ``plugin/split/stages.py``)."""

    local: Mapping[int, str]  # id(parameter) -> its name in this rank's module
    aliases: Mapping[str, str]  # a name -> the unsplit model's first name of that parameter (shared weights)
    order: Sequence[str]  # the unsplit model's parameter names, in order, each once


def unsplit_names(pipeline: StagePipeline, names: Names) -> dict[int, str]:
    """``id(reference parameter) -> its name in the unsplit model`` for this stage's own parameters (a stage's copy
    of a shared weight under the weight's first name)."""
    own = {id(p) for p in pipeline.replicas.elastic.reference_params}
    return {i: names.aliases.get(n, n) for i, n in names.local.items() if i in own}


def named_groups(
    optimizer: Optimizer, pipeline: StagePipeline, names: Names, whole: bool = True
) -> list[dict[str, Any]]:
    """This stage's optimizer state per group of the user's optimizer: its hyperparameters and, for each of the
    stage's parameters in it, ``(name in the unsplit model, state)``. With replicas, replica 0's state. ``whole``:
    tensor shards gathered whole, on the CPU; otherwise as they are."""
    named = unsplit_names(pipeline, names)
    if isinstance(optimizer, ElasticOptimizer):
        user, clone = optimizer.user, optimizer.replicas[0]
        to_replica = {
            id(r): q
            for r, q in zip(pipeline.replicas.elastic.reference_params, pipeline.replicas.elastic.replica_params(0))
        }

        def state_of(p: Any) -> Any:
            return clone.state.get(to_replica.get(id(p)), {})  # type: ignore[arg-type]

    else:
        user = optimizer
        # ZeRO-1 by flat slices: the slices gathered into whole tensors on group 0's rank (collective over the stage
        # group); the other groups send their parameters' names without a state
        pieces = optimizer.local_pieces() if isinstance(optimizer, ShardedOptimizer) and not whole else None
        if pieces is not None:  # each rank writes (a folder) or sends (a file) its slices' pieces, nothing gathered
            # a scalar (Adam's step) is one tensor for a slice's parameters: each gets its own, or a file would store
            # it once and a loader step one tensor for every parameter
            states: Any = {
                p: {
                    k: sharded.FlatPieces(tuple(p.shape), v)
                    if isinstance(v, list)
                    else v.clone()
                    if isinstance(v, Tensor)
                    else v
                    for k, v in st.items()
                }
                for p, st in pieces.items()
            }
        else:
            states = optimizer.whole_state(everywhere=False) if isinstance(optimizer, ShardedOptimizer) else user.state

        def state_of(p: Any) -> Any:
            return states.get(p, {})

    return [
        {
            "hyper": hyperparameters(group),
            "params": [
                (named[id(p)], to_cpu({k: full(v) for k, v in state_of(p).items()}) if whole else dict(state_of(p)))
                for p in group["params"]
                if id(p) in named
            ],
        }
        for group in user.param_groups
    ]


def unsplit_state(parts: Sequence[list[dict[str, Any]]], param_names: Sequence[str]) -> dict[str, Any]:
    """One ``torch.optim`` state dict of the unsplit model from every rank's :func:`named_groups`: per group, the
    parameters in the model's order, each once (a stage copy of a shared weight and the D groups' copies of a stage
    have equal states)."""
    order = {n: i for i, n in enumerate(param_names)}
    groups: list[dict[str, Any]] = []
    for g, first in enumerate(parts[0]):
        found: dict[str, Any] = {}
        for part in parts:
            for name, st in part[g]["params"] if g < len(part) else []:
                if st or name not in found:  # a sharded optimizer's state lives on one group only: the non-empty one
                    found[name] = st
        groups.append({"hyper": first["hyper"], "params": sorted(found.items(), key=lambda kv: order.get(kv[0], 1e9))})
    state: dict[int, Any] = {}
    param_groups: list[dict[str, Any]] = []
    index = 0
    for group in groups:
        ids, names = [], []
        for name, st in group["params"]:
            if st:
                state[index] = st
            ids.append(index)
            names.append(name)
            index += 1
        param_groups.append({**group["hyper"], "params": ids, "param_names": names})
    return {"state": state, "param_groups": param_groups}


def load_by_name(optimizer: Optimizer, unified: Mapping[str, Any], pipeline: StagePipeline, names: Names) -> None:
    """Load the unsplit state dict ``unified`` into this stage's optimizer (the user's, or every replica's clone)."""
    saved_groups = unified["param_groups"]
    user = optimizer.user if isinstance(optimizer, ElasticOptimizer) else optimizer
    if len(saved_groups) != len(user.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups and configure_optimizers() now "
            f"builds {len(user.param_groups)}; resume with the same optimizer groups."
        )
    by_name = [dict(zip(g["param_names"], g["params"])) for g in saved_groups]
    ref = pipeline.replicas.elastic.reference_params
    name_of = unsplit_names(pipeline, names)

    def local(groups: Sequence[Mapping[str, Any]], source: Sequence[int], to_ref: Mapping[int, Any]) -> dict[str, Any]:
        state: dict[int, Any] = {}
        out_groups = []
        index = 0
        for group, g in zip(groups, source):
            ids = []
            for p in group["params"]:
                name = name_of.get(id(to_ref.get(id(p), p)))
                saved = by_name[g].get(name) if name is not None else None
                if saved is not None and saved in unified["state"]:  # a tensor-parallel shard: its part of it
                    state[index] = {k: like(v, p, whole=True) for k, v in unified["state"][saved].items()}
                ids.append(index)
                index += 1
            out_groups.append({**hyperparameters(saved_groups[g]), "params": ids})
        return {"state": state, "param_groups": out_groups}

    if isinstance(optimizer, ElasticOptimizer):
        for group, saved in zip(user.param_groups, saved_groups):
            group.update(hyperparameters(saved))
        for n, clone in enumerate(optimizer.replicas):
            to_ref = {id(q): r for q, r in zip(pipeline.replicas.elastic.replica_params(n), ref)}
            clone.load_state_dict(local(clone.param_groups, source_groups(clone), to_ref))
    else:
        user.load_state_dict(local(user.param_groups, list(range(len(user.param_groups))), {}))
