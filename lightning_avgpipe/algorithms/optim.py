"""The optimizer Lightning sees when N·D > 1: the user's optimizer driving one clone per replica, then the pull."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.elastic import ElasticAveraging


def clone_optimizer(optimizer: Optimizer, params: Sequence[nn.Parameter], like: Sequence[nn.Parameter]) -> Optimizer:
    """A fresh optimizer of ``optimizer``'s class and hyperparameters over ``params`` (``like[i]`` -> ``params[i]``).

    Parameters of ``optimizer`` that are not in ``like`` (a parameter-free stage's anchor) are left out.
    """
    mapping = {id(p): q for p, q in zip(like, params)}
    groups = []
    source: list[int] = []  # the clone's group g has the hyperparameters of the user's group source[g]
    for index, group in enumerate(optimizer.param_groups):
        mapped = [mapping[id(p)] for p in group["params"] if id(p) in mapping]
        if mapped:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mapped})
            source.append(index)
    if not groups:
        groups = [{"params": [nn.Parameter(torch.empty(0))]}]
    accepted = inspect.signature(type(optimizer)).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        clone = type(optimizer)(groups, **kwargs)
        clone._avgpipe_source_groups = source  # type: ignore[attr-defined]
        return clone
    except TypeError as err:
        raise TypeError(
            f"num_pipelines > 1 needs one copy of your {type(optimizer).__name__} per parallel pipeline, built as "
            f"{type(optimizer).__name__}(param_groups, **defaults), which failed: {err}. Use a torch.optim optimizer "
            "or one whose constructor takes its defaults as keyword arguments."
        ) from err


class WrappedOptimizer(Optimizer):
    """The user's optimizer behind a step of the pipeline's own (``ElasticOptimizer``, ``runtime.zero``): its
    ``param_groups`` and ``state`` are the user's, so lr schedulers (which Lightning binds to that optimizer) and
    ``LearningRateMonitor`` see the user's optimizer. ``Optimizer.__init__`` is not called."""

    def __init__(self, user: Optimizer) -> None:
        self.user = user
        self.optimizer = user  # what LearningRateMonitor looks for when it unwraps an optimizer
        self.defaults = user.defaults

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.user.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.user.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        return self.user.state

    @state.setter
    def state(self, value: Any) -> None:
        self.user.state = value


class ElasticOptimizer(WrappedOptimizer):
    """One optimizer to Lightning: steps every replica's own optimizer, then applies the elastic update.

    Before every step the user's hyperparameters (which lr schedulers change) are copied to each replica's
    optimizer; the state lives in the replicas' optimizers.
    """

    def __init__(self, user: Optimizer, replicas: Sequence[Optimizer], elastic: ElasticAveraging) -> None:
        super().__init__(user)
        self.replicas = list(replicas)
        self.elastic = elastic

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.replicas:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        self.elastic.enter_step()  # a sharded reference is released for the forward and backward
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        user_groups = self.user.param_groups
        for opt in self.replicas:  # by the user's group each clone group came from (groups empty here are left out)
            for index, dst in zip(source_groups(opt), opt.param_groups):
                dst.update({k: v for k, v in user_groups[index].items() if k != "params"})
        self.elastic.begin_step()
        for opt in self.replicas:
            opt.step()
        self.elastic.finish_step()
        self.elastic.leave_step()  # ... and whole again for what runs between steps
        self.user._opt_called = True  # type: ignore[attr-defined]  # lr schedulers check the user's optimizer stepped
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the user's optimizer and, mapped to each replica's parameters, to every replica's clone
        (fine-tuning callbacks such as ``BaseFinetuning`` unfreeze layers this way)."""
        self.user.add_param_group(param_group)
        index = len(self.user.param_groups) - 1
        added = self.user.param_groups[index]
        position = {id(p): i for i, p in enumerate(self.elastic.reference_params)}
        for n, opt in enumerate(self.replicas):
            replica = self.elastic.replica_params(n)
            mapped = [replica[position[id(p)]] for p in added["params"] if id(p) in position]
            if mapped:
                opt.add_param_group({**{k: v for k, v in added.items() if k != "params"}, "params": mapped})
                source_groups(opt).append(index)

    def state_dict(self) -> dict[str, Any]:
        return {"replicas": [opt.state_dict() for opt in self.replicas], "user_param_groups": _groups(self.user)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, state in zip(self.replicas, state_dict["replicas"]):
            opt.load_state_dict(state)
        for group, saved in zip(self.user.param_groups, state_dict.get("user_param_groups", [])):
            group.update(saved)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({type(self.user).__name__} x {len(self.replicas)} replicas)"


def source_groups(clone: Optimizer) -> list[int]:
    """The user's group index of each of ``clone``'s groups (positional for a clone not made here)."""
    source = getattr(clone, "_avgpipe_source_groups", None)
    if source is None:
        source = list(range(len(clone.param_groups)))
        clone._avgpipe_source_groups = source  # type: ignore[attr-defined]
    return source  # type: ignore[no-any-return]


def _groups(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [hyperparameters(g) for g in optimizer.param_groups]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group without its parameters (``"params"``, and ``"param_names"`` where torch keeps them)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}
